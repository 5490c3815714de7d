"""Members of a format drawn from a known law, each with the model's probability and the law's.

The sampled rank estimate (:mod:`.estimate`) needs draws ``x`` from a proposal law
``q`` over the format's members together with ``q(x)`` and the model's own ``p(x)``. Several laws share the
draws, in fixed numbers (stratified, so that their mixture is the balance law of multiple importance
sampling: Veach & Guibas 1995; Owen & Zhou 2000, "Safe and effective importance sampling"). Each is the
model *tilted* by an exponent ``beta`` in [0, 1] and restricted to the format: at each step the tokens that
can still complete a member are kept and drawn with probability ``p(t | prefix) ** beta``, renormalised, so

    q_beta(x) = prod_t p(x_t | x_<t) ** beta / Z_beta(x_<t),     Z_beta(prefix) = sum_viable p(t | prefix) ** beta

* ``beta = 1``, the **model** stratum, samples the model restricted to the format and finds the probable
  members above a shallow canary;
* ``beta = 0``, the **uniform** stratum, draws one of the viable tokens uniformly (uniform over the members
  of a format whose members have one spelling each, like ``" \\d{9}"``) and bounds every weight
  ``1 / q(x)``, which keeps the estimate of a deep rank (a random canary) precise;
* ``0 < beta < 1``, **tilted** strata, aim between: the members above a canary of moderate exposure are too
  rare for uniform draws and too improbable for the model's. Tilting a law by ``p ** beta`` moves its
  typical log-probability from the format's typical member (``beta = 0``) to the model's (``beta = 1``),
  as exponential tilting does for the rare events of importance sampling (Siegmund 1976; Bucklew,
  "Introduction to Rare Event Simulation", 2004).

Each draw records ``log q(x) = log(sum_k n_k q_k(x) / n)``: the law of a draw picked at random from the
set, every stratum's law evaluated on the rows its path already forwarded.

Draws advance as a trie: at each depth the distinct live prefixes are forwarded once and the draws at a
prefix branch from its row, so hundreds of draws share a forward (and the prompt). A model that keeps
levels of keys and values (``Capabilities.prefix_levels``: the PyTorch backend) forwards each prefix as
one token on its parent's cache, the draws walked in groups as large as a level may be; any other model
answers batched ``next_logprobs`` calls of whole prefixes. In string mode each sampled string's laws are
summed over every tokenization of it (:meth:`~speculum.enumeration.index.strings.StringIndex.tokenizations`):
``Q(s) = sum_{x -> s} q(x)`` and ``P(s) = sum_{x -> s} p(x)``, exact, the tokenizations not drawn
forwarded once each.

Guarantee: EXACT laws. ``proposal_logprob`` is the exact log-probability that a draw of the set is that
item (up to float rounding of the model's rows), and ``target_logprob`` the model's exact (unrenormalised)
log-probability of it.

Example:
    >>> from speculum.models import MarkovModel
    >>> from speculum.enumeration import Regex
    >>> sample = sample_format(MarkovModel.random(4, seed=0), Regex("[ab]{3}", vocabulary=["a", "b", "c", "d"]),
    ...                        prompt=[2], samples=64, seed=1)
    >>> len(sample), sample.tilts, sample.stratum_sizes, bool((sample.proposal_logprob <= 0).all())
    (64, (1.0, 0.0), (45, 19), True)
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ...models.base import as_model, check_prompt
from ...validation import InputError, check_int, check_number
from ..formats.constraint import compile_for
from ..enumerable import AutoregressiveEnumerable
from .format_walk import FormatWalk, laws_at, mixture_logprob, path_logprobs, step_partitions
from .siblings import SiblingRecorder, Siblings

__all__ = ["FormatSample", "SampleProgress", "sample_format", "check_strata", "DEFAULT_SAMPLES", "DEFAULT_STRATA",
           "DEFAULT_SAMPLE_BATCH"]

DEFAULT_SAMPLES = 4096
# (tilt, share) of each stratum. The model's draws find the members above a canary of some exposure, the
# canaries an audit is about, whose variance they carry; the uniform ones bound a deep rank's weights (the
# relative variance of a rank R in a space of N members is at most about N / (R * uniform share)). Tilted
# strata between them measured no better on SmolLM2 (benchmarks/RESULTS.md).
DEFAULT_STRATA = ((1.0, 0.7), (0.0, 0.3))
DEFAULT_SAMPLE_BATCH = 256          # prefixes per next_logprobs call: (batch, vocab) float64 rows
_DRAW_CELLS = 1 << 22               # draws x allowed tokens held at once when inverting a CDF


@dataclass(frozen=True)
class SampleProgress:
    """One depth of the sampling walk, reported to the ``progress`` callback."""

    depth: int          # tokens drawn so far
    live: int           # draws still growing
    forwards: int       # prefixes forwarded so far


@dataclass(frozen=True, eq=False)
class FormatSample:
    """Draws from a format with their laws (see the module doc). One row per draw; duplicates are kept.

    ``items``: token-id tuples (token mode) or texts (string mode). ``target_logprob``: the model's exact
    log-probability of each item (string mode: over all its tokenizations). ``proposal_logprob``: the log
    of the mixture law the draws came from. ``tilts``: each stratum's exponent, largest first.
    ``stratum_logprob``: ``(n, strata)``, each stratum's own law at every draw. ``stratum``: the index in
    ``tilts`` of the stratum each draw came from. ``forwards``: prefixes forwarded to draw the set.
    ``siblings``: each draw's members one last token away (:mod:`.siblings`; token
    mode, final steps), or None.
    """

    items: tuple
    target_logprob: np.ndarray
    proposal_logprob: np.ndarray
    stratum_logprob: np.ndarray
    stratum: np.ndarray
    tilts: tuple
    strings: bool
    support: Any
    prompt: tuple
    forwards: int
    seconds: float = 0.0
    siblings: Any = None

    def __len__(self) -> int:
        return len(self.items)

    @property
    def stratum_sizes(self) -> tuple[int, ...]:
        """Draws of each stratum, in the order of ``tilts``."""
        return tuple(int(c) for c in np.bincount(self.stratum, minlength=len(self.tilts)))

    def law(self, tilt: float) -> np.ndarray:
        """``(n,)``: the law of the stratum of this ``tilt`` at every draw."""
        if float(tilt) not in self.tilts:
            raise InputError(f"the set has no stratum of tilt {tilt} (its tilts: {list(self.tilts)})")
        return self.stratum_logprob[:, self.tilts.index(float(tilt))]

    @property
    def model_logprob(self) -> np.ndarray:
        """The model stratum's law (tilt 1) at every draw."""
        return self.law(1.0)

    @property
    def uniform_logprob(self) -> np.ndarray:
        """The uniform stratum's law (tilt 0) at every draw."""
        return self.law(0.0)

    def matches(self, support: Any, prompt: Sequence[int], strings: bool) -> bool:
        """Whether the set was drawn from this support after this prompt, in this mode."""
        return self.support == support and self.prompt == tuple(prompt) and self.strings == bool(strings)

    def merged(self, other: "FormatSample") -> "FormatSample":
        """One set holding the draws of both (of the same format, prompt, mode and tilts, drawn with
        independent seeds): each stratum's draws pooled, each draw's law the balance mixture over the pooled
        counts. Exact laws; what a larger set drawn at once would estimate, so a set can grow until an
        interval is narrow enough.

        Example:
            >>> from speculum.models import MarkovModel
            >>> from speculum.enumeration import Regex
            >>> model, ab = MarkovModel.random(3, seed=0), Regex("[ab]{4}", vocabulary=["a", "b", "c"])
            >>> first = sample_format(model, ab, prompt=[2], samples=8, seed=0)
            >>> both = first.merged(sample_format(model, ab, prompt=[2], samples=12, seed=1))
            >>> len(both), both.stratum_sizes
            (20, (14, 6))
        """
        if not isinstance(other, FormatSample) or not other.matches(self.support, self.prompt, self.strings):
            raise InputError("only a set drawn from the same format, prompt and mode can be merged")
        if other.tilts != self.tilts:
            raise InputError(f"only sets of the same strata can be merged: tilts {list(self.tilts)} and "
                             f"{list(other.tilts)}")
        stratum = np.concatenate([self.stratum, other.stratum])
        laws = np.concatenate([self.stratum_logprob, other.stratum_logprob])
        counts = np.bincount(stratum, minlength=len(self.tilts))
        siblings = None
        if self.siblings is not None or other.siblings is not None:
            mine, theirs = (s.siblings if s.siblings is not None else Siblings.none(len(s), len(s.tilts))
                            for s in (self, other))
            siblings = mine.concatenated(theirs)
        return FormatSample(items=self.items + other.items,
                            target_logprob=np.concatenate([self.target_logprob, other.target_logprob]),
                            proposal_logprob=mixture_logprob(laws, counts), stratum_logprob=laws, stratum=stratum,
                            tilts=self.tilts, strings=self.strings, support=self.support, prompt=self.prompt,
                            forwards=self.forwards + other.forwards, seconds=self.seconds + other.seconds,
                            siblings=siblings)


