"""Giving memory back to the system and keeping it for reuse: the C allocator's settings and the pages of
mapped checkpoints. Neither needs torch, so every backend, the command line and the Ray workers use them.

Why a package: each backend frees large buffers (logits, KV stores, weights held twice) and must decide
what stays resident; these are the two places where the process talks to the OS about it.

* ``allocator.py`` - :func:`keep_freed_memory` (glibc keeps large freed blocks for the next call) and
  :func:`trim_heap` (gives the free part back at a quiet moment);
* ``pages.py`` - :func:`drop_mapped_pages`: the pages of a mapped checkpoint that nothing reads any more.

Example:
    >>> from speculum.models.memory import drop_mapped_pages
    >>> drop_mapped_pages([])
    0
"""
from __future__ import annotations

from .allocator import keep_freed_memory, trim_heap
from .pages import drop_mapped_pages

__all__ = ["keep_freed_memory", "trim_heap", "drop_mapped_pages"]
