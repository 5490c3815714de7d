"""A continuation's rank among all continuations of its length or of a format, and its exposure.

Exposure (Carlini et al. 2019, "The Secret Sharer", Sec. 4): ``log2 |space| - log2(rank + 1)`` bits —
how much more likely the model makes this continuation than a uniformly random member of the space. The
space is every continuation of the same token length (``V^L``), or, with a ``constraint``, the format's
language (``Regex(r" \\d{4}-\\d{4}")``: |space| is its number of strings). Unconstrained, the rank is
exact (the exact index) when it is shallow enough to count, and otherwise estimated by the sampled envelope
with a bracket. Constrained, ``method="auto"`` gives the exact rank while the index it needs fits a small
forward budget, and beyond that an importance-sampled estimate with a 95% interval
(:mod:`.estimate`) beside a certified bracket: the stored members above it, plus at
most (unexplored mass) / p(canary) unseen ones. The report says which (``method``).

Example:
    >>> from speculum.models import MarkovModel
    >>> report = estimate_rank(MarkovModel.random(5, seed=0), [1, 2, 3], prompt=[0])
    >>> report.method, report.rank_lo == report.rank == report.rank_hi, report.exposure_bits > 0
    ('exact', True, True)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ...models.base import as_model, check_prompt, check_token_ids
from ...validation import InputError, check_int, check_number
from .envelope import DEFAULT_RESOLUTION, AREnvelopeIndex
from .estimate import rank_from_sample
from ..enumerable import AutoregressiveEnumerable
from .sampling import DEFAULT_SAMPLES, check_strata, sample_format
from ..index.support import Support

__all__ = ["RankReport", "estimate_rank", "estimate_ranks", "DEFAULT_EXACT_RANK_LIMIT", "DEFAULT_MAX_FORWARDS",
           "DEFAULT_AUTO_FORWARDS", "METHODS"]

DEFAULT_EXACT_RANK_LIMIT = 1_000  # count exactly when the envelope says the rank is at most this
DEFAULT_MAX_FORWARDS = 200_000    # constrained, method="exact": most prefixes an exact rank may forward
# Constrained, method="auto" / "sampled": the exact index gives up (and the bracket stops) after about this
# many forwarded prefixes (a deepening step may pass it: each at most about doubles the forwards). A canary
# the index cannot certify then costs the attempt a fraction of what its draws cost, and shallow canaries,
# whose members above are few, are still certified.
DEFAULT_AUTO_FORWARDS = 384
METHODS = ("auto", "exact", "sampled")


@dataclass(frozen=True)
class RankReport:
    """Rank of a continuation among the ``vocab_size ** length`` continuations of its length, or among the
    members of a format (``space_size``).

    ``method`` is ``"exact"`` (``rank_lo == rank == rank_hi``; ties count lexicographically smaller
    sequences as before it), ``"envelope"`` (approximate: ``rank`` estimated, ``[rank_lo, rank_hi]``
    sound when every prefix's sorted next-token row lies within the sampled envelopes), ``"bracket"``
    (constrained, certified: ``rank_lo <= true rank <= rank_hi``, ``rank`` their geometric middle) or
    ``"sampled"`` (constrained, estimated: ``estimate`` is the importance-sampled rank from ``samples``
    draws, ``rank`` it rounded into the bracket, ``[ci_lo, ci_hi]`` its 95% interval within the certified
    bracket ``[rank_lo, rank_hi]``).

    ``[ci_lo, ci_hi]``: the rank itself when exact, the certified bracket for ``"bracket"`` (it holds the
    rank with certainty), the 95% interval for ``"sampled"``, None for ``"envelope"``.
    """

    rank: int  # number of continuations strictly more probable
    rank_lo: int
    rank_hi: int
    method: str
    log_prob: float  # exact log p(continuation | prompt), nats
    length: int
    vocab_size: int
    space_size: float | None = None   # size of the ranked space (None: vocab_size ** length); inf allowed
    item: Any = None                  # what was ranked (token ids, or text in string mode)
    ci_lo: float | None = None        # 95% interval on the rank (see the class doc)
    ci_hi: float | None = None
    samples: int = 0                  # draws behind a sampled estimate (0: none)
    estimate: float | None = None     # the unbiased sampled rank, before rounding (method "sampled")
    standard_error: float | None = None

    @property
    def space_bits(self) -> float:
        """``log2 |space|``."""
        if self.space_size is None:
            return self.length * math.log2(self.vocab_size)
        return math.inf if self.space_size == math.inf else math.log2(self.space_size)

    def _exposure(self, rank: float) -> float:
        return self.space_bits - math.log2(rank + 1)

    @property
    def exposure_bits(self) -> float:
        """``log2 |space| - log2(rank + 1)`` (Carlini et al., "The Secret Sharer"); from the unrounded
        ``estimate`` when the rank is sampled."""
        return self._exposure(self.rank if self.estimate is None else self.estimate)

    @property
    def exposure_interval(self) -> tuple[float, float] | None:
        """``(low, high)`` exposure from ``[ci_lo, ci_hi]`` (95%, or certain: see the class doc); None
        without an interval."""
        if self.ci_lo is None or self.ci_hi is None:
            return None
        return self._exposure(self.ci_hi), self._exposure(self.ci_lo)

    @property
    def exposure_bracket(self) -> tuple[float, float]:
        """``(low, high)`` exposure from the rank bracket's ends."""
        return self._exposure(self.rank_hi), self._exposure(self.rank_lo)


def estimate_rank(model: Any, continuation: Sequence[int] | str, *, prompt: Sequence[int] = (),
                  exact_limit: int = DEFAULT_EXACT_RANK_LIMIT, n_paths: int = 16, seed: int | np.random.Generator = 0,
                  resolution: float = DEFAULT_RESOLUTION, constraint: Any = None, method: str = "auto",
                  **constrained: Any) -> RankReport:
    """Rank and exposure of ``continuation`` after ``prompt``, exact when cheap, else enveloped.

    The exact index is used when the whole space (every continuation of the same length) or the
    envelope's upper bracket is at most ``exact_limit`` (or always, with ``method="exact"``); otherwise the
    envelope's estimate and bracket are reported (APPROXIMATE). With a ``constraint`` (``Regex`` /
    ``Choices``) the space is the format's language: see :func:`estimate_ranks` (``method``, ``strings``,
    ``eos``, ``max_len``, ``max_forwards``, ``samples``, ``seed``, ``sample`` go there).
    """
    method = _check_method(method)
    if constraint is not None:
        return estimate_ranks(model, [continuation], constraint=constraint, prompt=prompt, method=method, seed=seed,
                              **constrained)[0]
    if constrained:
        raise InputError(f"{', '.join(sorted(constrained))} only apply with a constraint")
    if method == "sampled":
        raise InputError("method='sampled' samples the members of a format: give a constraint (Regex or Choices)")
    model = as_model(model, name="model")
    exact_limit = check_int(exact_limit, "exact_limit", minimum=0)
    seq = check_token_ids(continuation, model.vocab_size, name="continuation")
    if not seq:
        raise InputError("continuation is empty")
    prompt = check_prompt(model, prompt, name="prompt")
    length, vocab_size = len(seq), int(model.vocab_size)
    log_prob = float(model.score_sequences([seq], prompt=prompt)[0])
    if log_prob == -math.inf:
        raise InputError("continuation has zero probability under the model")
    if method == "auto" and Support(max_len=length).size(vocab_size) > exact_limit:
        envelope = AREnvelopeIndex(model, max_len=length, prompt=prompt, n_paths=n_paths, seed=seed,
                                   resolution=resolution, exact_limit=0)
        estimate, lo, hi = envelope.rank_estimate(seq)
        if hi > exact_limit:
            return RankReport(estimate, lo, hi, "envelope", log_prob, length, vocab_size)

    rank = AutoregressiveEnumerable(model, max_len=length, prompt=prompt).rank(seq)
    return RankReport(rank, rank, rank, "exact", log_prob, length, vocab_size, ci_lo=rank, ci_hi=rank)


def estimate_ranks(model: Any, items: Sequence[Any], *, constraint: Any, prompt: Sequence[int] = (),
                   strings: bool = False, eos: int | bool | None = None, max_len: int | None = None,
                   method: str = "auto", max_forwards: int | None = None, samples: int | None = None,
                   seed: int | np.random.Generator = 0, sample: Any = None,
                   strata: Any = None, uniform_share: float | None = None, index: Any = None,
                   target_bits: float | None = None, max_samples: int | None = None,
                   progress: Callable[[Any], None] | None = None, **index_options: Any) -> list[RankReport]:
    """Rank and exposure of each of ``items`` within the language of ``constraint``, all on one shared index
    and, when sampled, one shared set of draws.

    ``items`` are token-id sequences (token mode) or texts (``strings=True``: ranked over all their
    tokenizations; a text is also accepted in token mode and then means its canonical tokenization only if
    given as ids, so pass ids there). Exposure uses ``log2`` of the language's number of strings (string
    mode) or token sequences (token mode). ``method``:
    * ``"auto"`` (default): EXACT when the index certifies down to the item within ``max_forwards`` forwarded
      prefixes (default :data:`DEFAULT_AUTO_FORWARDS`), else ESTIMATED (``"sampled"``): the importance-sampled
      rank with a 95% interval from ``samples`` draws (default 4,096), beside the CERTIFIED bracket of that
      index. ``max_forwards`` given without ``samples`` or ``sample`` asks for the exact answer within that
      budget: auto then answers as ``"exact"`` does.
    * ``"exact"``: EXACT within ``max_forwards`` (default :data:`DEFAULT_MAX_FORWARDS`), else the CERTIFIED
      bracket alone (``"bracket"``).
    * ``"sampled"``: always the sampled estimate, beside the bracket of an index grown to ``max_forwards``
      (default :data:`DEFAULT_AUTO_FORWARDS`).

    The draws are made once, on the first item that needs them (``seed``: an int or a
    ``numpy.random.Generator``; ``strata``, ``uniform_share``: see
    :func:`~.sampling.sample_format`), or taken from
    ``sample`` (a :class:`~.sampling.FormatSample` of the same format, prompt and mode):
    each further item costs the scoring of its own tokens. ``progress`` receives the sampler's
    :class:`~.sampling.SampleProgress` events.

    ``target_bits``: grow the set (more draws of the same strata, merged: ``FormatSample.merged``) until
    every sampled item's 95% exposure interval is at most ``target_bits`` wide on each side, or the set
    holds ``max_samples`` draws (default: 8 x ``samples``). The half-width falls as ``1 / sqrt(draws)``,
    so each round draws what the widest interval asks for, plus a tenth. The estimate stays unbiased for
    each fixed set size; the data-dependent stopping is that of any sequential Monte Carlo.

    Example:
        >>> from speculum.models import MarkovModel
        >>> from speculum.enumeration import Regex
        >>> vocab = ["7", "8", "77", "x", "y", "xy"]
        >>> [report] = estimate_ranks(MarkovModel.random(6, seed=0), ["787"], strings=True, prompt=[3],
        ...                           constraint=Regex("[78]{3}", vocabulary=vocab))
        >>> report.method, report.space_size, 0 <= report.rank < 8
        ('exact', 8, True)
        >>> [deep] = estimate_ranks(MarkovModel.random(6, seed=0), ["787"], strings=True, prompt=[3],
        ...                         constraint=Regex("[78]{3}", vocabulary=vocab), method="sampled", seed=1)
        >>> deep.method, deep.ci_lo <= deep.estimate <= deep.ci_hi, deep.samples
        ('sampled', True, 4096)
    """

    method, max_forwards, samples, strata, target_bits, max_samples = _checked_options(
        method, max_forwards, samples, sample, strata, uniform_share, target_bits, max_samples)
    if index is None:
        index = AutoregressiveEnumerable(model, prompt=prompt, constraint=constraint, strings=strings, eos=eos,
                                         max_len=max_len, **index_options)
    seek = index.seek_index()
    if sample is not None and not sample.matches(seek.support, seek.prompt, strings):
        raise InputError("the sample was drawn from another format, prompt or mode than the one ranked")
    size = index.size() if strings else seek.support.size(seek.vocab_size)
    size = math.inf if size is None else size
    drawn = [sample]

    def draws() -> Any:
        if drawn[0] is None:
            drawn[0] = sample_format(model, constraint, samples=samples, seed=seed, strings=strings,
                                     strata=strata, index=index, progress=progress)
        return drawn[0]

    def rank(item: Any) -> RankReport:
        return _rank_one(index, seek, item, strings=strings, size=size, max_forwards=max_forwards, method=method,
                         draws=draws)

    reports = [rank(item) for item in items]
    if target_bits is not None:
        reports = _grow_draws(reports, items, rank, drawn, target_bits=target_bits, max_samples=max_samples,
                              model=model, constraint=constraint, seed=seed, strings=strings, index=index,
                              progress=progress)
    return reports


def _checked_options(method: Any, max_forwards: Any, samples: Any, sample: Any, strata: Any, uniform_share: Any,
                     target_bits: Any, max_samples: Any) -> tuple:
    """:func:`estimate_ranks`'s options checked, with their defaults: ``(method, max_forwards, samples,
    strata, target_bits, max_samples)``."""
    method = _check_method(method)
    if method == "exact" and (samples is not None or sample is not None):
        raise InputError("samples and sample go with method='auto' or 'sampled' (method='exact' never samples)")
    if method == "auto" and max_forwards is not None and samples is None and sample is None:
        method = "exact"
    default_budget = DEFAULT_MAX_FORWARDS if method == "exact" else DEFAULT_AUTO_FORWARDS
    max_forwards = check_int(default_budget if max_forwards is None else max_forwards, "max_forwards", minimum=0)
    samples = check_int(DEFAULT_SAMPLES if samples is None else samples, "samples", minimum=2)
    strata = check_strata(strata, uniform_share)
    if target_bits is not None:
        target_bits = check_number(target_bits, "target_bits", above=0.0)
    max_samples = check_int(8 * samples if max_samples is None else max_samples, "max_samples", minimum=samples)
    return method, max_forwards, samples, strata, target_bits, max_samples


def _grow_draws(reports: list[RankReport], items: Sequence[Any], rank: Callable[[Any], RankReport],
                drawn: list, *, target_bits: float, max_samples: int, model: Any, constraint: Any,
                seed: int | np.random.Generator, strings: bool, index: Any,
                progress: Callable[[Any], None] | None) -> list[RankReport]:
    """:func:`estimate_ranks`'s growth rounds (``target_bits``): more draws merged into the shared set
    ``drawn[0]`` and the sampled items ranked again, until every sampled item's interval is narrow enough or
    the set holds ``max_samples`` draws."""
    rounds = 0
    while True:
        wide = [i for i, r in enumerate(reports) if r.method == "sampled" and _half_width(r) > target_bits]
        if not wide or len(drawn[0]) >= max_samples:
            return reports
        have = len(drawn[0])
        wanted = max(math.ceil(have * 1.1 * (_half_width(reports[i]) / target_bits) ** 2) for i in wide)
        rounds += 1
        more = min(max(wanted, have + 64), max_samples) - have
        # The set's own composition, so that the rounds merge with a set passed in as well.
        same = tuple(zip(drawn[0].tilts, np.array(drawn[0].stratum_sizes) / have))
        drawn[0] = drawn[0].merged(sample_format(model, constraint, samples=more, seed=_round_seed(seed, rounds),
                                                 strings=strings, strata=same, index=index, progress=progress))
        reports = [rank(item) if r.method == "sampled" else r for item, r in zip(items, reports)]


def _half_width(report: RankReport) -> float:
    low, high = report.exposure_interval
    return (high - low) / 2


def _round_seed(seed: int | np.random.Generator, rounds: int) -> np.random.Generator:
    """An independent stream for the draws of growth round ``rounds``."""
    if isinstance(seed, np.random.Generator):
        return seed.spawn(1)[0]
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1 << 20, rounds)))