# ------------------------------------------------------------------------------------------- drawing
def _draw_tokens(walk: FormatWalk, counts: Sequence[int], tilts: Sequence[float],
                 streams: Sequence[np.random.Generator], progress: Callable[[SampleProgress], None] | None,
                 siblings: SiblingRecorder | None):
    """Token sequences of the strata (``counts[s]`` draws of tilt ``tilts[s]``, coins from ``streams[s]``),
    each with its target log-prob and ``(n, strata)`` laws; final steps recorded into ``siblings``."""
    n = int(sum(counts))
    horizon = walk.max_len if walk.max_len is not None else walk.automaton.longest_path() + (
        1 if walk.eos is not None else 0)
    horizon = max(horizon, 1)
    stratum = np.repeat(np.arange(len(counts), dtype=np.int8), counts)
    # One uniform number per draw and depth from its stratum's stream, drawn up front: the draws do not
    # depend on how they are grouped or batched.
    coins = np.empty((n, horizon))
    for s, stream in enumerate(streams):
        coins[stratum == s] = stream.random((int(counts[s]), horizon))
    drawn = _Drawn(tokens=np.full((n, horizon), -1, dtype=np.int64), target=np.zeros(n),
                   laws=np.zeros((n, len(tilts))), stratum=stratum, coins=coins,
                   states=np.zeros(n, dtype=np.int64), node=np.zeros(n, dtype=np.int64),
                   place=np.zeros(n, dtype=np.int64))
    group = walk.group_size(n, horizon)
    live = n
    for lo in range(0, n, group):
        for depth, finished in _draw_group(walk, np.arange(lo, min(n, lo + group)), drawn, tilts, siblings):
            live -= finished
            if progress is not None:
                progress(SampleProgress(depth=depth, live=live, forwards=walk.forwards))
    tokens = drawn.tokens
    lengths = (tokens >= 0).sum(axis=1)
    sequences = tuple(tuple(row[:length]) for row, length in zip(tokens.tolist(), lengths.tolist()))
    return sequences, stratum, drawn.target, drawn.laws


