"""Keeping the orchestrator's heap from holding on to memory it freed.

The orchestrator allocates and frees large numpy arrays all run long: per-turn token and route arrays,
growing rollout buffers, each batch's shard being built. glibc's malloc serves an allocation above its mmap
threshold with its own mapping, returned to the kernel on free; but the threshold is dynamic, rising to the
size of the largest block freed (up to 32 MiB), after which such arrays come from the heap and their pages
stay with the process when freed (fragmentation). Measured with benchmarks/seed_rehearsal.py, the
orchestrator's anonymous memory between builds then grew with every batch built, and looked like a cost
per token in flight. So the role fixes the threshold at start (`bound`: arrays of 256 KiB and up are their
own mappings), caps malloc's arenas at two (environment calls run in worker threads, and each thread
would otherwise get an arena of its own that keeps what it freed), and hands the heap's free pages back
after each batch it publishes (`trim`).

glibc only (mallopt and malloc_trim through ctypes); elsewhere both do nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 256 << 10
ARENA_MAX = 2


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def bound() -> bool:
    """Fix malloc's mmap threshold (no dynamic raise) and trim threshold; True where it applied."""
    libc = _libc()
    if libc is None:
        return False
    return all(bool(libc.mallopt(k, v)) for k, v in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                                                     (M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD),
                                                     (M_ARENA_MAX, ARENA_MAX)))


def trim() -> None:
    """Return the heap's free pages to the kernel (after a batch is written)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
