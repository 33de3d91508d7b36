"""The process's settings for running models: the glibc allocator, torch.compile's on-disk cache.

Shared by training and decoding; nothing here knows about the model or the data. What the machine is and what it
offers (bf16, threads, precision, autocast) is :mod:`mtpipe.platform`'s.
"""

from __future__ import annotations

import functools
import os

from mtpipe import env, memory, platform

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
    capability = platform.cpu().restriction
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
