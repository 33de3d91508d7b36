"""The process's CPU and precision settings: the glibc allocator, the CPU's bf16 support, autocast.

Shared by training and decoding; nothing here knows about the model or the data.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from mtpipe import env, memory
from mtpipe.errors import MtpipeError
from mtpipe.model.ops import cpu_supports_bf16



# --------------------------------------------------------------------------------------------------------------------
# torch.compile's on-disk cache
# --------------------------------------------------------------------------------------------------------------------


def separate_compile_cache() -> str | None:
    """Before ``torch.compile``: when ``ATEN_CPU_CAPABILITY`` restricts torch's CPU code (e.g. ``avx2`` on an AVX-512
    CPU, as the benchmarks' ``--isa avx2`` runs) and ``TORCHINDUCTOR_CACHE_DIR`` is not set, point inductor's on-disk
    cache at a directory of that capability's own; returns the directory (None: nothing changed).

    Why: torch 2.13's inductor reused code that it had compiled and cached without the restriction in a process
    with it, and that code decoded garbage (seen on an AVX-512 CPU: ``decode.compile`` gave empty outputs for every
    sentence, with or without mtpipe's own kernels; with a separate cache, or restricted both times, the outputs
    equal eager decoding). A cache per capability keeps the two apart; an explicit cache directory is the
    user's choice and left alone."""
    capability = env.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if not capability or env.get("TORCHINDUCTOR_CACHE_DIR"):
        return None
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch's layout: leave its cache as it is
        return None
    path = os.path.join(default_cache_dir(), f"capability-{capability}")
    env.put("TORCHINDUCTOR_CACHE_DIR", path)
    return path


# --------------------------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------------------------


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters, <malloc.h>


@functools.cache
def tune_cpu_allocator() -> bool:
    """Keep freed memory in the process for reuse (glibc only; False elsewhere). Process-wide, called once.

    Why: glibc serves every allocation above its mmap threshold (at most 32 MB: logits, their gradients, large
    activations) with a fresh ``mmap`` and unmaps it on free, so a CPU training step page-faults its large tensors in
    again every time. With ``M_MMAP_MAX = 0`` and a huge ``M_TRIM_THRESHOLD`` freed blocks are reused instead, and
    CPU training runs markedly faster (measured with bench/train_throughput.py). GPU memory is not affected (CUDA has
    its own caching allocator).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def trim_cpu_memory() -> None:
    """Hand the free pages of the glibc heap back to the OS (``malloc_trim(0)``); a no-op unless
    ``tune_cpu_allocator()`` took effect.

    Why: with trimming off, blocks freed by one batch shape are reused only where the next shapes fit, and the heap's
    resident size creeps up over thousands of steps of varying batch shapes. Trimming every few hundred steps keeps
    the resident size near the live peak, while the per-step page faults stay gone.
    """
    if not tune_cpu_allocator.cache_info().currsize or not tune_cpu_allocator():
        return
    memory.release_free_heap()


# --------------------------------------------------------------------------------------------------------------------
# Precision
# --------------------------------------------------------------------------------------------------------------------


def resolve_precision(precision: str, device: torch.device) -> str:
    """``train.precision`` on ``device``: ``auto`` = bf16 where the hardware has it (else fp16 + grad scaler on
    older GPUs, fp32 on CPU); an explicit choice the device lacks is an error."""
    if device.type == "cuda":
        # Native bf16 only (Ampere and newer): torch's default also counts emulation, which would train a P100 or
        # V100 in a bf16 many times slower than its fp16.
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        if precision == "auto":
            return "bf16" if bf16 else "fp16"
        if precision == "bf16" and not bf16:
            raise MtpipeError(f"train.precision=bf16: {torch.cuda.get_device_name(device)} has no bf16; use fp16")
        return precision
    if precision == "fp16":
        raise MtpipeError("train.precision=fp16 needs a CUDA GPU (its grad scaler is GPU-only); on CPU use bf16 or "
                          "fp32")
    if precision == "auto":
        return "bf16" if cpu_supports_bf16() else "fp32"
    return precision


def autocast(device: torch.device, precision: str) -> Any:
    """The forward pass's autocast context for ``precision`` (disabled for fp32)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
