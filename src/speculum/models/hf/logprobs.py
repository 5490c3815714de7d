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

__all__ = ["log_mass", "logprob_rows"]


def log_mass(logits: torch.Tensor) -> torch.Tensor:
    """``(n,)`` float64 log-sum-exp of ``(n, vocab)`` logits; ``InputError`` for NaN / +inf, at the origin.

    float64 because float32 rows' mass drifts by ~1e-5, which downstream normalisation checks rightly
    reject."""
    mass = torch.logsumexp(logits.double(), dim=-1)                          # (n,); NaN / inf propagate
    if not bool(torch.isfinite(mass).all()):
        raise InputError("the model produced NaN or infinite logits")
    return mass


def logprob_rows(logits: torch.Tensor) -> np.ndarray:
    """``(n, vocab)`` logits (any float dtype) -> ``(n, vocab)`` float64 NumPy log-probs, normalised."""
    return (logits.double() - log_mass(logits)[:, None]).numpy()
