"""The persistent exact index behind :class:`~speculum.enumeration.AutoregressiveEnumerable`.

A prefix tree of the live prefixes within a log-prob budget (``tree.py``) is deepened in place as queries
need it; its complete sequences are grouped by a fine bucket of their exact information (``histogram.py``),
so a query bisects cumulative counts to one band and sorts only that band by the exact key (log-prob
descending, then token ids). The budget of a query grows from what the build has seen, each step at most
about doubling the forwards, optionally aimed by a small beam (``beam.py``) whose real sequences give a
budget that certainly suffices.

Example:
    >>> from speculum.models import MarkovModel
    >>> from speculum.enumeration.index.support import Support
    >>> index = SeekIndex(MarkovModel.random(4, seed=0), support=Support(max_len=2), prompt=[0])
    >>> [seq for seq, _ in index.top_k(2)] == [index.unrank(0)[0], index.unrank(1)[0]]
    True
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from ...validation import InputError, check_int, check_logprob, check_number, check_optional_int
from ..formats.automaton import AutomatonBudgetError
from .beam import beam_logprobs
from .histogram import DEFAULT_WIDTH_BITS, BucketIndex
from .support import Support, SupportAttributes
from .tree import DEFAULT_MAX_NODES, BuildProgress, ForwardBudgetError, IndexBudgetError, PrefixTree

__all__ = ["SeekIndex", "BandTooLargeError", "IndexBudgetError", "DEFAULT_MAX_BAND", "DEFAULT_MAX_NODES",
           "DEFAULT_BATCH_SIZE", "DEFAULT_RESERVE_BITS", "DEFAULT_BEAM_FORWARDS"]

DEFAULT_MAX_BAND = 1_000_000
DEFAULT_BATCH_SIZE = 512
DEFAULT_RESERVE_BITS = 1.0
# A beam aims the first budget of a query when it costs at most this many forwards (width x length).
DEFAULT_BEAM_FORWARDS = 512
_BEAM_MAX_STEPS = 64
_LN2 = math.log(2.0)
# Relative rounding of exp() and of the float sums behind mass brackets (a few ulps, made generous).
_MASS_ROUNDING = 1e-12


class BandTooLargeError(RuntimeError):
    """The sequences tied (to within one bucket) with a query's answer are too many to sort exactly."""


