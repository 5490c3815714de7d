"""Giving back the memory of weights that nothing reads any more, where they live in a mapped checkpoint.

Why: transformers loads a safetensors checkpoint by mapping the file privately into memory; every weight is
a view into that mapping, so dropping a weight tensor frees nothing while other views (the embedding,
the norms) keep the mapping alive. Once the fused forward holds a packed copy of the block projections,
their pages in the mapping are dead: :func:`drop_mapped_pages` asks the kernel to drop the pages that lie
wholly inside such ranges (``madvise(MADV_DONTNEED)``).

Safety: only pages of a private file mapping are dropped, and only pages that lie wholly inside a released
range (a page shared with a live tensor stays). Were a dropped page read again, the kernel would read it
back from the file: the checkpoint's own values, the ones loaded. Anywhere else (another OS, anonymous
memory) nothing is done and the allocator keeps what it frees
(:func:`~speculum.models.memory.allocator.trim_heap` gives back what the C heap holds free).

Example:
    >>> drop_mapped_pages([])
    0
"""
from __future__ import annotations

import ctypes
import mmap
import sys

__all__ = ["drop_mapped_pages"]

_MADV_DONTNEED = 4           # <sys/mman.h> on Linux


def _private_file_mappings() -> list[tuple[int, int]]:
    """``(start, end)`` of this process's private mappings of regular files (Linux ``/proc/self/maps``)."""
    spans = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[1].endswith("p") and fields[5].strip().startswith("/"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                spans.append((start, end))
    return spans


def drop_mapped_pages(ranges: list[tuple[int, int]]) -> int:
    """Drop the pages lying wholly inside the ``(address, bytes)`` ``ranges`` that belong to a private file
    mapping; returns the bytes dropped (0 off Linux). The caller guarantees nothing reads those ranges."""
    if not ranges or not sys.platform.startswith("linux"):
        return 0
    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mappings = _private_file_mappings()
    dropped = 0
    for address, size in ranges:
        first = -(-address // page) * page                  # the first page boundary inside the range
        last = (address + size) // page * page              # the last one
        if last <= first or not any(start <= first and last <= end for start, end in mappings):
            continue
        if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) == 0:
            dropped += last - first
    return dropped
