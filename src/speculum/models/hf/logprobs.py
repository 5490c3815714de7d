"""The one formula of every log-prob the PyTorch backend returns: ``logits.double() - log_mass(logits)``.

Sessions, ``next_logprobs``, ``next_logprobs_above`` and ``score_sequences`` all apply it, so their values
agree bitwise on one batch of logits.

Example:
    >>> rows = logprob_rows(torch.tensor([[0.0, 0.0]]))
    >>> rows.dtype, rows.tolist() == [[-0.6931471805599453] * 2]
    (dtype('float64'), True)
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ...validation import InputError
from .kernels.row_ops import RowOps, row_ops_unavailable

__all__ = ["entries_at_least", "finite_counts", "greedy_tokens", "log_mass", "logprob_rows"]

_BLOCK = 64         # entries_at_least: columns per block maximum
# greedy_tokens: a row's log-prob is its logit minus the row's mass, rounded once to float64, at a magnitude
# below ln(vocab) + 1 < 2^8 near the row's top, so to within 2^-45. Two logits closer than this margin may
# round to one log-prob; farther apart, never.
_TIE_MARGIN = 2.0 ** -40
_ROW_KERNEL: list[RowOps | None] = []     # the row kernel or None, decided at first use for the process's life


def log_mass(logits: torch.Tensor) -> torch.Tensor:
    """``(n,)`` float64 log-sum-exp of ``(n, vocab)`` logits; ``InputError`` for NaN / +inf, at the origin.

    float64 because float32 rows' mass drifts by ~1e-5, which downstream normalisation checks rightly
    reject. ROW-CANONICAL: each row's sum is computed alone, by one thread, in one fixed order (the row
    kernel's, else NumPy's pairwise order), so a row's value is bitwise the same in any batch and at any
    thread count (PyTorch splits a lone row's reduction across its threads, and so rounds it otherwise than
    the same row among others). Logits of float32 values take the row kernel where it runs (rows are shared
    among threads, each row by one); float64 logits that float32 cannot hold take NumPy's path."""
    source = _widened(logits)
    narrow = _float32_rows(source)
    if narrow is not None:
        return _checked(_row_kernel().log_mass(narrow, torch.empty(narrow.shape[0], dtype=torch.float64)))
    rows = source.numpy()
    mass = np.empty(rows.shape[0], dtype=np.float64)                              # (n,); NaN / inf propagate
    shifted = np.empty(rows.shape[-1], dtype=np.float64)                          # one row's, reused
    tops = rows.max(axis=-1).astype(np.float64) if rows.shape[0] else mass        # exact in any order
    with np.errstate(divide="ignore", invalid="ignore"):
        for i, top in enumerate(tops.tolist()):
            top = 0.0 if top in (math.inf, -math.inf) else top
            np.subtract(rows[i], top, out=shifted, dtype=np.float64)              # the row widened exactly
            mass[i] = np.log(np.exp(shifted, out=shifted).sum()) + top
    return _checked(torch.from_numpy(mass))


def logprob_rows(logits: torch.Tensor) -> np.ndarray:
    """``(n, vocab)`` logits (any float dtype) -> ``(n, vocab)`` float64 NumPy log-probs, normalised."""
    narrow = _float32_rows(_widened(logits))
    if narrow is not None:      # the mass and the rows in one pass of the row kernel
        rows = torch.empty(narrow.shape, dtype=torch.float64)
        _checked(_row_kernel().log_mass(narrow, torch.empty(narrow.shape[0], dtype=torch.float64), rows))
        return rows.numpy()
    rows = logits.to(torch.float64, copy=True)   # the one full-size float64 array, normalised in place
    rows -= log_mass(rows)[:, None]
    return rows.numpy()


