"""The probe that a product's rows do not depend on each other: a row multiplied alone, among a few or
among hundreds comes out bitwise the same, on this machine's kernels.

Why: a matrix kernel may pick another algorithm, blocking or summation order for another number of rows
(a matrix-vector path for one row, another blocking for many). The fused forward's guarantees (greedy
speculative output equal to plain greedy output, packed sequences equal to each alone) need every product
to keep its rows apart, so each product is probed once per kind and weight shape before it is trusted
(:mod:`~speculum.models.hf.kernels.products`); :data:`PROBE_ROWS` bounds the rows a product call takes,
the row counts the probe covers.

Example:
    >>> gives_rows_alone(lambda rows: 2 * rows, 8)            # element-wise: no row sees another
    True
    >>> gives_rows_alone(lambda rows: rows - rows.mean(0), 8)  # each row shifted by the batch's mean
    False
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["PROBE_ROWS", "gives_rows_alone", "probed_once"]

_ROWS_ALONE: dict[tuple[str, tuple[int, int]], bool] = {}   # (kind, weight shape) -> passed the probe

PROBE_ROWS = 512                    # rows of the row-independence probe (and the most a product call takes)
_PROBE_SPANS = ((7, 1), (0, 2), (5, 3), (40, 17), (64, 32), (100, 100), (1, 255), (200, 300),
                (0, PROBE_ROWS))  # (offset, rows)


def gives_rows_alone(product: Callable[[torch.Tensor], torch.Tensor], width: int,
                     generator: torch.Generator | None = None) -> bool:
    """True when ``product`` (rows ``(m, width)`` -> ``(m, out)``) gives each row bitwise the same whatever
    rows surround it, on this machine's kernels: spans of 1 to :data:`PROBE_ROWS` random rows at several
    offsets equal those rows of the whole. A kernel may pick another algorithm or blocking for another
    number of rows; this is the check that it does not, for the shapes probed."""
    rows = torch.randn(PROBE_ROWS, width, generator=generator)
    with torch.inference_mode():
        whole = product(rows)
        return all(torch.equal(product(rows[offset:offset + count]), whole[offset:offset + count])
                   for offset, count in _PROBE_SPANS)


def probed_once(kind: str, shape: tuple[int, int], run: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether ``run`` (weights of ``shape`` ``(out, in)``) gives rows alone, probed once per kind and shape:
    the kernel's path depends on the shapes, not on the weights' values."""
    if (kind, shape) not in _ROWS_ALONE:
        _ROWS_ALONE[kind, shape] = gives_rows_alone(run, shape[1], torch.Generator().manual_seed(0))
    return _ROWS_ALONE[kind, shape]
