"""How a model's log-prob row becomes the distribution a token is sampled from.

One pure function, :func:`warp_logprobs`, applies temperature, top-k and top-p. The decoding loop applies
it *identically* to target rows (for plain sampling and for verification) and to draft rows (the draft
samples from, and reports, exactly this warped distribution). Using one function for both is what keeps
speculative sampling's output law equal to plain sampling's: a draft that sampled from a differently
processed row than the one it reported breaks exactness (transformers #32867, #47932).

Temperature 0 means greedy and is handled by the caller (argmax, lowest index on ties); this module only
sees temperatures > 0, and every positive finite temperature is valid, subnormal ones included: the row
is shifted to a maximum of 0 *before* it is divided, so the division cannot overflow into ``inf - inf``.
A vanishing temperature therefore gives the exact limit law (uniform over the tied most probable tokens,
where greedy takes the lowest id), never NaN.
"""
from __future__ import annotations

import math

import numpy as np

from ..validation import InputError, check_number, check_optional_int

__all__ = ["check_sampling_args", "warp_logprobs", "sample_from_logprobs", "is_identity_warp"]


def check_sampling_args(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ``InputError`` (a ``ValueError``) naming the argument unless the sampling settings are valid.

    ``temperature`` must be finite and >= 0 (0 = greedy; every positive value, subnormal ones included,
    is a valid tempered law: see :func:`warp_logprobs`), ``top_k`` an integer >= 1 or None, ``top_p`` in
    (0, 1] or None.

    Example:
        >>> check_sampling_args(0.7, 5, 0.9)
        >>> check_sampling_args(-1.0, None, None)
        Traceback (most recent call last):
        ...
        speculum.validation.InputError: temperature (0 = greedy) must be >= 0, got -1.0
    """
    check_number(temperature, "temperature (0 = greedy)", minimum=0)
    check_optional_int(top_k, "top_k", minimum=1)
    if top_p is not None:
        check_number(top_p, "top_p", above=0.0, maximum=1.0)


def is_identity_warp(temperature: float, top_k: int | None, top_p: float | None, vocab_size: int) -> bool:
    """True when :func:`warp_logprobs` would return normalised rows unchanged (lets callers skip it)."""
    return temperature == 1.0 and (top_k is None or top_k >= vocab_size) and (top_p is None or top_p >= 1.0)


def warp_logprobs(logprobs: np.ndarray, *, temperature: float, top_k: int | None = None,
                  top_p: float | None = None) -> np.ndarray:
    """Exact warped log-probs: temperature, then top-k, then top-p; ``-inf`` outside the kept set.

    Args:
        logprobs: ``(..., V)`` natural-log probabilities (or logits: rows are renormalised).
        temperature: finite and > 0 (any such value, subnormal included); the row, shifted to a maximum
            of 0, is divided by it before renormalising.
        top_k: keep the ``top_k`` most probable tokens (ties broken towards the lower token id).
        top_p: keep the smallest most-probable set whose mass reaches ``top_p`` (nucleus sampling,
            Holtzman et al. 2020); the most probable token is always kept.

    Returns:
        ``(..., V)`` normalised log-probs. Guarantee: exact (deterministic, same result for the same row
        wherever it is applied — draft drafting, target verification, plain sampling), and finite at
        a most probable token of the tempered row for every valid argument. ``ValueError`` if a row has NaN, +inf or no
        finite entry.

    Example:
        >>> row = np.log(np.array([0.5, 0.3, 0.2]))
        >>> np.round(np.exp(warp_logprobs(row, temperature=1.0, top_k=2)), 3)
        array([0.625, 0.375, 0.   ])
    """
    if not (temperature > 0 and math.isfinite(temperature)):
        raise InputError(f"temperature must be finite and > 0 here (0 = greedy is handled by the caller), "
                         f"got {temperature}")
    rows = np.asarray(logprobs, dtype=np.float64)
    shape = rows.shape
    vocab = shape[-1]
    rows = rows.reshape(-1, vocab)                                                     # (R, V)
    top = rows.max(axis=-1, keepdims=True)                                             # (R, 1)
    if not np.isfinite(top).all():
        raise InputError("logprobs have a row with NaN, +inf or no finite entry")
    # Shift first: every entry is then <= 0 and the maximum exactly 0, so dividing by any temperature > 0
    # (1e-320 included) gives 0 at the maximum and at worst -inf elsewhere, never inf - inf.
    scaled = rows - top                                                                # (R, V) max 0 per row
    if temperature != 1.0:
        with np.errstate(over="ignore"):                                               # overflow: -inf, wanted
            scaled = scaled / temperature
    probs = np.exp(scaled)                                                             # (R, V) unnormalised
    need_k = top_k is not None and top_k < vocab
    need_p = top_p is not None and top_p < 1.0
    if need_k or need_p:
        # Stable sort of the negated row: descending probability, lower token id first among ties, so the
        # kept set is a deterministic function of the row.
        order = np.argsort(-scaled, axis=-1, kind="stable")                            # (R, V)
        row_index = np.arange(scaled.shape[0])[:, None]                                # (R, 1)
        keep_sorted = np.ones(order.shape, dtype=bool)                                 # (R, V)
        if need_k:
            keep_sorted[:, top_k:] = False
        if need_p:
            sorted_probs = probs[row_index, order]                                     # (R, V) descending
            cumulative = np.cumsum(sorted_probs, axis=-1)
            # A token is kept while the mass strictly before it is still below top_p of the total.
            keep_sorted &= (cumulative - sorted_probs) < top_p * cumulative[:, -1:]
        keep_sorted[:, 0] = True
        keep = np.empty_like(keep_sorted)
        keep[row_index, order] = keep_sorted
        scaled = np.where(keep, scaled, -np.inf)
        probs = np.where(keep, probs, 0.0)
    return (scaled - np.log(probs.sum(axis=-1, keepdims=True))).reshape(shape)


def sample_from_logprobs(logprobs: np.ndarray, uniform: float) -> int:
    """Inverse-CDF sample from one ``(V,)`` log-prob row with one uniform in [0, 1) (exact).

    One uniform per sample keeps random-number consumption fixed, so a seeded run draws the same numbers
    whatever the rows hold. Only tokens with positive probability can be returned; a row with NaN or no
    finite entry is a ``ValueError``.

    Example:
        >>> sample_from_logprobs(np.array([-np.inf, np.log(0.25), np.log(0.75)]), 0.1)
        1
    """
    probs = np.exp(logprobs - logprobs.max())                                # (V,) unnormalised
    cdf = np.cumsum(probs)                                                   # (V,)
    if not cdf[-1] > 0.0:                                                    # NaN or no mass: nothing to sample
        raise InputError("cannot sample from a log-prob row with NaN or no finite entry")
    index = int(np.searchsorted(cdf, uniform * cdf[-1], side="right"))
    if index >= len(cdf) or probs[index] <= 0.0:
        # Only reachable through rounding at the very top of the CDF: take the last possible token.
        index = int(np.flatnonzero(probs > 0.0)[-1])
    return index
