"""What the benchmarks share: CPU time counters (how busy the whole machine was, and how much of that was this
process), :func:`patched`, which switches one of mtpipe's speed tricks off for a baseline row, and :func:`spread`,
a measurement's rounds as a table cell.

These machines are shared and noisy, so a benchmark reports the share of CPU time other processes took while it
measured, next to its figures."""

from __future__ import annotations

import contextlib
import os
import statistics
from pathlib import Path
from typing import Any, Iterator


@contextlib.contextmanager
def patched(*changes: tuple[Any, str, Any]) -> Iterator[None]:
    """Each ``(owner, name, value)``: ``owner.name`` set to ``value`` for the length of the block, the old values put
    back afterwards (also when the block raises), so a baseline row cannot leak its switch into the next row."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in changes]
    try:
        for owner, name, value in changes:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, old in reversed(saved):
            setattr(owner, name, old)


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


def spread(values: list[float]) -> str:
    """Rounds as "median (min-max)", two decimals."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"
