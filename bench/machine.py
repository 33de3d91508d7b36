"""CPU time counters the benchmarks share: how busy the whole machine was, and how much of that was this process.

These machines are shared and noisy, so a benchmark reports the share of CPU time other processes took while it
measured, next to its figures."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_ticks() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, all cores, from the first line of /proc/stat (0, 0
    where unavailable)."""
    try:
        values = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    idle = values[3] + (values[4] if len(values) > 4 else 0.0)  # idle + iowait
    return (sum(values) - idle) / hz, sum(values) / hz


def own_cpu() -> float:
    """CPU seconds this process has used (user + system, all its threads)."""
    t = os.times()
    return t.user + t.system