def _check_method(method: Any) -> str:
    if method not in METHODS:
        raise InputError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
    return method


def _rank_one(index, seek, item, *, strings: bool, size, max_forwards: int, method: str,
              draws: Callable[[], Any]) -> RankReport:
    if strings:
        if not isinstance(item, str):
            raise InputError(f"in string mode an item is text, got {type(item).__name__}")
        log_prob = index.queries.log_prob(item)
        length = len(index.queries.tokenizations(item)[0])
        budget = log_prob - index.queries.log_max_tokenizations
    else:
        if isinstance(item, str):
            raise InputError("in token mode an item is a sequence of token ids (encode the text first, or pass "
                             "strings=True to rank the text over all its tokenizations)")
        item = seek.support.check(item, seek.vocab_size, name="item")
        log_prob = float(seek.score_sequences([item])[0])
        length, budget = len(item), log_prob
    if log_prob == -math.inf:
        raise InputError("the item has zero probability under the model")
    budget -= 1e-6 * (1.0 + abs(budget))
    # Deepen in steps that at most about double the forwards (and are predicted to stay within the forward
    # budget), until the item's budget is certified or the forward budget is spent.
    while seek.certified_logprob > budget and not seek.tree.exhausted and seek.forwards < max_forwards:
        built = -seek.tree.budget / math.log(2.0) if math.isfinite(seek.tree.budget) else 0.0
        if method != "exact" and built > 0 and seek.forwards_to(-budget / math.log(2.0), built) > max_forwards:
            break        # predicted past the budget: a hopeless attempt gives up at once (auto and sampled only)
        step = seek.work_step_bits(max(built, 1.0), limit=max_forwards)
        target = max(budget, -(built + step) * math.log(2.0))
        seek.extend_to(target)
    common = dict(log_prob=log_prob, length=length, vocab_size=seek.vocab_size, space_size=size, item=item)
    if seek.certified_logprob <= budget or seek.tree.exhausted:
        rank = index.rank(item)
        if method != "sampled":
            return RankReport(rank, rank, rank, "exact", ci_lo=rank, ci_hi=rank, **common)
        lo = hi = rank
    else:
        lo, hi = _rank_bracket(index, seek, item, log_prob, strings=strings)
        hi = min(hi, size - 1) if size != math.inf else hi
    if method == "exact":
        middle = int(round(math.sqrt((lo + 1) * (hi + 1)))) - 1
        return RankReport(min(max(middle, lo), hi), lo, hi, "bracket", ci_lo=lo, ci_hi=hi, **common)
    # The true rank lies in the certified bracket: clamping the estimate and its interval into it only
    # brings them closer to it.
    guess = rank_from_sample(draws(), item, log_prob)
    floor = min(max(lo, guess.seen_before), hi)       # the distinct members drawn before it are surely before
    estimate = min(max(guess.rank, floor), hi)
    ci_lo, ci_hi = min(max(guess.ci_lo, floor), hi), max(min(guess.ci_hi, hi), floor)
    return RankReport(min(max(int(round(estimate)), lo), hi), lo, hi, "sampled", ci_lo=ci_lo, ci_hi=ci_hi,
                      samples=guess.samples, estimate=estimate, standard_error=guess.standard_error, **common)


