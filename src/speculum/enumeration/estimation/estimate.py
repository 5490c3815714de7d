"""The importance-sampled rank of an item within a format, with a 95% confidence interval.

The rank of ``c`` is the number of members before it: ``R(c) = sum_x 1[x before c]`` (``x`` before ``c``
when ``p(x) > p(c)``, or tied and smaller: token ids lexicographically, strings by their UTF-8 bytes).
With draws ``x_1 .. x_n`` of a :class:`~.sampling.FormatSample`, whose law ``q`` is
known exactly, ``R(c) = E_q[1[x before c] / q(x)]`` (Dell'Amico & Filippone, CCS 2015, "Monte Carlo
strength evaluation"; with a law restricted to the format divide by ``q``, never by ``p``), so

    rank_hat = (1 / n) * sum_i 1[x_i before c] / q(x_i)

is UNBIASED. In string mode ``x_i`` is a string, ``q`` its law summed over all tokenizations and ``p`` the
model's probability of it over all tokenizations: each string is counted once, whatever its spellings. A draw
of ``c`` itself is never before it: identity decides, not the log-probs, since ``c``'s (teacher forcing) and
its draws' (next-token rows) differ by float rounding (2e-5 nats on a float32 SmolLM2), and counting ``c``
above itself would add about one to the rank and to the sure lower bound below.

**Interval (ESTIMATED, 95%).** The draws are independent within each stratum of the set (each tilt of the
model), so ``Var(rank_hat) = sum_k n_k Var_k(term) / n^2``, estimated with each stratum's sample variance. The
interval is normal on ``log rank_hat`` (the delta method: ``rank_hat * exp(+-1.96 se / rank_hat)``), which
follows the estimate's right skew (a miss of a rare heavy term pulls it low) better than a symmetric one.
When no draw falls before ``c`` the upper end is the rule of three on the model stratum (tilt 1;
infinite without one): ``q_model(x) >= p(x) > p(c)`` for every ``x`` before ``c``, so ``R(c) <
q_model(before c) / p(c) < 3 / (n_model p(c))`` at 95%. The lower end never goes below the distinct members
seen before ``c`` (a sure bound).

**The last step conditioned.** A draw whose set kept its siblings (:mod:`.siblings`:
token mode, a final last step) contributes its term averaged over its own stratum's last-step law,
``sum_t q_k(t | y) 1[y t before c] / q(y t)``: unbiased, never noisier, and still independent across the
draws of a stratum, so the variance formula above holds for these terms. Measured
coverage: tests/enumeration/test_exposure_estimate.py (200 canaries, each with its own draws, on a reference chain) and
benchmarks/exposure.py (SmolLM2, over several sets of draws: the canaries of one set share its draws, so one
set's coverage is nearly all or nothing and is no measure of the interval).

Example:
    >>> from speculum.models import MarkovModel
    >>> from speculum.enumeration import Regex
    >>> from speculum.enumeration.estimation.sampling import sample_format
    >>> model = MarkovModel.random(3, seed=0)
    >>> sample = sample_format(model, Regex("[ab]{6}", vocabulary=["a", "b", "c"]), prompt=[2], seed=0)
    >>> item = (0, 1, 0, 1, 0, 1)
    >>> guess = rank_from_sample(sample, item, float(model.score_sequences([item], prompt=[2])[0]))
    >>> guess.seen_before <= guess.ci_lo <= guess.ci_hi and 0 <= guess.rank < 64
    True
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...validation import InputError, check_number
from .format_walk import mixture_logprob

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
    of ``sample`` (a :class:`~.sampling.FormatSample`), with a ``z``-sided normal interval
    on its log (``Z_95``: 95%). ESTIMATED: unbiased, interval approximate (see the module doc)."""
    log_prob = check_number(log_prob, "log_prob", finite=False)
    z = check_number(z, "z", above=0.0)
    if log_prob == -math.inf:
        raise InputError("the item has zero probability under the model")
    n = len(sample)
    before = _before(sample, item, log_prob)
    kept = sample.siblings is not None and sample.siblings.token.shape[1] > 0
    ahead = _siblings_before(sample, item, log_prob) if kept else None
    log_terms = _log_terms(sample, before, ahead)          # log of each draw's term (-inf: none)
    hit = np.isfinite(log_terms)
    hits = int(np.count_nonzero(hit))
    seen = _seen_before(sample, before, ahead)
    n_model = sample.stratum_sizes[sample.tilts.index(1.0)] if 1.0 in sample.tilts else 0
    if not hits:
        upper = math.inf if not n_model else math.exp(math.log(_RULE_OF_THREE / n_model) - log_prob)
        return RankEstimate(0.0, 0.0, 0.0, upper, n, 0, 0)
    # Terms scaled by the largest, so that a space of 10^300 members stays in range.
    shift = float(log_terms[hit].max())
    terms = np.where(hit, np.exp(np.where(hit, log_terms - shift, 0.0)), 0.0)
    mean = terms.sum() / n
    variance = 0.0
    for stratum in range(len(sample.tilts)):
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


def _log_terms(sample: Any, before: np.ndarray, ahead: np.ndarray | None) -> np.ndarray:
    """``(n,)``: the log of each draw's term, ``-log q(x)`` where ``x`` comes before the item (``before``),
    or, for a draw with siblings, the log of its conditional term ``sum_t q_k(t | y) 1[y t before c] / q(y
    t)`` (``ahead``: :func:`_siblings_before`, None for a set without siblings)."""
    log_terms = np.where(before, -sample.proposal_logprob, -np.inf)
    if ahead is None:
        return log_terms
    siblings = sample.siblings
    mixture = mixture_logprob(siblings.laws, sample.stratum_sizes)                   # (n, width)
    with np.errstate(invalid="ignore"):
        conditional = np.logaddexp.reduce(np.where(ahead, siblings.own - mixture, -np.inf), axis=1)
    return np.where(siblings.present, conditional, log_terms)


def _siblings_before(sample: Any, item: Any, log_prob: float) -> np.ndarray:
    """``(n, width)`` bool: the sibling members ``y t`` that come before ``item`` (token mode), the item
    itself never (identity decides, as for the draws)."""
    key = tuple(int(t) for t in item)
    siblings = sample.siblings
    valid = siblings.token >= 0
    ahead = valid & (siblings.target > log_prob)
    same_prefix = np.fromiter((x[:-1] == key[:-1] for x in sample.items), dtype=bool, count=len(sample))
    itself = same_prefix[:, None] & (siblings.token == (key[-1] if key else -2))
    ahead &= ~itself
    for i, j in zip(*np.nonzero(valid & ~itself & (siblings.target == log_prob))):
        ahead[i, j] = sample.items[i][:-1] + (int(siblings.token[i, j]),) < key
    return ahead


def _seen_before(sample: Any, before: np.ndarray, ahead: np.ndarray | None) -> int:
    """Distinct members drawn (or one last token from a draw) that surely come before the item."""
    present = np.zeros(len(sample), bool) if ahead is None else sample.siblings.present
    seen = len({sample.items[i] for i in np.flatnonzero(before & ~present).tolist()})
    if ahead is None:
        return seen
    rows, cols = np.nonzero(ahead)
    prefixes: dict = {}
    ids = np.fromiter((prefixes.setdefault(sample.items[i][:-1], len(prefixes)) for i in rows.tolist()),
                      dtype=np.int64, count=len(rows))
    width = int(sample.siblings.token.max()) + 1
    return seen + len(np.unique(ids * width + sample.siblings.token[rows, cols]))


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
