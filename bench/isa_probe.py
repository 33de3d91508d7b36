#!/usr/bin/env python3
"""What torch will use on this CPU under the current environment: one line of JSON.

The benchmarks run it as a subprocess under each run's environment (``--isa avx2`` sets ``ATEN_CPU_CAPABILITY=avx2``,
``ONEDNN_MAX_CPU_ISA=AVX2`` and ``FBGEMM_ENABLE_INSTRUCTIONS=AVX2``) to show that a restriction takes effect: torch's
dispatch level drops to AVX2, a bf16 matmul drops from bf16 speed to far below fp32's (no native bf16 left to use),
and the int8 product of ``decode.precision=int8`` slows down where the CPU has AVX-512 VNNI. fbgemm, which runs that
product, picks its kernels from the CPU's flags by itself: neither of torch's two switches reaches it (on a 2-vCPU
Zen 5, ``int8_gops`` 1,473 under them, 480 with ``FBGEMM_ENABLE_INSTRUCTIONS=AVX2`` as well).

    python bench/isa_probe.py [--size 1024]      # threads: OMP_NUM_THREADS, else 2

Fields: ``cpu_flags`` (the AVX / AMX / FMA flags of /proc/cpuinfo), ``torch_capability`` (torch's CPU dispatch level),
``native_bf16`` (what ``precision: auto`` sees), ``fp32_gflops`` and ``bf16_gflops`` (an n x n x n matmul, best of 5),
``fp32_mtpipe_gflops`` (the same float32 product by the route of mtpipe's float32 layers, ``mtpipe.kernels.mm``:
oneDNN's, which runs AVX-512 on AMD CPUs where torch's own, MKL's, runs AVX2),
``int8_gops`` (mtpipe's int8 decoding layer, 64 rows x 512 x 8,000, best of 20).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# What an AVX2-only CPU offers, on a CPU with more: every torch-side library's own switch (torch's dispatch level,
# oneDNN's, and fbgemm's, which heeds neither of the first two). The one definition the benchmarks import (they run
# as ``python bench/x.py``, so this directory is on their path); importing it loads no torch. bench/anchors.py adds
# the switches of the other systems' libraries (CTranslate2, torch 1.13's MKL).
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"}


def matmul_gflops(dtype, n: int, reps: int = 5, route: str = "torch") -> float:
    """The best of ``reps`` n x n x n matmuls, in GFLOP/s (best, not mean: other processes may share the CPU).
    ``route``: ``torch`` (``a @ b``: MKL's for float32 on x86) or ``mtpipe`` (:func:`mtpipe.kernels.mm`, the route of
    mtpipe's float32 layers: oneDNN's)."""
    import torch

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    if route == "torch":
        product = lambda: a @ b  # noqa: E731
    else:
        from mtpipe.kernels import mm

        product = lambda: mm(a, b)  # noqa: E731
    product()  # warm-up: first-call allocation and kernel selection
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        product()
        best = min(best, time.perf_counter() - t)
    return round(2 * n**3 / best / 1e9, 1)


def int8_gops(rows: int = 64, d: int = 512, vocab: int = 8000, reps: int = 20) -> float:
    """mtpipe's int8 linear layer (``decode.precision=int8``: fbgemm's dynamic-quantised product) on ``rows x d``
    inputs and a ``vocab x d`` matrix, the best of ``reps``, in int8 GOP/s."""
    import warnings

    import torch

    from mtpipe.decode import _int8_linear

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        layer, x = _int8_linear(torch.randn(vocab, d), None), torch.randn(rows, d)
        layer(x)  # warm-up
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            layer(x)
            best = min(best, time.perf_counter() - t)
    return round(2 * rows * d * vocab / best / 1e9, 1)


def cpu_flags() -> list[str]:
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("flags"):
            return sorted({f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma"))})
    return []


def probe(n: int = 1024) -> dict:
    import torch

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from mtpipe.runtime import cpu_supports_bf16

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    return {"cpu_flags": cpu_flags(), "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "native_bf16": cpu_supports_bf16(), "fp32_gflops": matmul_gflops(torch.float32, n),
            "fp32_mtpipe_gflops": matmul_gflops(torch.float32, n, route="mtpipe"),
            "bf16_gflops": matmul_gflops(torch.bfloat16, n), "int8_gops": int8_gops()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=1024, help="matmul size n")
    print(json.dumps(probe(ap.parse_args().size)))
