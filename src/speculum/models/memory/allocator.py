"""Keep freed memory in the process for reuse: glibc malloc settings for large, short-lived tensors.

A batched forward over a large vocabulary allocates logits of ~100 MB per call (512 rows x 49,152 tokens x
float32), and its soft-max temporaries as many again. glibc serves every allocation above its mmap threshold
(at most 32 MB) with a fresh ``mmap`` and returns it with ``munmap`` when freed, so every call faults in
every page of those buffers again: on CPU enumeration that is a third of the wall time in the kernel, more in
a process with many threads (a Ray worker: each ``munmap`` interrupts the other cores to flush their TLBs).
:func:`keep_freed_memory` turns that off for the process: large blocks come from the heap and stay there
for the next call. The values computed are unchanged; the resident memory stays at its peak instead of
shrinking after each call, until :func:`trim_heap` gives the free part back at a quiet moment (after a
model's load-time probes, when a KV store regrows, when a server has been idle for a second).

Example:
    >>> keep_freed_memory() in (True, False)
    True
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["keep_freed_memory", "trim_heap"]

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 2**31 - 1    # give the top of the heap back only past 2 GB free (mallopt takes an int)
_TOP_PAD = 64 << 20            # grow the heap 64 MB at a time

_applied = False


def keep_freed_memory() -> bool:
    """Serve large allocations from the heap and keep freed memory for reuse (glibc only; idempotent).

    Returns whether the settings are in effect: False where the C library is not glibc (nothing is changed).
    Called by the ``speculum`` command and in every Ray worker of a :class:`~speculum.distributed.ray_pool.RayPool`;
    a program using the library calls it once itself if it wants the same.
    """
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version          # glibc's own symbol: mallopt's parameters are glibc's
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
                    and mallopt(_M_TOP_PAD, _TOP_PAD))
    return _applied


def trim_heap() -> bool:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``); True when some was.
    glibc keeps freed blocks below its mmap threshold resident (every block, after
    :func:`keep_freed_memory`), and a model's load-time probes (products of hundreds of rows through the
    vocabulary head) free a hundred megabytes of them. Elsewhere (another C library or OS) nothing is
    done. It costs a walk over the heap's free blocks (milliseconds), and the next allocations fault their
    pages in again: call it where the process turns quiet, not per forward.

    Example:
        >>> trim_heap() in (True, False)
        True
    """
    if not sys.platform.startswith("linux"):
        return False
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False
