"""Deep ranks (1e12 and beyond): a sampled per-depth envelope with real tokens and exact scores.

The exact index pays one forward per live prefix, so rank 1e12 is out of its reach. The envelope
replaces the prefix tree by a *product* model estimated from sampled paths: at depth ``d`` the r-th most
probable next token has information ``x_d[r]`` (nats), the same for every prefix. Its sequences are
rank tuples ``(r_0, ..., r_{n-1})``, counted per bucket of summed step bins by convolving per-depth
histograms (no forward at all), and a tuple becomes a real sequence by taking, under the actual prefix,
the ``r_d``-th most probable token — one session step per depth, KV cache reused between neighbours.

Guarantees:

* **scores exact** — every returned log-prob is the model's own (sum of the real rows);
* **never a duplicate** — distinct tuples differ at a first depth, where the same real prefix gets two
  different token ranks; the envelope order is a fixed permutation of the tuples;
* **rank coordinate approximate** — the i-th item has rank near ``i``; :meth:`rank_estimate` returns a
  bracket from pointwise min/max envelopes over the sampled rows, sound whenever every prefix's sorted
  row lies within them (always, for prefix-independent models);
* **exact on prefix-independent models** (each depth one distribution): within the first
  ``exact_limit`` tuples the order is the true order (ties by rank tuple); beyond, tuples are ordered by
  summed ``resolution``-bins, an order error of at most ``max_len * resolution`` nats.

Eos-terminated enumeration splits eos from the other tokens: a sequence is non-eos ranks then eos.
Without ``max_len`` the length horizon is ``max_depth``. A rank too deep for the current histograms
deepens them (doubling), so ``IndexError`` means past the whole finite support, never a shallow histogram.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from ...models.base import as_model, check_prompt
from ...validation import InputError, check_int, check_logprob, check_number
from ..enumerable import AutoregressiveEnumerable, SeekIndex
from ..index.support import Support, SupportAttributes

__all__ = ["AREnvelopeIndex", "EnvelopeEntry", "DEFAULT_RESOLUTION", "DEFAULT_EXACT_LIMIT"]

DEFAULT_RESOLUTION = 0.01  # nats per histogram bin
DEFAULT_EXACT_LIMIT = 20_000  # envelope tuples ordered exactly (enumerated once, no forwards)
DEFAULT_MAX_DEPTH = 64  # length horizon of eos-terminated enumeration without max_len
_MAX_ADDRESSABLE = 2**53  # float64 counts are exact integers below this


@dataclass(frozen=True)
class EnvelopeEntry:
    """One envelope item: real tokens, exact log-prob, and a bracket on its true rank."""

    index: int  # position in the envelope order
    sequence: tuple[int, ...]
    log_prob: float  # exact, the model's own
    envelope_log_prob: float  # the tuple's score under the mean envelope (orders the index)
    rank_estimate: int
    rank_lo: int
    rank_hi: int


@dataclass
class _Profile:
    """One envelope: per-depth sorted step information (nats, ascending) and eos information."""

    info: list[np.ndarray]  # [depth] (n_choices,) non-eos choices, ascending
    eos_info: np.ndarray | None  # (depth,) eos information, or None for fixed length


class _Histograms:
    """Counts of envelope tuples per bucket of summed step bins ``ceil(info / resolution)``.

    ``suffix[d][b]`` counts completions from depth ``d`` whose bins sum to ``b`` (truncated to
    ``b <= top``). A tuple of ``n`` steps in bucket ``B`` has information in ``((B - n) w, B w]``.
    """

    def __init__(self, profile: _Profile, resolution: float, horizon: int) -> None:
        self.horizon = horizon
        with np.errstate(over="ignore", invalid="ignore"):
            self.bins = [np.ceil(x[np.isfinite(x)] / resolution).astype(np.int64) for x in profile.info]
            eos = profile.eos_info
            self.eos_bins = None if eos is None else [
                int(math.ceil(e / resolution)) if math.isfinite(e) else None for e in eos]
        # Largest meaningful bucket: past it nothing changes (the support is finite).
        step_max = [int(b[-1]) if len(b) else 0 for b in self.bins]
        if self.eos_bins is not None:
            step_max = [max(s, e or 0) for s, e in zip(step_max, self.eos_bins)]
        self.saturation = int(sum(step_max))
        self.top = -1
        self.suffix: list[np.ndarray] = []

    def build(self, top: int) -> None:
        top = min(int(top), self.saturation)
        if top <= self.top:
            return
        self.top = top
        size = top + 1
        fixed = self.eos_bins is None
        rest = np.zeros(size)
        if fixed:
            rest[0] = 1.0
        suffix = [rest]
        for d in range(self.horizon - 1, -1, -1):
            counts = np.zeros(size)
            last = d == self.horizon - 1
            if fixed or not last:
                # Only as long as the step's largest bin: a direct convolution costs size x len(step), and
                # padding the step to ``size`` made a deep build cubic in the length.
                step = np.bincount(self.bins[d][self.bins[d] <= top]).astype(np.float64)
                if len(step):
                    with np.errstate(over="ignore", invalid="ignore"):
                        counts += np.convolve(suffix[-1], step)[:size]
            if not fixed and self.eos_bins[d] is not None and self.eos_bins[d] <= top:
                counts[self.eos_bins[d]] += 1.0
            suffix.append(counts)
        self.suffix = suffix[::-1]  # suffix[d], d = 0..horizon (suffix[horizon]: the empty completion)
        self.cumulative = np.cumsum(self.suffix[0])
        nonzero = [np.flatnonzero(c) for c in self.suffix]
        self.min_rest = [int(z[0]) if len(z) else math.inf for z in nonzero]

    def count_up_to(self, bucket: int) -> float:
        """Tuples whose summed bins are ``<= bucket`` (deepens as needed)."""
        if bucket < 0:
            return 0.0
        if bucket > self.top:
            self.build(max(bucket, 2 * self.top))
        return float(self.cumulative[min(bucket, self.top)])


class AREnvelopeIndex(SupportAttributes):
    """Approximate-rank, exact-score index over a model's continuations, for very deep ranks.

    Args:
        ar_or_model: an :class:`~speculum.enumeration.AutoregressiveEnumerable` or ``SeekIndex`` (its
            model, support and prompt are used) or a protocol model with the keywords below.
        n_paths: sampled prefixes per depth the envelope is estimated from.
        seed: seed of the path sampler (the index is a deterministic function of it).
        exploration: fraction of paths drawn uniformly (deep ranks live on atypical prefixes).
        resolution: histogram bin width in nats (order error beyond ``exact_limit``: <= max_len bins).
        exact_limit: number of leading envelope tuples ordered exactly.

    An :class:`~speculum.enumeration.EnumerationIndex` for :class:`RescoredIndex`: ``support``, ``prompt``,
    ``order_error = None`` (no bound on real models), ``complete = False``, ``capped = False``.

    Example:
        >>> from speculum.models import MarkovModel
        >>> env = AREnvelopeIndex(MarkovModel.random(50, seed=0), max_len=8, prompt=[0], n_paths=8)
        >>> seq, log_prob = env.unrank(10**12)        # a real sequence, its exact log-prob
        >>> estimate, lo, hi = env.rank_estimate(seq)  # its true rank: approximate, bracketed
        >>> len(seq), lo <= estimate <= hi
        (8, True)
    """

    order_error = None
    complete = False
    capped = False

    def __init__(self, ar_or_model: Any, *, n_paths: int = 64, seed: int = 0, max_len: int | None = None,
                 eos: int | None = None, prompt: Sequence[int] = (), exploration: float = 0.5,
                 resolution: float = DEFAULT_RESOLUTION, exact_limit: int = DEFAULT_EXACT_LIMIT,
                 max_depth: int = DEFAULT_MAX_DEPTH) -> None:
        if isinstance(ar_or_model, (AutoregressiveEnumerable, SeekIndex)):
            model, support, prompt = ar_or_model.model, ar_or_model.support, ar_or_model.prompt
            if support.constraint is not None:
                # The envelope samples unconstrained next-token rows; its rank coordinate would ignore the format.
                raise InputError("AREnvelopeIndex does not take a constrained index; rank within a format with "
                                 "estimate_rank(..., constraint=...) (exact, or a certified bracket)")
        else:
            model = as_model(ar_or_model, name="ar_or_model")
            support = Support.for_model(max_len=max_len, eos=eos, vocab_size=model.vocab_size)
        n_paths = check_int(n_paths, "n_paths", minimum=1)
        exact_limit = check_int(exact_limit, "exact_limit", minimum=0)
        max_depth = check_int(max_depth, "max_depth", minimum=1)
        resolution = check_number(resolution, "resolution", above=0)
        exploration = check_number(exploration, "exploration", minimum=0, maximum=1)
        self.model = model
        self.vocab_size = int(model.vocab_size)
        self.support = support
        self.prompt = tuple(check_prompt(model, prompt, name="prompt"))
        self.horizon = support.horizon(max_depth)
        # What the envelope reaches: the support cut at the horizon (the support itself unless uncapped).
        self._reach = replace(support, max_len=self.horizon)
        self.resolution = resolution
        self._walker = _RowWalker(model, self.prompt, self.eos)
        mean, lo, hi = _sample_profiles(self._walker, self.horizon, self.eos, n_paths, exploration,
                                        np.random.default_rng(seed))
        self._mean_profile = mean
        self._mean = _Histograms(mean, self.resolution, self.horizon)
        self._lo = _Histograms(lo, self.resolution, self.horizon)  # optimistic: counts more
        self._hi = _Histograms(hi, self.resolution, self.horizon)  # pessimistic: counts fewer
        self._build_exact_region(exact_limit)

    # ------------------------------------------------------------------------------ envelope order
    def _build_exact_region(self, exact_limit: int) -> None:
        """Enumerate the tuples of buckets ``<= c + horizon - 1`` (at most ``exact_limit``): those with
        information ``<= c w`` come first in exact order; the rest of these buckets follow by bucket."""
        hist, n = self._mean, self.horizon
        top = max(4 * n, int(8.0 / self.resolution))
        hist.build(top)
        while hist.cumulative[-1] <= exact_limit and hist.top < hist.saturation:
            hist.build(2 * hist.top)
        fits = np.flatnonzero(hist.cumulative <= exact_limit)
        cut = int(fits[-1]) - (n - 1) if len(fits) else -1
        if hist.top == hist.saturation and hist.cumulative[-1] <= exact_limit:
            cut = hist.top  # the whole support fits
        self._cut = cut
        if cut < 0:
            self._exact, self._rest, self._dfs_from = [], [], 0
            return
        theta = cut * self.resolution
        tuples = list(self._enumerate(min(cut + n - 1, hist.top)))
        exact = sorted((t for t in tuples if t[1] <= theta), key=lambda t: (t[1], t[2]))
        rest = sorted((t for t in tuples if t[1] > theta), key=lambda t: (t[0], t[2]))
        self._exact = [(choices, info) for _, info, choices in exact]
        self._exact_info = [info for _, info, _ in exact]
        self._rest = [(choices, info) for _, info, choices in rest]
        self._dfs_from = cut + n

    def _enumerate(self, limit: int):
        """Every envelope tuple with summed bins ``<= limit``: yields ``(bucket, info, choices)``."""
        hist, info = self._mean, self._mean_profile
        fixed = self.eos is None
        stack = [(0, 0, 0.0, ())]
        while stack:
            d, bucket, total, choices = stack.pop()
            if d == self.horizon:
                yield bucket, total, choices
                continue
            if not fixed and hist.eos_bins[d] is not None and bucket + hist.eos_bins[d] <= limit:
                yield bucket + hist.eos_bins[d], total + float(info.eos_info[d]), choices
            if not fixed and d == self.horizon - 1:
                continue
            bins = hist.bins[d]
            room = limit - bucket - hist.min_rest[d + 1]
            for r in range(int(np.searchsorted(bins, room, side="right"))):
                stack.append((d + 1, bucket + int(bins[r]), total + float(info.info[d][r]), choices + (r,)))

    def _choices(self, i: int) -> tuple[tuple[int, ...], float | None]:
        """The i-th tuple of the envelope order (deepening the histograms as needed)."""
        if i < len(self._exact):
            return self._exact[i]
        j = i - len(self._exact)
        if j < len(self._rest):
            return self._rest[j]
        offset = j - len(self._rest) + (self._mean.count_up_to(self._dfs_from - 1) if self._dfs_from else 0.0)
        hist = self._mean
        while hist.cumulative[-1] <= offset:
            if hist.top >= hist.saturation:
                raise IndexError(f"rank {i} is past the envelope's support")
            hist.build(2 * hist.top)
        bucket = int(np.searchsorted(hist.cumulative, offset, side="right"))
        offset -= float(hist.cumulative[bucket - 1]) if bucket else 0.0
        return self._descend(bucket, offset), None

    def _descend(self, bucket: int, offset: float) -> tuple[int, ...]:
        """The ``offset``-th tuple of ``bucket`` in lexicographic order (eos before any other choice)."""
        hist, fixed = self._mean, self.eos is None
        used, choices = 0, []
        for d in range(self.horizon):
            if not fixed and hist.eos_bins[d] is not None and used + hist.eos_bins[d] == bucket:
                if offset < 1:
                    return tuple(choices)
                offset -= 1
            bins = hist.bins[d]
            valid = int(np.searchsorted(bins, bucket - used, side="right"))
            counts = hist.suffix[d + 1][bucket - used - bins[:valid]]
            cum = np.cumsum(counts)
            r = int(np.searchsorted(cum, offset, side="right"))
            offset -= float(cum[r - 1]) if r else 0.0
            used += int(bins[r])
            choices.append(r)
        return tuple(choices)

    def _envelope_info(self, choices: tuple[int, ...]) -> float:
        total = sum(float(self._mean_profile.info[d][r]) for d, r in enumerate(choices))
        if self.eos is not None:
            total += float(self._mean_profile.eos_info[len(choices)])
        return total

    # -------------------------------------------------------------------------------------- queries
    def unrank(self, i: int) -> tuple[tuple[int, ...], float]:
        """The i-th sequence of the envelope order: real tokens, EXACT log-prob, APPROXIMATE rank.

        Exact rank on prefix-independent models within ``exact_limit``. ``IndexError`` only past the
        envelope's finite support; deep ranks deepen the histograms instead.
        """
        i = check_int(i, "i", minimum=0)
        if i >= _MAX_ADDRESSABLE:
            raise InputError(f"i must be < 2**53 (float64 counts are exact below it), got {i}")
        choices, _ = self._choices(i)
        return self._walker.realise(choices)

    def slice(self, start: int, k: int) -> list[tuple[tuple[int, ...], float]]:
        """Envelope positions ``start .. start+k-1`` (shorter past the support). Approximate ranks."""
        start = check_int(start, "start", minimum=0)
        k = check_int(k, "k", minimum=1)
        out = []
        for i in range(start, start + k):
            try:
                out.append(self.unrank(i))
            except IndexError:
                break
        return out

    def top_k(self, k: int) -> list[tuple[tuple[int, ...], float]]:
        """The first ``k`` envelope positions. Exact scores, approximate order."""
        return self.slice(0, k)

    def entry(self, i: int) -> EnvelopeEntry:
        """:meth:`unrank` with the envelope score and a bracket on the item's true rank."""
        seq, log_prob = self.unrank(i)
        estimate, lo, hi = self.rank_estimate(seq)
        return EnvelopeEntry(i, seq, log_prob, -self._envelope_info(self._choices(i)[0]), estimate, lo, hi)

    def threshold(self, k: int) -> float:
        """Envelope log-prob of the k-th position (``k >= 1``). Approximate."""
        k = check_int(k, "k", minimum=1)
        return -self._envelope_info(self._choices(k - 1)[0])

    def count(self, min_log_prob: float) -> int:
        """Estimated number of sequences with ``log p >= min_log_prob`` (mean envelope). Approximate."""
        return self._count_below(-check_logprob(min_log_prob), strict=False)

    def _count_below(self, info: float, *, strict: bool) -> int:
        if self._cut >= 0 and info <= self._cut * self.resolution:
            find = bisect.bisect_left if strict else bisect.bisect_right
            return find(self._exact_info, info)
        # Each step's ceil adds half a bin on average: centre the bucket on the information.
        bucket = math.ceil(info / self.resolution + self.horizon / 2) - 1
        return int(self._mean.count_up_to(bucket))

    def rank_estimate(self, sequence: Sequence[int]) -> tuple[int, int, int]:
        """``(estimate, lo, hi)`` for the number of sequences strictly more probable than ``sequence``.

        APPROXIMATE: ``estimate`` counts under the mean envelope; ``[lo, hi]`` counts under the
        pointwise max / min information envelopes (bin rounding included), sound whenever every prefix's
        sorted row lies between them — always for prefix-independent models.
        """
        seq = self._reach.check(sequence, self.vocab_size)
        log_prob = float(self.model.score_sequences([seq], prompt=self.prompt)[0])
        if log_prob == -math.inf:
            raise InputError("sequence has zero probability under the model")
        info = -log_prob
        lo = int(self._hi.count_up_to(math.ceil(info / self.resolution) - 1))
        hi = int(self._lo.count_up_to(math.ceil(info / self.resolution) + self.horizon - 1))
        estimate = min(max(self._count_below(info, strict=True), lo), hi)
        return estimate, lo, hi

    def score_sequences(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
        """``(batch,)`` exact log p(sequence | prompt) under the model."""
        return np.asarray(self.model.score_sequences([list(s) for s in sequences], prompt=self.prompt))


class _RowWalker:
    """One session walking the prefix tree: rolls back to the common prefix, extends the rest."""

    def __init__(self, model: Any, prompt: tuple[int, ...], eos: int | None) -> None:
        self.session = model.start(list(prompt))
        self.eos = eos
        self.tokens: list[int] = []
        self.rows = [np.asarray(self.session.next_logprobs(), dtype=np.float64)]  # [depth] (vocab,)
        self._orders: dict[int, np.ndarray] = {}

    def row(self, prefix: Sequence[int]) -> np.ndarray:
        """``(vocab,)`` next-token log-probs after ``prompt + prefix``."""
        common = 0
        while common < min(len(prefix), len(self.tokens)) and prefix[common] == self.tokens[common]:
            common += 1
        if common < len(self.tokens):
            self.session.rollback(len(self.tokens) - common)
            del self.tokens[common:], self.rows[common + 1:]
            self._orders = {d: o for d, o in self._orders.items() if d <= common}
        if len(prefix) > common:
            new = list(prefix[common:])
            self.rows.extend(np.asarray(self.session.extend(new), dtype=np.float64))
            self.tokens.extend(new)
        return self.rows[len(prefix)]

    def order(self, prefix: Sequence[int]) -> np.ndarray:
        """Non-eos token ids after ``prefix``, most probable first (ties by token id)."""
        row = self.row(prefix)
        depth = len(prefix)
        if depth not in self._orders:
            order = np.argsort(-row, kind="stable")
            self._orders[depth] = order if self.eos is None else order[order != self.eos]
        return self._orders[depth]

    def realise(self, choices: tuple[int, ...]) -> tuple[tuple[int, ...], float]:
        """Map a rank tuple to real tokens (and eos) and their exact summed log-prob."""
        tokens: list[int] = []
        total = 0.0
        for r in choices:
            token = int(self.order(tokens)[r])
            total += float(self.row(tokens)[token])
            tokens.append(token)
        if self.eos is not None:
            total += float(self.row(tokens)[self.eos])
            tokens.append(self.eos)
        return tuple(tokens), total


def _sample_profiles(walker: _RowWalker, horizon: int, eos: int | None, n_paths: int, exploration: float,
                     rng: np.random.Generator) -> tuple[_Profile, _Profile, _Profile]:
    """Mean / pointwise-min / pointwise-max sorted information per depth over sampled paths.

    Model paths sample the next non-eos token from the model; exploration paths uniformly (separate
    generator streams). The mean envelope is ``-log`` of the mean sorted probability row (a proper
    distribution); where all rows agree it equals them exactly.
    """
    model_rng, explore_rng = rng.spawn(2)
    n_explore = int(round(exploration * n_paths))
    sorted_rows: list[list[np.ndarray]] = [[] for _ in range(horizon)]  # [depth][path] (n_choices,)
    eos_infos: list[list[float]] = [[] for _ in range(horizon)]
    for path in range(n_paths):
        prefix: list[int] = []
        for d in range(horizon):
            row = walker.row(prefix)
            info = -row
            if eos is not None:
                eos_infos[d].append(float(info[eos]))
                info = np.delete(info, eos)
            sorted_rows[d].append(np.sort(info))
            if d == horizon - 1:
                break
            allowed = np.isfinite(row)
            if eos is not None:
                allowed[eos] = False
            if not allowed.any():
                break  # nothing can follow (eos is certain): deeper depths keep fewer samples
            if path < n_explore:
                token = int(explore_rng.choice(np.flatnonzero(allowed)))
            else:
                probs = np.where(allowed, np.exp(row), 0.0)
                token = int(model_rng.choice(len(row), p=probs / probs.sum()))
            prefix.append(token)
    profiles = []
    for reducer in ("mean", "min", "max"):
        info, eos_info = [], []
        for d in range(horizon):
            rows = np.stack(sorted_rows[d]) if sorted_rows[d] else None
            if rows is None:  # unreachable depth: reuse the deepest sampled one
                info.append(info[-1])
                eos_info.append(eos_info[-1] if eos_info else math.inf)
                continue
            info.append(_reduce(rows, reducer))
            if eos is not None:
                eos_info.append(float(_reduce(np.asarray(eos_infos[d])[:, None], reducer)[0]))
        profiles.append(_Profile(info, None if eos is None else np.asarray(eos_info)))
    return profiles[0], profiles[1], profiles[2]


def _reduce(rows: np.ndarray, how: str) -> np.ndarray:
    """Reduce ``(paths, n)`` sorted information rows to one ``(n,)`` envelope."""
    lo, hi = rows.min(axis=0), rows.max(axis=0)
    if how == "min" or np.array_equal(lo, hi):
        return lo
    if how == "max":
        return hi
    with np.errstate(divide="ignore"):
        return -np.log(np.mean(np.exp(-rows), axis=0))