@dataclass
class _Drawn:
    """The draws being made: ``tokens`` ``(n, horizon)`` (-1 past the end), target log-probs ``(n,)``,
    laws ``(n, strata)``, strata ``(n,)``, coins ``(n, horizon)``, and per draw while it grows: its
    automaton state, its prefix's key at this depth (``node``) and its prefix's index in the last level
    (``place``)."""

    tokens: np.ndarray
    target: np.ndarray
    laws: np.ndarray
    stratum: np.ndarray
    coins: np.ndarray
    states: np.ndarray
    node: np.ndarray
    place: np.ndarray


def _draw_group(walk: FormatWalk, members: np.ndarray, drawn: _Drawn, tilts: Sequence[float],
                siblings: SiblingRecorder | None):
    """Advance the draws ``members`` to completion as a trie, one depth at a time: each depth's distinct
    prefixes forwarded once (on the last depth's keys and values where the model keeps levels). Yields
    ``(depth, draws completed at it)``."""
    tokens, horizon = drawn.tokens, drawn.tokens.shape[1]
    states, node, place = drawn.states, drawn.node, drawn.place
    active = members
    level = walk.start_level()
    for depth in range(horizon):
        if not len(active):
            return
        _, first, node_of = np.unique(node[active], return_index=True, return_inverse=True)
        representative = active[first]
        if depth:
            parents, last = place[representative], tokens[representative, depth - 1]
        else:
            parents, last = np.zeros(1, dtype=np.int64), np.array([walk.prompt[-1]])
        node_state = states[representative]
        chosen = np.empty(len(active), dtype=np.int64)
        level, chunks = walk.level_rows(level, parents, last, tokens[representative, :depth])
        for start, rows in chunks:
            chunk = np.arange(start, start + len(rows))
            for state in np.unique(node_state[chunk]):
                nodes = chunk[node_state[chunk] == state]
                allowed, targets = walk.viable(int(state), depth)
                if not len(allowed):
                    raise InputError("a prefix of the format has no viable continuation (an inconsistent automaton)")
                step_target = np.minimum(rows[nodes - start][:, allowed], 0.0)
                log_z, dead = step_partitions(step_target, tilts)
                draws = np.flatnonzero(np.isin(node_of, nodes))
                local = np.searchsorted(nodes, node_of[draws])
                who = active[draws]
                pick = _invert(step_target, log_z, dead, local, drawn.coins[who, depth], drawn.stratum[who], tilts)
                if siblings is not None and walk.complete(allowed, targets).all():
                    # Every stratum's law of every viable token: (nodes, k, strata).
                    every = laws_at(step_target, log_z[:, None], dead[:, None], tilts, len(allowed))
                    siblings.record(who, allowed, drawn.target[who, None] + step_target[local], drawn.laws[who],
                                    every[local], drawn.stratum[who])
                chosen[draws] = allowed[pick]
                taken = step_target[local, pick]
                drawn.target[who] += taken
                drawn.laws[who] += laws_at(taken, log_z[local], dead[local], tilts, len(allowed))
                states[who] = targets[pick]
        tokens[active, depth] = chosen
        done = walk.complete(chosen, states[active])
        place[active] = node_of
        node[active] = node_of * (walk.model.vocab_size + 1) + chosen
        active = active[~done]
        yield depth + 1, int(np.count_nonzero(done))
    if len(active):
        raise InputError("a draw passed the format's longest member without completing it")


