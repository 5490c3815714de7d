"""The one formula of every log-prob the PyTorch backend returns: ``logits.double() - log_mass(logits)``.

Sessions, ``next_logprobs``, ``next_logprobs_above`` and ``score_sequences`` all apply it, so their values
agree bitwise on one batch of logits.

Example:
    >>> rows = logprob_rows(torch.tensor([[0.0, 0.0]]))
    >>> rows.dtype, rows.tolist() == [[-0.6931471805599453] * 2]
    (dtype('float64'), True)
"""
from __future__ import annotations

import numpy as np
import torch

from ...validation import InputError

__all__ = ["finite_counts", "log_mass", "logprob_rows"]

# Rows whose float64 soft-max temporaries exist at once: a verification or enumeration forward returns
# hundreds of 49,152-wide rows, and a float64 copy plus its exponentials for all of them at once is a
# peak of several hundred MB (kept by the allocator afterwards). Each row's value is the same either way.
_ROWS_AT_ONCE = 32


def log_mass(logits: torch.Tensor) -> torch.Tensor:
    """``(n,)`` float64 log-sum-exp of ``(n, vocab)`` logits; ``InputError`` for NaN / +inf, at the origin.

    float64 because float32 rows' mass drifts by ~1e-5, which downstream normalisation checks rightly
    reject."""
    parts = [torch.logsumexp(part.double(), dim=-1) for part in logits.split(_ROWS_AT_ONCE)]
    mass = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)   # (n,); NaN / inf propagate
    if not bool(torch.isfinite(mass).all()):
        raise InputError("the model produced NaN or infinite logits")
    return mass


def logprob_rows(logits: torch.Tensor) -> np.ndarray:
    """``(n, vocab)`` logits (any float dtype) -> ``(n, vocab)`` float64 NumPy log-probs, normalised."""
    rows = logits.to(torch.float64, copy=True)   # the one full-size float64 array, normalised in place
    rows -= log_mass(rows)[:, None]
    return rows.numpy()


def finite_counts(logits: torch.Tensor) -> torch.Tensor:
    """``(n,)`` int64: each row's number of finite logits, for logits that :func:`log_mass` accepted (so
    ``-inf`` is the only non-finite value). A row minimum is one fast pass; only rows holding a ``-inf``
    are counted entry by entry."""
    counts = torch.full((logits.shape[0],), logits.shape[-1], dtype=torch.int64)
    masked = torch.nonzero(logits.amin(dim=-1) == float("-inf"), as_tuple=True)[0]
    if len(masked):
        counts[masked] = torch.isfinite(logits[masked]).sum(dim=-1)
    return counts
