"""Freed heap memory handed back to the operating system (glibc's ``malloc_trim``).

Why: glibc keeps the pages of freed small allocations in its heap for reuse, so a process that once needed gigabytes
(SentencePiece's trainer, thousands of training steps of varying batch shapes) keeps them resident long after. The
stages and the engine trim at the points where they know a big working set has just been let go.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None  # glibc only (not musl, not macOS)
    except OSError:
        return None


def release_free_heap() -> bool:
    """``malloc_trim(0)``: the free pages of every glibc arena back to the OS; False where the C library has none."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