def _invert(step_target: np.ndarray, log_z: np.ndarray, dead: np.ndarray, local: np.ndarray, coin: np.ndarray,
            stratum: np.ndarray, tilts: Sequence[float]) -> np.ndarray:
    """The token index each draw takes: the inverse CDF of its row's law under its stratum's tilt, or
    ``floor(coin k)`` where that law is uniform (tilt 0, or a dead row)."""
    k = step_target.shape[1]
    pick = np.minimum((coin * k).astype(np.int64), k - 1)
    step = max(1, _DRAW_CELLS // max(k, 1))
    for s, beta in enumerate(tilts):
        if beta == 0.0:
            continue
        tilted = np.flatnonzero((stratum == s) & ~dead[local])
        for lo in range(0, len(tilted), step):
            draws = tilted[lo:lo + step]
            rows = local[draws]
            cdf = np.cumsum(np.exp(beta * step_target[rows] - log_z[rows, s, None]), axis=1)
            # Scaled by the row's total, so that rounding in the sum never leaves a coin past the last token.
            pick[draws] = np.minimum((cdf < coin[draws, None] * cdf[:, -1:]).sum(axis=1), k - 1)
    return pick


# ------------------------------------------------------------------------------------------- public
def sample_format(model: Any, constraint: Any, *, prompt: Sequence[int] = (), samples: int = DEFAULT_SAMPLES,
                  seed: int | np.random.Generator = 0, strings: bool = False, eos: int | bool | None = None,
                  max_len: int | None = None, strata: Any = None, uniform_share: float | None = None,
                  batch_size: int = DEFAULT_SAMPLE_BATCH, index: Any = None,
                  progress: Callable[[SampleProgress], None] | None = None) -> FormatSample:
    """``samples`` members of the format of ``constraint`` (``Regex`` / ``Choices``) after ``prompt``, drawn
    from the stratified proposal of the module doc, each with its exact laws. Token mode (items are token
    sequences) or ``strings=True`` (items are texts, laws summed over all their tokenizations).

    ``seed``: an int or a ``numpy.random.Generator``; each stratum draws from its own stream spawned from
    it. ``strata``: ``{tilt: share}`` (or ``(tilt, share)`` pairs), tilts in [0, 1] (1: the model, 0:
    uniform), shares summing to 1; default :data:`DEFAULT_STRATA`. ``uniform_share``: shorthand for
    ``{1: 1 - share, 0: share}`` (0: the model alone, as in Dell'Amico & Filippone 2015). ``index``: an
    ``AutoregressiveEnumerable`` over the same format, prompt and mode to reuse (its compiled automaton; in
    string mode its tokenizations). ``progress``: a callable receiving a :class:`SampleProgress` after each
    depth. Guarantee: exact laws.

    Example:
        >>> from speculum.models import MarkovModel
        >>> from speculum.enumeration import Regex
        >>> vocab = ["7", "8", "77", "x"]
        >>> sample = sample_format(MarkovModel.random(4, seed=0), Regex("[78]{2}", vocabulary=vocab),
        ...                        prompt=[3], samples=8, strings=True, seed=0, uniform_share=0.5)
        >>> set(sample.items) <= {"77", "78", "87", "88"}, sample.tilts, sample.stratum_sizes
        (True, (1.0, 0.0), (4, 4))
    """

    started = time.perf_counter()
    samples = check_int(samples, "samples", minimum=2)
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    tilts, counts = _allocate(samples, check_strata(strata, uniform_share))
    if index is None:
        index = AutoregressiveEnumerable(model, prompt=prompt, constraint=constraint, eos=eos, max_len=max_len,
                                         strings=strings)
    elif bool(index.strings) != bool(strings):
        raise InputError("the index given ranks " + ("strings" if index.strings else "token sequences")
                         + f"; strings={bool(strings)} was asked")
    model = as_model(model, name="model")
    support = index.support
    if compile_for(constraint, model, eos=support.eos) != support.constraint:
        raise InputError("the index given enumerates another format than the constraint")
    prompt = tuple(index.prompt)
    streams = np.random.default_rng(seed).spawn(len(tilts)) if isinstance(seed, np.random.Generator) else [
        np.random.default_rng(s)
        for s in np.random.SeedSequence(check_int(seed, "seed", minimum=0)).spawn(len(tilts))]
    walk = FormatWalk(model, support, check_prompt(model, list(prompt), name="prompt"), batch_size)
    recorder = None if strings else SiblingRecorder(samples, len(tilts))
    sequences, stratum, target, laws = _draw_tokens(walk, counts, tilts, streams, progress, recorder)
    items: tuple = sequences
    if strings:
        items, target, laws = _string_laws(walk, index, sequences, target, laws, tilts)
    return FormatSample(items=items, target_logprob=target, proposal_logprob=mixture_logprob(laws, counts),
                        stratum_logprob=laws, stratum=stratum, tilts=tilts, strings=bool(strings), support=support,
                        prompt=prompt, forwards=walk.forwards, seconds=time.perf_counter() - started,
                        siblings=None if recorder is None else recorder.finish())


def check_strata(strata: Any, uniform_share: float | None = None) -> tuple[tuple[float, float], ...]:
    """``((tilt, share), ...)``, largest tilt first, the shares normalised to sum to 1, strata of share 0
    left out; from ``strata`` (a mapping or pairs; None: :data:`DEFAULT_STRATA`) or ``uniform_share``."""
    if uniform_share is not None:
        if strata is not None:
            raise InputError("give strata or uniform_share, not both")
        share = check_number(uniform_share, "uniform_share", minimum=0.0, maximum=1.0)
        strata = ((1.0, 1.0 - share), (0.0, share))
    if strata is None:
        strata = DEFAULT_STRATA
    pairs = list(strata.items()) if isinstance(strata, dict) else list(strata)
    checked: dict[float, float] = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InputError(f"strata are (tilt, share) pairs or a {{tilt: share}} mapping, got {pair!r}")
        tilt = check_number(pair[0], "a stratum's tilt", minimum=0.0, maximum=1.0)
        share = check_number(pair[1], "a stratum's share", minimum=0.0)
        if tilt in checked:
            raise InputError(f"the tilt {tilt} is given twice in strata")
        checked[tilt] = share
    total = math.fsum(checked.values())
    if not total > 0:
        raise InputError("strata need a positive share somewhere")
    return tuple(sorted(((t, s / total) for t, s in checked.items() if s > 0), reverse=True))


def _allocate(samples: int, strata: Sequence[tuple[float, float]]) -> tuple[tuple[float, ...], np.ndarray]:
    """``(tilts, counts)``: ``samples`` split by the shares (largest remainders); every stratum needs two
    draws or more for its variance."""
    shares = np.array([share for _, share in strata])
    exact = shares * samples
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(counts - exact, kind="stable")[:samples - int(counts.sum())]] += 1
    if (counts < 2).any():
        raise InputError(f"{samples} samples over the strata {[(t, round(s, 4)) for t, s in strata]} leave a "
                         "stratum with fewer than two draws: each stratum needs two for its variance")
    return tuple(tilt for tilt, _ in strata), counts


def _string_laws(walk: FormatWalk, index: Any, sequences, target, laws, tilts):
    """Each draw's string and its laws summed over every tokenization (the undrawn ones forwarded once)."""
    strings = index.queries            # the index's StringIndex: every tokenization of a member
    pieces, eos = walk.automaton.token_bytes, walk.eos
    known = {seq: np.concatenate([[t], row]) for seq, t, row in zip(sequences, target.tolist(), laws)}
    texts = [b"".join(pieces[t] for t in seq if t != eos) for seq in sequences]
    spellings = {text: strings.tokenizations(text) for text in dict.fromkeys(texts)}
    missing = sorted({seq for seqs in spellings.values() for seq in seqs if seq not in known})
    missing_target, missing_laws = path_logprobs(walk, missing, tilts)
    for seq, t, row in zip(missing, missing_target.tolist(), missing_laws):
        known[seq] = np.concatenate([[t], row])
    summed = {text: np.logaddexp.reduce(np.array([known[seq] for seq in seqs]), axis=0)
              for text, seqs in spellings.items()}
    stacked = np.array([summed[text] for text in texts])
    items = tuple(text.decode("utf-8", "replace") for text in texts)
    return items, stacked[:, 0], stacked[:, 1:]
