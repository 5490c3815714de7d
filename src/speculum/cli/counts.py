"""How the command line writes a count that may be astronomically large or infinite.

A format's size (``.{0,1000}`` holds about 2^20,000 strings) is an exact Python int of any size, or
``float("inf")``. Python refuses to turn an int of more than 4,300 digits into text, and a float cannot
hold one past 2^1024, so every size the CLI prints or puts in JSON goes through here: the exact integer
while it has at most :data:`PRINTABLE_BITS` binary digits, else ``2^bits`` (JSON: ``null`` beside its
log2 in bits).
"""
from __future__ import annotations

import math

__all__ = ["PRINTABLE_BITS", "count_text", "count_json", "count_bits"]

# Counts with more binary digits than this are shown as 2^bits (about 3,000 decimal digits, under Python's
# 4,300-digit limit on printing an int).
PRINTABLE_BITS = 10_000


def _infinite(value: float) -> bool:
    # A count is an int (any size: no float conversion, which overflows past 2^1024) or float("inf").
    return isinstance(value, float) and value == math.inf


def _printable(value: float) -> bool:
    return not _infinite(value) and int(value).bit_length() <= PRINTABLE_BITS


def count_bits(value: float) -> float | None:
    """log2 of a count, exact to float precision at any size (None: infinite, or 0)."""
    if _infinite(value) or value <= 0:
        return None
    value = int(value)
    shift = max(value.bit_length() - 64, 0)
    return math.log2(value >> shift) + shift


def count_json(value: float) -> int | None:
    """A count for JSON: the int, or None for an infinite one or one too large to print (its log2 goes
    beside it, from :func:`count_bits`)."""
    return int(value) if _printable(value) else None


def count_text(value: float) -> str:
    """A count for a table: ``1,000,000``, ``2^20,000.5`` past :data:`PRINTABLE_BITS` bits, or ``infinite``."""
    if _infinite(value):
        return "infinite"
    if not _printable(value):
        return f"2^{count_bits(value):,.1f}"
    return f"{int(value):,}"