class SeekIndex(SupportAttributes):
    """The persistent index behind every query of an ``AutoregressiveEnumerable`` (see the module doc).

    Attributes: ``vocab_size``, ``support`` (with its ``max_len`` and ``eos``), ``prompt``, ``order_error``
    (0.0: the order is exact), ``forwards`` (prefixes forwarded so far), ``capped`` (True when ``branch_cap``
    dropped probability: every result then refers to the capped sub-support, see ``count_bracket``),
    ``complete``. A :class:`~speculum.enumeration.EnumerationIndex`. Arguments are checked by
    :class:`AutoregressiveEnumerable`, the public entry point.
    """

    order_error = 0.0

    def __init__(self, model, *, support: Support, prompt: Sequence[int] = (),
                 branch_cap: int | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
                 width_bits: float = DEFAULT_WIDTH_BITS, reserve_bits: float = DEFAULT_RESERVE_BITS,
                 max_band: int = DEFAULT_MAX_BAND, max_nodes: int = DEFAULT_MAX_NODES,
                 max_beam_forwards: int = DEFAULT_BEAM_FORWARDS,
                 progress: Callable[[BuildProgress], None] | None = None) -> None:
        self.model = model
        self.max_beam_forwards = max_beam_forwards
        self.vocab_size = int(model.vocab_size)
        self.support, self.prompt = support, tuple(prompt)
        self._support_count: int | None | bool = False        # every support sequence; False: not counted yet
        self.branch_cap, self.width_bits, self.max_band = branch_cap, width_bits, max_band
        self.tree = PrefixTree(model, prompt=self.prompt, support=support, branch_cap=branch_cap,
                               batch_size=batch_size, reserve_bits=reserve_bits, max_nodes=max_nodes,
                               progress=progress)
        self._last_deepening: tuple[float, int] | None = None   # (bits, forwards) before the last deepening
        self._beam = np.zeros(0)      # descending log-probs (less a slack) of complete sequences a beam found
        self.beam_forwards = 0        # prefixes the beam sent to the model (beside the tree's forwards)
        self.max_forwards = None
        self._refresh()

    # ------------------------------------------------------------------------------------------ state
    @property
    def forwards(self) -> int:
        """Prefixes sent to the model so far: the tree's forwards and the aiming beam's."""
        return self.tree.forwards + self.beam_forwards

    @property
    def max_forwards(self) -> int | None:
        """Most prefixes forwarded in all, beam included (None: no limit): ``ForwardBudgetError`` before passing it."""
        return self._max_forwards

    @max_forwards.setter
    def max_forwards(self, limit: int | None) -> None:
        self._max_forwards = limit    # the tree counts only its own forwards: its share is what the beam left
        self.tree.max_forwards = None if limit is None else limit - self.beam_forwards

    @property
    def capped(self) -> bool:
        """True when ``branch_cap`` restricts the index to a sub-support: every result then refers to it."""
        return self.branch_cap is not None and self.branch_cap < self.vocab_size

    @property
    def complete(self) -> bool:
        """True iff the enumerated support is the model's whole support (no branch_cap, no length cut)."""
        return not self.capped and not self.tree.length_truncated

    @property
    def support_size(self) -> int | None:
        """Number of positive-probability support sequences once the whole tree is built, else None (not
        known yet)."""
        return self.index.total if self.tree.exhausted else None

    def nbytes(self) -> int:
        """Bytes held by the index's arrays (tree levels, leaf table, bucket index)."""
        leaf = self.leaf_level.nbytes + self.leaf_node.nbytes + self.leaf_lp.nbytes
        return self.tree.nbytes() + leaf + self.index.nbytes()

    def _refresh(self) -> None:
        """Re-collect the certified leaves (every support sequence with log p >= the certified budget)."""
        certified = -math.inf if self.tree.exhausted else self.tree.budget
        levels, nodes, lps = [], [], []
        for depth, level in enumerate(self.tree.levels):
            ids = np.flatnonzero(level.leaf & (level.logprob >= certified))
            levels.append(np.full(len(ids), depth, dtype=np.int32))
            nodes.append(ids.astype(np.int32))
            lps.append(level.logprob[ids])
        self.certified_logprob = certified
        self.leaf_level = np.concatenate(levels)    # (n,) length of each certified sequence
        self.leaf_node = np.concatenate(nodes)      # (n,) its index in that level
        self.leaf_lp = np.concatenate(lps)          # (n,) its exact log-prob
        self.index = BucketIndex(self.leaf_lp, width_bits=self.width_bits)
        self._bands: dict[int, np.ndarray] = {}

    def extend_to(self, budget: float, *, expected: float | None = None) -> None:
        before = (-self.tree.budget / _LN2 if math.isfinite(self.tree.budget) else 0.0, self.tree.forwards)
        try:
            self.tree.extend(budget, expected=expected)
        except ForwardBudgetError as exc:     # the tree counts its own forwards: the limit counts the beam's too
            raise ForwardBudgetError(self._max_forwards, exc.needed + self.beam_forwards) from None
        self._last_deepening = before
        self._refresh()

    def _support_sequences(self) -> int | None:
        """Every support sequence, counted on first use; None when infinite, or for a format whose count would
        need more of its token automaton than the automaton's budget allows."""
        if self._support_count is False:
            try:
                self._support_count = self.support.size(self.vocab_size)
            except AutomatonBudgetError:
                self._support_count = None
        return self._support_count

    def _beyond_support(self, count: int) -> bool:
        """Whether ``count`` exceeds the number of support sequences (so no query can need that many). A
        format is not counted for this: counting builds every state of its automaton within ``max_len``
        tokens, while a query beyond it ends anyway, when the tree runs out."""
        if self.support.constraint is not None and self._support_count is False:
            return False
        total = self._support_sequences()
        return total is not None and count > total

    def grow_to_count(self, needed: int) -> None:
        """Deepen until at least ``needed`` sequences are certified, or the support is exhausted.

        Forwards are what a query costs, and the fewest that can certify the top ``needed`` are the prefixes
        with ``log p >= threshold(needed)`` — what a best-first search expands. Two kinds of step approach
        that from above: (1) once the tree stores ``needed`` leaves (the certified ones plus those kept in
        the reserve below the budget), the ``needed``-th best stored log-prob ``b`` is a budget that
        certainly suffices (at least ``needed`` support sequences have ``log p >= b``), and
        ``b <= threshold(needed)`` is usually close to it; (2) before that, the count within ``B`` bits
        grows roughly exponentially in ``B``: the budget extrapolates the growth seen so far (a pilot at
        half the bits first), aiming *short* of the need (80 %) so that the reserve rather than an
        overshoot supplies the last leaves and step (1) finishes.

        Every step is also capped so that the forwards it predicts at most double the forwards so far, or
        add one batch (``work_step_bits``): when leaves are rare (deep eos-terminated supports) the leaf extrapolation
        knows nothing, and a step of many bits would expand exponentially more prefixes than the answer
        needs. With the cap, the forwards of the last step are at most about twice those that certify the
        answer (plus a batch), and all earlier steps together at most as many again (a doubling argument).
        Before the first step a small beam may find ``needed`` real sequences (``_aim_with_beam``): a
        budget that certainly suffices and is usually the threshold itself, which the steps then aim at."""
        if (self.index.total < needed and not self.tree.exhausted and needed > self.tree.max_nodes
                and (self._support_sequences() is None or self._support_sequences() > self.tree.max_nodes)):
            # Refused up front: every certified sequence is a stored node.
            raise IndexBudgetError(
                f"this query needs at least {needed:,} stored sequences, more than max_nodes="
                f"{self.tree.max_nodes:,}; raise max_nodes (CLI: --max-nodes)")
        if self.index.total < needed and not self.tree.exhausted:
            self._aim_with_beam(needed)
        while self.index.total < needed and not self.tree.exhausted:
            have = self.index.total
            sufficient = self._stored_budget(needed)
            if sufficient is not None and sufficient >= self.tree.budget:
                sufficient = None
            if math.isinf(self.tree.budget):
                # Pilot: cheap, and it measures the growth. With a known sufficient budget its prefixes keep
                # their children down to it, so that no later step forwards them again.
                self._deepen(0.5 * math.log2(needed) + 2.0, expected=sufficient)
                continue
            built = -self.tree.budget / _LN2
            cap = self.work_step_bits(built)
            # Growth rate (count doublings per bit) from the origin (1 sequence at 0 bits) to here.
            rate = max(math.log2(max(have, 2)) / max(built, 1e-9), 0.05)
            # With a sufficient budget in reach, step to it; beyond the cap, creep towards it (below),
            # every prefix keeping its children down to it.
            if sufficient is not None and -sufficient / _LN2 - built <= cap:
                # ``sufficient`` finishes for sure, but its bound misses the leaves of prefixes not yet
                # forwarded, so it can lie well below the threshold: try the extrapolated budget first when
                # that is shallower (no prefix is forwarded twice: children are kept down to ``sufficient``).
                guess = built + max(math.log2(needed / max(have, 1)) / rate, 0.25)
                if have > 0 and guess * _LN2 < -sufficient:
                    self._deepen(guess, expected=sufficient)
                else:
                    self.extend_to(sufficient)       # the exact log-prob: no round trip through bits
                continue
            step = math.log2(0.8 * needed / max(have, 1)) / rate
            bits = built + min(max(step, 0.25), cap)
            # When the step was capped another deepening will follow; keep children down to where the
            # extrapolation (with a margin) ends — at most one more capped step away — so that it forwards
            # none of these prefixes again.
            expected = sufficient
            if bits < built + step and expected is None:
                # Without any leaf the extrapolation knows nothing: keep children one more capped step deep.
                reach = math.log2(1.5 * needed / have) / rate if have else 2.0 * cap
                # At most one more capped step past this one: from a few leaves the rate is a poor guess,
                # and every child kept that deep is a stored node (a whole vocabulary per prefix, at worst).
                expected = -min(built + reach, bits + cap) * _LN2
            self._deepen(bits, expected=expected)

    def work_step_bits(self, built: float, limit: int | None = None) -> float:
        """Largest deepening (bits) past ``built`` whose forwards are predicted to at most double those so far,
        or to add one batch (``batch_size`` prefixes cost about one batched call, little more than a few), and
        to stay within ``limit`` forwards in all when given (at least a quarter bit).

        The forward count grows about exponentially in the budget's bits; its rate is taken as the larger of
        the rate from the origin and the rate over the last deepening (growth speeds up with depth, and an
        underestimate would overshoot)."""
        forwards = max(self.tree.forwards, 1)
        growth = math.log2(self._allowed_forwards(forwards, limit) / forwards)
        return max(0.25, min(growth / max(self._growth_rate(built), 1e-9), max(built, 4.0)))

    def forwards_to(self, bits: float, built: float) -> float:
        """The forwards predicted to deepen from ``built`` to ``bits`` (the rate of :meth:`work_step_bits`):
        a guide to give up early, never part of an answer."""
        forwards = max(self.tree.forwards, 1)
        return forwards * 2.0 ** min(self._growth_rate(built) * max(bits - built, 0.0), 1000.0)

    def _allowed_forwards(self, forwards: int, limit: int | None) -> float:
        allowed = max(2.0 * forwards, forwards + self.tree.batch_size)
        if limit is not None:
            allowed = max(min(allowed, float(limit)), float(forwards))
        return allowed

    def _growth_rate(self, built: float) -> float:
        """Forwards' growth in log2 per bit of budget: the larger of the rate from the origin and over the
        last deepening."""
        forwards = max(self.tree.forwards, 1)
        rate = math.log2(forwards + 1) / max(built, 1e-9)
        if self._last_deepening is not None:
            past_bits, past_forwards = self._last_deepening
            if built > past_bits and forwards > past_forwards:
                rate = max(rate, math.log2(forwards / max(past_forwards, 1)) / (built - past_bits))
        return rate

    def _deepen(self, bits: float, *, expected: float | None = None) -> None:
        """Extend the tree to ``bits`` of information (the whole support past 2000 bits) and re-index."""
        self.extend_to(-math.inf if bits >= 2000.0 else -bits * _LN2, expected=expected)

    def _stored_budget(self, needed: int) -> float | None:
        """A budget that certainly certifies ``needed`` sequences, or None: the ``needed``-th largest log-prob
        among stored leaves (every stored leaf is a distinct support sequence, so ``count(b) >= needed``),
        or the beam's (see ``_aim_with_beam``), whichever is higher."""
        stored = np.concatenate([level.logprob[level.leaf] for level in self.tree.levels])
        budgets = []
        if len(stored) >= needed:
            budgets.append(float(np.partition(stored, len(stored) - needed)[len(stored) - needed]))
        if len(self._beam) >= needed:
            budgets.append(float(self._beam[needed - 1]))
        return max(budgets) if budgets else None

    def _aim_with_beam(self, needed: int) -> None:
        """Find ``needed`` real complete sequences with a beam (``beam.py``) when the tree does not store
        that many yet and the beam is cheap (at most ``max_beam_forwards`` forwards): their ``needed``-th best
        log-prob is a budget that certainly suffices, so the growth aims at it instead of searching blind
        (a fixed-length support has no leaf before its last level). Lowered by a relative 1e-6: a backend
        may differ in the last bits between batch compositions, and a lower budget still suffices."""
        horizon = self.support.horizon(_BEAM_MAX_STEPS)
        width = needed
        if len(self._beam) >= needed or width * horizon > self.max_beam_forwards:
            return
        stored = sum(int(np.count_nonzero(level.leaf)) for level in self.tree.levels)
        if stored >= needed:
            return
        limit = self._max_forwards
        try:
            found, forwards = beam_logprobs(self.model, prompt=self.prompt, width=width, support=self.support,
                                            max_steps=_BEAM_MAX_STEPS, max_forwards=limit and limit - self.forwards)
        except ForwardBudgetError as exc:
            raise ForwardBudgetError(limit, self.forwards + exc.needed) from None
        self.beam_forwards += forwards
        self.max_forwards = limit     # the tree's share shrinks by the beam's forwards
        found = found[np.isfinite(found)]
        self._beam = found - 1e-6 * (1.0 + np.abs(found))

    def grow_to_logprob(self, logprob: float) -> None:
        if logprob < self.certified_logprob and not self.tree.exhausted:
            self.extend_to(logprob)

    # ------------------------------------------------------------------------------------------ bands
    def tokens_of(self, ids: np.ndarray) -> np.ndarray:
        """``(len(ids), max length)`` token matrix of certified sequences, padded with -1 after the end."""
        width = int(self.leaf_level[ids].max()) if len(ids) else 0
        out = np.full((len(ids), width), -1, dtype=np.int64)
        for depth in np.unique(self.leaf_level[ids]):
            rows = np.flatnonzero(self.leaf_level[ids] == depth)
            node = self.leaf_node[ids[rows]]
            for d in range(int(depth), 0, -1):
                level = self.tree.levels[d]
                out[rows, d - 1] = level.token[node]
                node = level.parent[node]
        return out

    def _sorted_band(self, band: int) -> np.ndarray:
        """Certified sequence ids of one band in exact order: log-prob descending, then token ids ascending."""
        cached = self._bands.get(band)
        if cached is None:
            ids = self.index.band_members(band)
            if len(ids) > self.max_band:
                raise BandTooLargeError(
                    f"{len(ids)} sequences lie within {self.width_bits:g} bits of the answer, more than "
                    f"max_band={self.max_band} can sort exactly; raise max_band or use the approximate "
                    "index speculum.enumeration.AREnvelopeIndex")
            tokens = self.tokens_of(ids)
            # -1 padding sorts a sequence before its own extensions, as Python tuple order does.
            order = np.lexsort([*tokens.T[::-1], -self.leaf_lp[ids]])
            cached = self._bands[band] = ids[order]
        return cached

    def _items(self, ids: np.ndarray) -> list[tuple[tuple[int, ...], float]]:
        """``(tokens, log-prob)`` of the certified sequences ``ids``, their tokens read in one walk."""
        tokens = self.tokens_of(ids).tolist()
        return [(tuple(t for t in row if t >= 0), lp) for row, lp in zip(tokens, self.leaf_lp[ids].tolist())]

    def _raise_beyond(self, rank: int) -> None:
        size = self.support_size
        what = (f"it has {size} sequences" if size is not None
                else f"it has at most {self._support_sequences()} sequences")
        raise IndexError(f"rank {rank} is beyond the support ({self.support.describe()}): {what}")

    # ---------------------------------------------------------------------------------------- queries
    def unrank(self, i: int) -> tuple[tuple[int, ...], float]:
        """The ``i``-th most probable sequence (0-based) and its exact log-prob. Exact.

        Raises ``IndexError`` (naming the support size) past the support."""
        i = check_int(i, "i", minimum=0)
        if self._beyond_support(i + 1):
            self._raise_beyond(i)
        self.grow_to_count(i + 1)
        if i >= self.index.total:
            self._raise_beyond(i)
        band, offset = self.index.locate(i)
        return self._items(self._sorted_band(band)[offset: offset + 1])[0]

    def slice(self, start: int, k: int) -> list[tuple[tuple[int, ...], float]]:
        """Ranks ``start .. start+k-1`` in exact order (fewer if the support ends first). Exact."""
        start = check_int(start, "start", minimum=0)
        k = check_int(k, "k", minimum=0)
        if k == 0 or self._beyond_support(start + 1):
            return []
        self.grow_to_count(start + k)
        end = min(start + k, self.index.total)
        out = []
        rank = start
        while rank < end:
            band, offset = self.index.locate(rank)
            ids = self._sorted_band(band)[offset: offset + end - rank]
            out.extend(self._items(ids))
            rank += len(ids)
        return out

    def top_k(self, k: int) -> list[tuple[tuple[int, ...], float]]:
        """The ``k`` most probable sequences, descending (all of them if the support is smaller). Exact."""
        return self.slice(0, check_int(k, "k", minimum=1))

    def threshold(self, k: int) -> float:
        """Log-prob of the ``k``-th most probable sequence (``k >= 1``). Exact."""
        return self.unrank(check_int(k, "k", minimum=1) - 1)[1]

    def count(self, min_log_prob: float) -> int:
        """Number of support sequences with ``log p >= min_log_prob``. Exact (on the capped sub-support
        when ``capped``; ``count_bracket`` bounds the rest)."""
        min_log_prob = check_logprob(min_log_prob)
        self.grow_to_logprob(min_log_prob)
        band, present = self.index.band_of(min_log_prob)
        inside = 0
        if present:
            inside = int(np.count_nonzero(self.leaf_lp[self.index.band_members(band)] >= min_log_prob))
        return self.index.count_before(band) + inside

    def count_bracket(self, min_log_prob: float) -> tuple[int, int]:
        """Sound ``(lo, hi)`` on the number of sequences with ``log p >= min_log_prob`` in the *uncapped*
        support: ``lo`` is the exact capped count; each subtree dropped by ``branch_cap`` holds at most
        ``its mass / p_min`` such sequences (their probabilities sum to at most its mass). Certified."""
        lo = self.count(min_log_prob)
        dropped = self._capped_mass_above(min_log_prob)
        if dropped == 0.0:
            return lo, lo
        return lo, lo + math.floor(dropped * math.exp(-min_log_prob) * (1.0 + _MASS_ROUNDING))

    def _capped_mass_above(self, min_log_prob: float) -> float:
        # Only prefixes at least as probable as the threshold can have completions above it.
        mass = math.fsum(level.capped_mass_above(min_log_prob) for level in self.tree.levels)
        return mass * (1.0 + _MASS_ROUNDING)

    def mass_above(self, min_log_prob: float) -> tuple[float, float]:
        """Sound ``(lo, hi)`` bracket on the total probability of sequences with ``log p >= min_log_prob``.

        Certified: the sequences are summed exactly (``math.fsum``), so the bracket only widens by float
        rounding of ``exp`` — the limit of ever finer quantisation — plus, when ``capped``, the mass
        ``branch_cap`` dropped above the threshold (added to ``hi``)."""
        min_log_prob = check_logprob(min_log_prob)
        self.grow_to_logprob(min_log_prob)
        total = math.fsum(np.exp(self.leaf_lp[self.leaf_lp >= min_log_prob]).tolist())
        lo = total * (1.0 - _MASS_ROUNDING)
        hi = total * (1.0 + _MASS_ROUNDING) + self._capped_mass_above(min_log_prob)
        return lo, min(hi, 1.0)

    def mass(self, *, tolerance: float = 1e-3, max_forwards: int | None = None) -> tuple[float, float]:
        """Sound ``(lo, hi)`` bracket on the total probability of the support: for a constrained index, the
        probability that the model spells a member of the language. Certified.

        Deepens (each step at most about doubling the forwards) until ``hi - lo <= tolerance * hi``, the
        support is exhausted, or ``max_forwards`` prefixes were forwarded; the bracket is sound at any point:
        ``lo`` sums the stored sequences, ``hi`` adds every prefix not expanded and every allowed child not
        stored (``PrefixTree.unseen_mass``)."""
        tolerance = check_number(tolerance, "tolerance", minimum=0)
        max_forwards = check_optional_int(max_forwards, "max_forwards", minimum=0)
        if not self.tree.constrained:
            if self.support.eos is None and not self.capped:
                return 1.0, 1.0           # every fixed-length sequence: the model's steps sum to one
            raise InputError("mass() needs a constraint or a fixed-length uncapped support; use mass_above")
        while True:
            leaves = np.concatenate([level.logprob[level.leaf] for level in self.tree.levels])
            lo = math.fsum(np.exp(leaves).tolist())
            hi = min(1.0, lo * (1.0 + _MASS_ROUNDING) + self.tree.unseen_mass())
            lo *= 1.0 - _MASS_ROUNDING
            spent = max_forwards is not None and self.forwards >= max_forwards
            if hi - lo <= tolerance * hi or self.tree.exhausted or spent:
                return lo, hi
            built = -self.tree.budget / _LN2 if math.isfinite(self.tree.budget) else 0.0
            self._deepen(built + max(1.0, self.work_step_bits(max(built, 1.0))))

    # ------------------------------------------------------------------------------------------- rank
    def find(self, seq: tuple[int, ...]) -> tuple[int, float] | None:
        """``(node, log-prob)`` of ``seq``'s leaf in the stored tree, or None if it is not stored."""
        node = 0
        for depth, token in enumerate(seq, start=1):
            if depth >= len(self.tree.levels):
                return None
            level = self.tree.levels[depth]
            hit = np.flatnonzero((level.parent == node) & (level.token == token))
            if not len(hit):
                return None
            node = int(hit[0])
        return node, float(self.tree.levels[len(seq)].logprob[node])

    def rank(self, seq: Sequence[int]) -> int:
        """Number of support sequences before ``seq`` in the exact order (strictly more probable, or equally
        probable and lexicographically smaller), so that ``unrank(rank(seq)) == seq``. Exact.

        Raises ``ValueError`` for a sequence off the support (wrong length / eos, zero probability, or
        outside the capped sub-support)."""
        seq = self.support.check(seq, self.vocab_size)
        found = self.find(seq)
        if found is not None and found[1] < self.certified_logprob:
            self.grow_to_logprob(found[1])    # stored past the budget: certify down to it
        elif found is None:
            # Probe its log-prob (one batched call over its prefixes) to know how deep to build.
            prefixes = [list(self.prompt) + list(seq[:j]) for j in range(len(seq))]
            if self._max_forwards is not None and self.forwards + len(prefixes) > self._max_forwards:
                raise ForwardBudgetError(self._max_forwards, self.forwards + len(prefixes))
            rows = np.asarray(self.model.next_logprobs(prefixes), dtype=np.float64)
            self.tree.forwards += len(prefixes)
            probe = float(np.sum(rows[np.arange(len(seq)), list(seq)]))
            if not math.isfinite(probe):
                raise InputError("sequence is off the support: it has probability zero")
            # Backends may differ in the last bits between batch compositions: build a little deeper.
            self.grow_to_logprob(probe - 1e-6 * (1.0 + abs(probe)))
            found = self.find(seq)
            if found is None:
                raise InputError(f"sequence is outside the capped sub-support (branch_cap={self.branch_cap})")
        node, logprob = found
        band, _ = self.index.band_of(logprob)
        ids = self._sorted_band(band)
        position = np.flatnonzero((self.leaf_level[ids] == len(seq)) & (self.leaf_node[ids] == node))
        return self.index.count_before(band) + int(position[0])

    def score_sequences(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
        """``(batch,)`` exact log p(sequence | prompt) by the model's teacher forcing (batched)."""
        return self.model.score_sequences(sequences, prompt=self.prompt)