def greedy_tokens(logits: torch.Tensor) -> np.ndarray:
    """``(n, vocab)`` logits -> ``(n,)`` int64: each row's greedy token, bitwise the argmax (lowest id on
    ties) of :func:`logprob_rows`' row, without computing the rows (no pass of ``exp``, no float64 row
    written). ``InputError`` for the rows :func:`log_mass` refuses (NaN, +inf, every logit ``-inf``).

    Exact, not approximate: a log-prob is its logit minus the row's mass, rounded once, and rounding is
    monotone, so the log-probs' argmax is the logits' argmax, unless a lower id's logit lies so close to the
    largest that both round to one log-prob. Such a row (logits within 2^-40, which float32 allows only
    for values below about 1e-5) is decided on its float64 row.

    Example:
        >>> greedy_tokens(torch.tensor([[0.0, 2.0, 2.0], [3.0, 1.0, 0.0]])).tolist()
        [1, 0]
    """
    narrow = _float32_rows(_widened(logits))
    if narrow is None:
        return logprob_rows(logits).argmax(axis=-1)
    values = narrow.numpy()
    tokens = values.argmax(axis=-1)                                     # the first NaN where there is one
    tops = values[np.arange(len(values)), tokens]
    if not np.isfinite(tops).all():
        raise InputError("the model produced NaN or infinite logits")
    for i, (token, top) in enumerate(zip(tokens.tolist(), tops.tolist())):
        if token and values[i, :token].max() >= top - _TIE_MARGIN:
            tokens[i] = logprob_rows(narrow[i: i + 1])[0].argmax()     # row-canonical: its row in any batch
    return tokens


def _widened(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` detached, as float32 or float64 (other float dtypes widened to float32, exactly)."""
    source = logits.detach()
    return source if source.dtype in (torch.float32, torch.float64) else source.float()


def _checked(mass: torch.Tensor) -> torch.Tensor:
    if not bool(torch.isfinite(mass).all()):
        raise InputError("the model produced NaN or infinite logits")
    return mass


def _row_kernel() -> RowOps | None:
    """The row kernel where it runs, decided once a process, so that every log-prob it returns follows one
    formula."""
    if not _ROW_KERNEL:
        _ROW_KERNEL.append(RowOps() if row_ops_unavailable() is None else None)
    return _ROW_KERNEL[0]


def _float32_rows(source: torch.Tensor) -> torch.Tensor | None:
    """``source (n, vocab)`` float32 or float64 as contiguous float32 rows for the row kernel, where it runs
    and float32 holds every value exactly (so both dtypes of one row get the same mass); else None."""
    if _row_kernel() is None or source.dim() != 2:
        return None
    if source.dtype == torch.float32:
        return source.contiguous()
    narrow = source.float()
    return narrow if torch.equal(narrow.double(), source) else None


def finite_counts(logits: torch.Tensor) -> torch.Tensor:
    """``(n,)`` int64: each row's number of finite logits, for logits that :func:`log_mass` accepted (so
    ``-inf`` is the only non-finite value). A row minimum is one fast pass; only rows holding a ``-inf``
    are counted entry by entry."""
    counts = torch.full((logits.shape[0],), logits.shape[-1], dtype=torch.int64)
    masked = torch.nonzero(logits.amin(dim=-1) == float("-inf"), as_tuple=True)[0]
    if len(masked):
        counts[masked] = torch.isfinite(logits[masked]).sum(dim=-1)
    return counts


def entries_at_least(logits: torch.Tensor, floors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, columns)``: the entries of ``(n, vocab)`` ``logits`` with ``logits[i, j] >= floors[i]``
    (``floors (n,)`` of the logits' dtype), in row-major order: what ``torch.nonzero(logits >= floors[:, None],
    as_tuple=True)`` returns.

    Why: a comparison writing a boolean per entry runs at a fraction of a reduction's speed, and the wanted
    entries are few. Each row's maximum over blocks of :data:`_BLOCK` columns is one fast reduction; only the
    blocks whose maximum reaches the floor are compared entry by entry.

    Example:
        >>> rows, columns = entries_at_least(torch.tensor([[0.0, 2.0], [3.0, 1.0]]), torch.tensor([1.0, 0.5]))
        >>> rows.tolist(), columns.tolist()
        ([0, 1, 1], [1, 0, 1])
    """
    n, width = logits.shape
    body = width - width % _BLOCK
    blocks = logits[:, :body].reshape(n, -1, _BLOCK)                        # (n, body / _BLOCK, _BLOCK)
    row, block = torch.nonzero(blocks.amax(dim=-1) >= floors[:, None], as_tuple=True)
    hit, column = torch.nonzero(blocks[row, block] >= floors[row, None], as_tuple=True)
    rows, columns = row[hit], block[hit] * _BLOCK + column
    if body < width:                  # the last columns, fewer than a block: compared entry by entry
        tail_rows, tail_columns = torch.nonzero(logits[:, body:] >= floors[:, None], as_tuple=True)
        rows, columns = torch.cat([rows, tail_rows]), torch.cat([columns, tail_columns + body])
        order = torch.argsort(rows * width + columns)
        rows, columns = rows[order], columns[order]
    return rows, columns
