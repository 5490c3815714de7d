"""Speculative enumeration: a low-cost DRAFT pays for the index, the TARGET scores what a query returns.

Building an autoregressive index costs one forward per live prefix — prohibitive for a large target.
The *ordering* work tolerates approximation, the *scores* must be the target's. So a draft index (an
exact :class:`~speculum.enumeration.SeekIndex` over an n-gram or a quantised twin, an envelope, ...)
supplies candidates in draft order, and the target rescores only what a query pulls: one batched
teacher-forcing call per query (speculative decoding's economics applied to enumeration).

Guarantees of :class:`RescoredIndex`:

* every returned log-prob is the **target's exact** score;
* the order within the pulled window is the target's (ties broken lexicographically by token ids);
* ``certified is True`` only when the result is *provably* the target's true top-k / slice. The proof
  (see :func:`certify_slice`) needs three facts, and the certificate is ``None`` when one is missing:
  a global draft/target gap bound ``assumed_gap`` (``|target_lp - draft_lp| <= gap`` on every
  sequence), the draft index's own order error (``order_error``: a later item never out-scores an
  earlier one by more than it; 0 for the exact index), and a complete draft support (``complete``: no
  branch cap or truncation — items the draft never lists have unknown draft scores). Without the order
  error a draft whose order is only approximate would certify wrong answers, and an exhausted but capped
  draft says nothing about the sequences it cut.

``certify=True`` grows the window until the answer is certified (or ``max_window`` is reached).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from ..models.base import as_model
from ..validation import InputError, check_int, check_number
from .index.protocols import EnumerationIndex, ScoringIndex

__all__ = ["RescoredIndex", "certify_slice", "DEFAULT_MAX_WINDOW"]

DEFAULT_RERANK_WINDOW = 64
DEFAULT_MAX_WINDOW = 4096
# Certificate reasons (the "reason" key of every query result).
REASON_BOUND = "the window edge bound is cleared"
REASON_EXHAUSTED = "complete draft support exhausted"
REASON_ALL_SCORED = "every sequence of the space was scored"
REASON_NOT_CLEARED = "the last returned target score does not clear the window edge bound"
REASON_NO_GAP = "no assumed_gap: soundness cannot be shown (observed gap reported)"
REASON_NO_ORDER_ERROR = "the draft index reports no order_error bound"
REASON_INCOMPLETE = "the draft index is incomplete (branch cap or truncation)"
REASON_GAP_VIOLATED = "observed gap exceeds assumed_gap: the assumption is false"


def certify_slice(
    target_desc: np.ndarray,
    start: int,
    k: int,
    draft_lps: np.ndarray,
    *,
    exhausted: bool,
    complete: bool,
    order_error: float | None,
    assumed_gap: float | None,
    observed_gap: float,
    covers_space: bool = False,
) -> tuple[bool | None, str, float | None]:
    """Sound verdict on whether the target-sorted pulled set's ``[start, start + k)`` is the true slice.

    Args:
        target_desc: ``(m,)`` finite target log-probs of the pulled set, sorted descending.
        draft_lps: ``(n,)`` draft log-probs of every pulled draft item (``n >= m``).
        exhausted: the draft index raised ``IndexError`` before the window was full.
        complete: the draft index lists its whole support (no branch cap / truncation).
        order_error: the draft order's bound — for draft positions ``i < j``,
            ``draft_lp[j] <= draft_lp[i] + order_error`` — or ``None`` if unknown.
        assumed_gap: global bound on ``|target_lp - draft_lp|`` or ``None``.
        observed_gap: the largest ``target_lp - draft_lp`` seen so far (falsifies the assumption
            when above ``assumed_gap``).
        covers_space: the pulled set is every sequence of the space (nothing else exists).

    Returns ``(certified, reason, bound)``: ``bound`` is the proven upper limit on the target score of
    any unpulled sequence (``None`` when none could be proven).

    Derivation: every unpulled draft item comes after every pulled one, so its draft score is at most
    ``min(draft_lps) + order_error``, and its target score at most that ``+ assumed_gap`` =: bound.
    If the pulled set's ``(start + k)``-th best target score is *strictly* above the bound (strict, so a
    lexicographic tie with an unpulled sequence cannot reorder it), no unpulled sequence ranks before
    or inside the slice, so both slice boundaries — and every position in between — are the true ones.
    A slice the pulled set cannot fill is certified only when no unpulled sequence can have positive
    target probability (bound ``-inf``).
    """
    if exhausted and complete and covers_space:
        return True, REASON_ALL_SCORED, -math.inf
    if assumed_gap is None:
        return None, REASON_NO_GAP, None
    if observed_gap > assumed_gap:
        return None, REASON_GAP_VIOLATED, None
    if not complete:
        return None, REASON_INCOMPLETE, None
    if exhausted:
        # Unpulled = outside the draft's support: draft -inf, hence target -inf under the gap bound.
        return True, REASON_EXHAUSTED, -math.inf
    if order_error is None:
        return None, REASON_NO_ORDER_ERROR, None
    bound = float(np.min(draft_lps)) + order_error + assumed_gap if len(draft_lps) else math.inf
    last = start + k - 1
    if last < len(target_desc):
        cleared = bool(target_desc[last] > bound)
    else:
        cleared = bound == -math.inf
    return cleared, (REASON_BOUND if cleared else REASON_NOT_CLEARED), bound


def _check_same_support(target: ScoringIndex, draft_index: EnumerationIndex) -> None:
    """Refuse a target index whose support differs from the draft index's: results are drawn from the
    draft's support, so a certificate about the target's top-k would otherwise cover sequences the target
    index does not enumerate (or miss ones it does)."""
    target_prompt, prompt = _prompt_of(target), _prompt_of(draft_index)
    if target_prompt != prompt:
        raise InputError(f"the target index's prompt {list(target_prompt)} differs from the draft index's "
                         f"{list(prompt)}")
    theirs, ours = target.support, draft_index.support
    if theirs != ours:
        what = (f"length {theirs.max_len} vs {ours.max_len}" if theirs.max_len != ours.max_len else
                f"eos token (None: fixed-length continuations) {theirs.eos} vs {ours.eos}")
        raise InputError(f"the target index enumerates a different support than the draft index: {what} "
                         f"({theirs.describe()} vs {ours.describe()})")
    if target.capped:
        raise InputError("the target index is capped (branch_cap): it enumerates a sub-support; pass the target "
                         "model itself to rescore")


def _prompt_of(index: EnumerationIndex) -> tuple[int, ...]:
    return tuple(int(t) for t in index.prompt)


def _make_scorer(target: Any, draft_index: EnumerationIndex) -> Callable[[list[tuple]], Any]:
    """``[seqs] -> target log-probs`` for a target index, a model, or a bare callable, classified here."""
    if isinstance(target, ScoringIndex):
        _check_vocabulary(target.vocab_size, draft_index)
        _check_same_support(target, draft_index)
        return target.score_sequences
    try:
        model = as_model(target, name="target")
    except ValueError:
        if callable(target):
            return target
        raise InputError("target must be a model with score_sequences(), an enumeration index that scores "
                         "(an AutoregressiveEnumerable), or a callable [seqs] -> log_probs, got "
                         f"{type(target).__name__}") from None
    _check_vocabulary(model.vocab_size, draft_index)
    prompt = _prompt_of(draft_index)
    return lambda seqs: model.score_sequences(seqs, prompt=prompt)


def _check_vocabulary(target_vocab: int, draft_index: EnumerationIndex) -> None:
    if int(target_vocab) != int(draft_index.vocab_size):
        raise InputError(f"target vocab_size {target_vocab} differs from the draft index's {draft_index.vocab_size}")


class RescoredIndex:
    """Draft-ordered, target-scored enumeration with window reranking and sound certificates.

    Args:
        draft_index: an :class:`~speculum.enumeration.EnumerationIndex` (``AutoregressiveEnumerable``,
            ``SeekIndex``, ``AREnvelopeIndex``, or any object offering the same): ``slice`` pulls its
            candidates, ``order_error`` (None: unknown) and ``complete`` decide whether a certificate can
            exist, ``support`` and ``vocab_size`` say when every sequence has been scored, and its ``prompt``
            is passed to a model target.
        target: the expensive model — a protocol model (``score_sequences(seqs, prompt=...)``; an object
            with ``forward`` is adapted by ``as_model``), a
            :class:`~speculum.enumeration.ScoringIndex` such as an
            :class:`~speculum.enumeration.AutoregressiveEnumerable` (its support and prompt must be the draft
            index's, and it must not be capped) or a bare callable ``[seqs] -> log_probs``.
        rerank_window: extra draft candidates pulled past the query and reranked by target score.
        assumed_gap: global bound (nats) on ``|target_lp - draft_lp|``; without it no certificate. Only
            its half ``target_lp <= draft_lp + assumed_gap`` is used: an observed violation of that
            half voids the certificate (None); ``gap`` reports the two-sided maximum observed.
        certify: default for queries: grow the window geometrically (one batched target call per
            growth, scoring only new sequences) until certified or ``max_window`` is reached.
        max_window: the largest window ``certify`` may grow to.

    Target scores are cached, so a sequence is never scored twice; each query makes exactly one
    batched target call (none when every candidate is already cached), or one per growth step.

    Example:
        >>> from speculum.enumeration import AutoregressiveEnumerable
        >>> from speculum.models import MarkovModel
        >>> draft_index = AutoregressiveEnumerable(MarkovModel.random(5, seed=0), max_len=3, prompt=[0])
        >>> idx = RescoredIndex(draft_index, MarkovModel.random(5, seed=1), rerank_window=32, assumed_gap=20.0)
        >>> res = idx.top_k(10, certify=True)
        >>> len(res["items"]), res["certified"], res["target_calls"]
        (10, True, 3)
    """

    def __init__(
        self,
        draft_index: Any,
        target: Any,
        *,
        rerank_window: int = DEFAULT_RERANK_WINDOW,
        assumed_gap: float | None = None,
        certify: bool = False,
        max_window: int = DEFAULT_MAX_WINDOW,
    ) -> None:
        if not isinstance(draft_index, EnumerationIndex):
            raise InputError("draft_index must be an enumeration index (unrank, slice, support, prompt, "
                             f"vocab_size, order_error, complete), got {type(draft_index).__name__}")
        self.rerank_window = check_int(rerank_window, "rerank_window", minimum=0)
        self.max_window = check_int(max_window, "max_window", minimum=0)
        if self.max_window < self.rerank_window:
            raise InputError(f"max_window ({max_window}) must be >= rerank_window ({rerank_window})")
        if assumed_gap is not None:
            assumed_gap = check_number(assumed_gap, "assumed_gap", minimum=0)
        self.assumed_gap = assumed_gap
        self.certify = bool(certify)
        self.draft_index = draft_index
        self._score = _make_scorer(target, draft_index)
        order_error = draft_index.order_error
        if order_error is not None:
            order_error = check_number(order_error, "draft_index.order_error", minimum=0, finite=False)
        self.order_error = order_error
        self.complete = bool(draft_index.complete)
        self._space_size = draft_index.support.size(int(draft_index.vocab_size))   # None: infinite
        # Draft-ordered candidates pulled so far, and the target's score for every sequence seen.
        self._draft_seqs: list[tuple] = []
        self._draft_lps: list[float] = []
        self._draft_exhausted = False
        self._target_cache: dict[tuple, float] = {}
        self.observed_gap: float = 0.0  # running max |target - draft| over everything rescored
        self._max_excess = -math.inf  # running max (target - draft): checks the assumed bound
        self.target_calls: int = 0  # batched target scoring calls: the cost being economised

    # -- internals ---------------------------------------------------------------------------------
    def _pull_to(self, n: int) -> None:
        """Extend the draft-ordered candidate list to ``n`` items (or to the end of the draft)."""
        have = len(self._draft_seqs)
        if self._draft_exhausted or have >= n:
            return
        want = n - have
        try:
            got = list(self.draft_index.slice(have, want))
        except IndexError:
            got = []
        for seq, draft_lp in got:
            self._draft_seqs.append(tuple(int(t) for t in seq))
            self._draft_lps.append(float(draft_lp))
        if len(got) < want:
            self._draft_exhausted = True

    def _score_new(self, seqs: Sequence[tuple], draft_lps: Sequence[float]) -> None:
        """One batched target call for the uncached ``seqs``; updates the cache and observed gap."""
        new = [(s, d) for s, d in zip(seqs, draft_lps) if s not in self._target_cache]
        if not new:
            return
        batch = [s for s, _ in new]
        scores = np.asarray(self._score(batch), dtype=np.float64).reshape(-1)
        self.target_calls += 1
        if scores.shape != (len(batch),):
            raise InputError(f"target returned {scores.size} scores for {len(batch)} sequences")
        if np.isnan(scores).any() or np.isposinf(scores).any():
            raise InputError("target returned NaN or +inf log-probs")
        for (seq, draft_lp), target_lp in zip(new, scores.tolist()):
            self._target_cache[seq] = target_lp
            if math.isfinite(target_lp) and math.isfinite(draft_lp):
                self.observed_gap = max(self.observed_gap, abs(target_lp - draft_lp))
            # The certificate uses the one-sided bound target <= draft + gap; a draft zero under a
            # positive target probability (excess +inf) falsifies it.
            if target_lp > -math.inf:
                excess = target_lp - draft_lp if draft_lp > -math.inf else math.inf
                self._max_excess = max(self._max_excess, excess)

    def _query(self, start: int, k: int, certify: bool | None) -> dict[str, Any]:
        certify = self.certify if certify is None else bool(certify)
        calls_before = self.target_calls
        window = self.rerank_window
        while True:
            self._pull_to(start + k + window)
            pulled = min(start + k + window, len(self._draft_seqs))
            seqs, draft_lps = self._draft_seqs[:pulled], self._draft_lps[:pulled]
            self._score_new(seqs, draft_lps)
            result = self._rank_pulled(start, k, seqs, draft_lps, exhausted=pulled < start + k + window)
            result["window"] = window
            if result["certified"] or not certify or window >= self.max_window:
                break
            if result["reason"] != REASON_NOT_CLEARED:  # structural: a larger window cannot help
                break
            window = min(self.max_window, max(2 * window, k, 1))
        result["target_calls"] = self.target_calls - calls_before
        if certify and not result["certified"] and result["reason"] == REASON_NOT_CLEARED:
            result["reason"] = f"max_window {self.max_window} reached: " + result["reason"]
        return result

    def _rank_pulled(self, start, k, seqs, draft_lps, *, exhausted) -> dict[str, Any]:
        target_lps = [self._target_cache[s] for s in seqs]
        # Target order, ties lexicographic by token ids; zero-probability sequences are not results.
        order = sorted((i for i, lp in enumerate(target_lps) if lp > -math.inf),
                       key=lambda i: (-target_lps[i], seqs[i]))
        chosen = order[start : start + k]
        certified, reason, bound = certify_slice(
            np.asarray([target_lps[i] for i in order]), start, k, np.asarray(draft_lps),
            exhausted=exhausted and self._draft_exhausted, complete=self.complete,
            order_error=self.order_error, assumed_gap=self.assumed_gap,
            observed_gap=self._max_excess,
            covers_space=self._space_size is not None and len(seqs) >= self._space_size,
        )
        return {
            "items": [(seqs[i], target_lps[i]) for i in chosen],
            "draft_log_probs": [draft_lps[i] for i in chosen],
            "certified": certified,
            "gap": self.observed_gap,
            "reason": reason,
            "bound": bound,
            "pulled": len(seqs),
        }

    # -- queries -----------------------------------------------------------------------------------
    def top_k(self, k: int, *, certify: bool | None = None) -> dict[str, Any]:
        """The ``k`` best sequences by TARGET score among the ``k + window`` draft head.

        Returns ``{"items": [(seq, target_lp), ...], "certified": bool | None, "gap": float, ...}``
        plus ``draft_log_probs`` (aligned with items), ``window``, ``reason``, ``bound`` (proven
        limit on any unpulled target score), ``pulled`` and ``target_calls`` (made by this query).
        Scores are target-exact; the set is certified exact when ``certified is True`` (see the
        module docstring), approximate otherwise.
        """
        return self._query(0, check_int(k, "k", minimum=1), certify)

    def slice(self, start: int, k: int, *, certify: bool | None = None) -> dict[str, Any]:
        """Target-reranked ``[start, start + k)`` slice of the pulled ``start + k + window`` head.

        Same result keys and guarantees as :meth:`top_k`; the certificate proves that no unpulled
        sequence ranks before or inside the slice, i.e. both slice boundaries are the true ones.
        """
        return self._query(check_int(start, "start", minimum=0), check_int(k, "k", minimum=1), certify)

    def unrank(self, i: int) -> tuple[tuple, float]:
        """The DRAFT's rank-``i`` sequence with the TARGET's exact log-probability.

        The rank coordinate is the draft's (no reranking): the low-cost random-access primitive. Use
        :meth:`top_k` / :meth:`slice` when target order matters. ``IndexError`` past the draft support.
        """
        i = check_int(i, "i", minimum=0)
        self._pull_to(i + 1)
        if i >= len(self._draft_seqs):
            raise IndexError(f"rank {i} is past the draft index's support")
        seq = self._draft_seqs[i]
        self._score_new([seq], [self._draft_lps[i]])
        return seq, self._target_cache[seq]
