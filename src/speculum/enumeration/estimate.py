"""The importance-sampled rank of an item within a format, with a 95% confidence interval.

The rank of ``c`` is the number of members before it: ``R(c) = sum_x 1[x before c]`` (``x`` before ``c``
when ``p(x) > p(c)``, or tied and smaller: token ids lexicographically, strings by their UTF-8 bytes).
With draws ``x_1 .. x_n`` of a :class:`~speculum.enumeration.sampling.FormatSample`, whose law ``q`` is
known exactly, ``R(c) = E_q[1[x before c] / q(x)]`` (Dell'Amico & Filippone, CCS 2015, "Monte Carlo
strength evaluation"; with a law restricted to the format divide by ``q``, never by ``p``), so

    rank_hat = (1 / n) * sum_i 1[x_i before c] / q(x_i)

is UNBIASED. In string mode ``x_i`` is a string, ``q`` its law summed over all tokenizations and ``p`` the
model's probability of it over all tokenizations: each string is counted once, whatever its spellings. A draw
of ``c`` itself is never before it: identity decides, not the log-probs, since ``c``'s (teacher forcing) and
its draws' (next-token rows) differ by float rounding (2e-5 nats on a float32 SmolLM2), and counting ``c``
above itself would add about one to the rank and to the sure lower bound below.

**Interval (ESTIMATED, 95%).** The draws are independent within each stratum of the set (model, uniform),
so ``Var(rank_hat) = sum_k n_k Var_k(term) / n^2``, estimated with each stratum's sample variance. The
interval is normal on ``log rank_hat`` (the delta method: ``rank_hat * exp(+-1.96 se / rank_hat)``), which
follows the estimate's right skew (a miss of a rare heavy term pulls it low) better than a symmetric one.
When no draw falls before ``c`` the upper end is the rule of three on the model stratum: ``q_model(x) >=
p(x) > p(c)`` for every ``x`` before ``c``, so ``R(c) < q_model(before c) / p(c) < 3 / (n_model p(c))``
at 95%. The lower end never goes below the distinct members seen before ``c`` (a sure bound). Measured
coverage: tests/test_exposure_estimate.py (200 canaries, each with its own draws, on a reference chain) and
benchmarks/exposure.py (SmolLM2, over several sets of draws: the canaries of one set share its draws, so one
set's coverage is nearly all or nothing and is no measure of the interval).

Example:
    >>> from speculum.models import MarkovModel
    >>> from speculum.enumeration import Regex
    >>> from speculum.enumeration.sampling import sample_format
    >>> model = MarkovModel.random(3, seed=0)
    >>> sample = sample_format(model, Regex("[ab]{6}", vocabulary=["a", "b", "c"]), prompt=[2], seed=0)
    >>> item = (0, 1, 0, 1, 0, 1)
    >>> guess = rank_from_sample(sample, item, float(model.score_sequences([item], prompt=[2])[0]))
    >>> guess.ci_lo <= guess.rank <= guess.ci_hi and 0 <= guess.rank < 64
    True
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..validation import InputError, check_number

__all__ = ["RankEstimate", "rank_from_sample", "Z_95"]

Z_95 = 1.959963984540054        # the standard normal's 97.5% quantile
_RULE_OF_THREE = -math.log(0.05)  # no hit in n draws: the hit probability is below 3 / n at 95%


@dataclass(frozen=True)
class RankEstimate:
    """An importance-sampled rank (ESTIMATED): the unbiased ``rank``, its ``standard_error``, a 95%
    interval ``[ci_lo, ci_hi]``, the draws used (``samples``), how many fell before the item (``hits``) and
    how many distinct members among them (``seen_before``, a sure lower bound on the rank)."""

    rank: float
    standard_error: float
    ci_lo: float
    ci_hi: float
    samples: int
    hits: int
    seen_before: int


def rank_from_sample(sample: Any, item: Any, log_prob: float, *, z: float = Z_95) -> RankEstimate:
    """The rank of ``item`` (a member of the sample's format, of exact ``log_prob``) estimated from the draws
    of ``sample`` (a :class:`~speculum.enumeration.sampling.FormatSample`), with a ``z``-sided normal interval
    on its log (``Z_95``: 95%). ESTIMATED: unbiased, interval approximate (see the module doc)."""
    log_prob = check_number(log_prob, "log_prob", finite=False)
    z = check_number(z, "z", above=0.0)
    if log_prob == -math.inf:
        raise InputError("the item has zero probability under the model")
    before = _before(sample, item, log_prob)
    n = len(sample)
    weights = -sample.proposal_logprob                    # log of 1 / q(x_i)
    hits = int(np.count_nonzero(before))
    seen = len({sample.items[i] for i in np.flatnonzero(before).tolist()})
    n_model = sample.stratum_sizes[0]
    if not hits:
        upper = math.inf if not n_model else math.exp(math.log(_RULE_OF_THREE / n_model) - log_prob)
        return RankEstimate(0.0, 0.0, 0.0, upper, n, 0, 0)
    # Terms 1[before] / q scaled by the largest, so that a space of 10^300 members stays in range.
    shift = float(weights[before].max())
    terms = np.where(before, np.exp(np.where(before, weights - shift, 0.0)), 0.0)
    mean = terms.sum() / n
    variance = 0.0
    for stratum in (0, 1):
        part = terms[sample.stratum == stratum]
        if len(part) > 1:
            variance += len(part) * float(part.var(ddof=1))
    se = math.sqrt(variance) / n
    scale = math.exp(shift) if shift < 709.0 else math.inf
    rank, standard_error = float(mean * scale), float(se * scale)
    half = float(z * se / mean)
    lo = max(float(seen), rank * math.exp(-half))
    hi = rank * math.exp(half) if half < 709.0 else math.inf
    return RankEstimate(rank, standard_error, lo, max(hi, lo), n, hits, seen)


def _before(sample: Any, item: Any, log_prob: float) -> np.ndarray:
    """(n,) bool: draws that come before ``item`` in the exact order (more probable, or tied and smaller),
    the item itself never."""
    if sample.strings:
        if not isinstance(item, str):
            raise InputError(f"in string mode an item is text, got {type(item).__name__}")
        key: Any = item.encode("utf-8")

        def order(x: Any) -> Any:
            return x.encode("utf-8")
    else:
        if isinstance(item, str):
            raise InputError("in token mode an item is a sequence of token ids")
        key = tuple(int(t) for t in item)

        def order(x: Any) -> Any:
            return x
    lps = sample.target_logprob
    before = lps > log_prob
    # A draw of the item itself is never before it, whatever its recorded log-prob: the item's comes from
    # teacher forcing and the draw's from next-token rows of other batches, which differ by float rounding
    # (2e-5 nats seen on a float32 SmolLM2, past any fixed tolerance). Identity is decided on the item.
    itself = item if sample.strings else key
    same = np.fromiter((x == itself for x in sample.items), dtype=bool, count=len(lps))
    before[same] = False
    # Other members tied with it in exact arithmetic: the smaller first.
    for i in np.flatnonzero(~same & (lps == log_prob)).tolist():
        before[i] = order(sample.items[i]) < key
    return before