def _rank_bracket(index, seek, item, log_prob: float, *, strings: bool) -> tuple[int, int]:
    """Certified ``(lo, hi)`` on the rank from what the index stores, with no forward: members surely above
    (stored leaves, or strings whose stored tokenizations alone outweigh the item) and at most
    ``(mass not yet accounted) / p(item)`` more, since each member above has probability ``>= p(item)``."""
    tree = seek.tree
    leaves = [(depth, np.flatnonzero(level.leaf)) for depth, level in enumerate(tree.levels)]
    unseen = tree.unseen_mass()
    p_item = math.exp(log_prob)
    if not strings:
        found = seek.find(tuple(item))
        if found is not None:
            # The item's own leaf is left out by identity, not by its log-prob: the stored one (next-token
            # rows) and the scored one (teacher forcing) differ by float rounding (2e-5 nats on a float32
            # SmolLM2), which would count the item above itself. The others are compared with its stored
            # log-prob, computed as theirs are.
            node, log_prob = found
            p_item = min(p_item, math.exp(log_prob))     # the smaller of the two: a looser upper end
            depth = len(item)
            leaves = [(d, ids[ids != node] if d == depth else ids) for d, ids in leaves]
        else:
            unseen -= p_item                # its own mass is among the unseen
        lps = np.concatenate([tree.levels[d].logprob[ids] for d, ids in leaves])
        above = int(np.count_nonzero(lps > log_prob))
        maybe = int(np.count_nonzero(lps >= log_prob))
        return above, max(above, maybe + max(0, math.floor(unseen / p_item * (1.0 + 1e-9))))
    known: dict[bytes, float] = {}
    pieces = seek.support.constraint.token_bytes
    eos = seek.support.eos
    for depth, ids in leaves:
        if not len(ids):
            continue
        level = tree.levels[depth]
        tokens = np.zeros((len(ids), depth), dtype=np.int64)
        node = ids
        for d in range(depth, 0, -1):
            tokens[:, d - 1] = tree.levels[d].token[node]
            node = tree.levels[d].parent[node]
        for row, lp in zip(tokens.tolist(), level.logprob[ids].tolist()):
            text = b"".join(pieces[t] for t in row if t != eos)
            known[text] = known.get(text, 0.0) + math.exp(lp)
    key = item.encode("utf-8")
    surely = [mass for text, mass in known.items() if text != key and mass > p_item * (1.0 + 1e-9)]
    stored = math.fsum(known.values())
    # Every member above the item, beside those surely above, has probability >= p(item); together with the
    # item they hold at most the language's mass less what the sure ones hold.
    spare = stored + unseen - math.fsum(surely) - p_item
    return len(surely), len(surely) + max(0, math.floor(spare / p_item * (1.0 + 1e-9)))
