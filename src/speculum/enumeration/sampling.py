"""Members of a format drawn from a known law, each with the model's probability and the law's.

The sampled rank estimate (:mod:`speculum.enumeration.estimate`) needs draws ``x`` from a proposal law
``q`` over the format's members together with ``q(x)`` and the model's own ``p(x)``. Two laws share the
draws, in fixed numbers (stratified, so that their mixture is the balance law of multiple importance
sampling: Veach & Guibas 1995; Owen & Zhou 2000, "Safe and effective importance sampling"):

* the **model** stratum samples the model restricted to the format: at each step the tokens that can
  still complete a member are kept and renormalised, so ``q_model(x) = prod p(t | prefix) / mass(prefix)``;
* the **uniform** stratum draws, at each step, one of those tokens uniformly: ``u(x) = prod 1 / k(prefix)``
  (uniform over the members of a format whose members have one spelling each, like ``" \\d{9}"``).

Each draw records ``log q(x) = log((n_model q_model(x) + n_uniform u(x)) / n)``: the law of a draw picked
at random from the set. The uniform stratum bounds every weight ``1 / q(x)`` by ``n / (n_uniform u(x))``,
which keeps the estimate of a deep rank (a random canary) precise; the model stratum finds the probable
members above a shallow one.

Draws advance as a trie: at each depth the distinct live prefixes are forwarded once, in batched
``next_logprobs`` calls, and the draws at a prefix branch from its row, so hundreds of draws share a
forward (and the prompt). In string mode each sampled string's laws are summed over every tokenization
of it (:meth:`~speculum.enumeration.strings.StringIndex.tokenizations`): ``Q(s) = sum_{x -> s} q(x)`` and
``P(s) = sum_{x -> s} p(x)``, exact, the tokenizations not drawn forwarded once each.

Guarantee: EXACT laws. ``proposal_logprob`` is the exact log-probability that a draw of the set is that
item (up to float rounding of the model's rows), and ``target_logprob`` the model's exact (unrenormalised)
log-probability of it.

Example:
    >>> from speculum.models import MarkovModel
    >>> from speculum.enumeration import Regex
    >>> sample = sample_format(MarkovModel.random(4, seed=0), Regex("[ab]{3}", vocabulary=["a", "b", "c", "d"]),
    ...                        prompt=[2], samples=64, seed=1)
    >>> len(sample), sample.stratum_sizes, bool((sample.proposal_logprob <= 0).all())
    (64, (32, 32), True)
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..models.base import as_model, check_prompt
from ..validation import InputError, check_int, check_number
from .constraint import compile_for
from .exact import AutoregressiveEnumerable

__all__ = ["FormatSample", "SampleProgress", "sample_format", "DEFAULT_SAMPLES",
           "DEFAULT_UNIFORM_SHARE", "DEFAULT_SAMPLE_BATCH"]

DEFAULT_SAMPLES = 4096
# Half the draws uniform: a deep rank's weights stay bounded (the relative variance of a rank R in a space
# of N members is at most about N / (R * uniform share)), at twice the variance of a shallow one at most.
DEFAULT_UNIFORM_SHARE = 0.5
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
    of the mixture law the draws came from. ``model_logprob`` / ``uniform_logprob``: each stratum's own law.
    ``stratum``: 0 for a model draw, 1 for a uniform one. ``forwards``: prefixes forwarded to draw the set.
    """

    items: tuple
    target_logprob: np.ndarray
    proposal_logprob: np.ndarray
    model_logprob: np.ndarray
    uniform_logprob: np.ndarray
    stratum: np.ndarray
    strings: bool
    support: Any
    prompt: tuple
    forwards: int
    seconds: float = 0.0

    def __len__(self) -> int:
        return len(self.items)

    @property
    def stratum_sizes(self) -> tuple[int, int]:
        """``(model draws, uniform draws)``."""
        uniform = int(np.count_nonzero(self.stratum))
        return len(self.stratum) - uniform, uniform

    def matches(self, support: Any, prompt: Sequence[int], strings: bool) -> bool:
        """Whether the set was drawn from this support after this prompt, in this mode."""
        return self.support == support and self.prompt == tuple(prompt) and self.strings == bool(strings)

    def merged(self, other: "FormatSample") -> "FormatSample":
        """One set holding the draws of both (of the same format, prompt and mode, drawn with independent
        seeds): each stratum's draws pooled, each draw's law the balance mixture over the pooled counts.
        Exact laws; what a larger set drawn at once would estimate, so a set can grow until an interval is
        narrow enough.

        Example:
            >>> from speculum.models import MarkovModel
            >>> from speculum.enumeration import Regex
            >>> model, ab = MarkovModel.random(3, seed=0), Regex("[ab]{4}", vocabulary=["a", "b", "c"])
            >>> first = sample_format(model, ab, prompt=[2], samples=8, seed=0)
            >>> both = first.merged(sample_format(model, ab, prompt=[2], samples=12, seed=1))
            >>> len(both), both.stratum_sizes
            (20, (10, 10))
        """
        if not isinstance(other, FormatSample) or not other.matches(self.support, self.prompt, self.strings):
            raise InputError("only a set drawn from the same format, prompt and mode can be merged")
        stratum = np.concatenate([self.stratum, other.stratum])
        model_lp = np.concatenate([self.model_logprob, other.model_logprob])
        uniform_lp = np.concatenate([self.uniform_logprob, other.uniform_logprob])
        n_uniform = int(np.count_nonzero(stratum))
        return FormatSample(items=self.items + other.items,
                            target_logprob=np.concatenate([self.target_logprob, other.target_logprob]),
                            proposal_logprob=_mixture(model_lp, uniform_lp, len(stratum) - n_uniform, n_uniform),
                            model_logprob=model_lp, uniform_logprob=uniform_lp, stratum=stratum, strings=self.strings,
                            support=self.support, prompt=self.prompt, forwards=self.forwards + other.forwards,
                            seconds=self.seconds + other.seconds)


# --------------------------------------------------------------------------------------------- walk
class _Walk:
    """The format's allowed steps and the model's rows for them: what sampling and path scoring share.

    A token is *viable* after a prefix when a member can still be completed within ``max_len`` tokens
    through it; without a cap every allowed token is (every automaton state reaches acceptance)."""

    def __init__(self, model: Any, support: Any, prompt: Sequence[int], batch_size: int) -> None:
        self.model, self.support, self.prompt = model, support, list(prompt)
        self.automaton = support.constraint
        self.eos, self.max_len = support.eos, support.max_len
        self.batch_size = batch_size
        self.forwards = 0
        if self.max_len is None and self.automaton.longest_path() is None:
            raise InputError(f"sampling the {self.automaton.description} needs a bound on the tokens of a member "
                             "(the language is unbounded): pass max_len")
        self._distance = self._steps_to_accept() if self.max_len is not None else None
        self._viable: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def _steps_to_accept(self) -> np.ndarray:
        """Fewest tokens from each state to an accepting one, over the states within the cap."""
        body = self.max_len - (1 if self.eos is not None else 0)
        expanded = self.automaton.explore(depth=max(body, 0))
        distance = np.where(self.automaton.accepting, 0.0, np.inf)
        for _ in range(max(body, 0)):
            changed = False
            for state in expanded:
                targets = self.automaton.moves(state)[1]
                if len(targets):
                    best = 1.0 + distance[targets].min()
                    if best < distance[state]:
                        distance[state], changed = best, True
            if not changed:
                break
        return distance

    def viable(self, state: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, next states)`` that may follow a prefix of ``depth`` tokens in ``state`` (eos keeps
        the state); cached."""
        key = (state, depth if self.max_len is not None else 0)
        found = self._viable.get(key)
        if found is not None:
            return found
        tokens, targets = self.automaton.moves(state)
        tokens, targets = tokens.astype(np.int64), targets.astype(np.int64)
        if self.max_len is not None:
            room = self.max_len - (depth + 1) - (1 if self.eos is not None else 0)
            distance = self._distance
            if len(distance) < self.automaton.n_states:    # states built after the distances: beyond the cap
                distance = np.concatenate([distance, np.where(
                    self.automaton.accepting[len(distance):], 0.0, np.inf)])
            keep = distance[targets] <= room
            tokens, targets = tokens[keep], targets[keep]
        if self.eos is not None and self.automaton.accepting[state] and (
                self.max_len is None or depth + 1 <= self.max_len):
            tokens, targets = np.append(tokens, self.eos), np.append(targets, state)
        self._viable[key] = (tokens, targets)
        return tokens, targets

    def complete(self, tokens: np.ndarray, states: np.ndarray) -> np.ndarray:
        """Element-wise: whether a prefix that just took ``tokens`` into ``states`` is a member."""
        if self.eos is not None:
            return tokens == self.eos
        return self.automaton.accepting[states]

    def rows(self, prefixes: np.ndarray) -> Any:
        """Yield ``(start, rows)``: the model's next-token rows for ``prefixes`` (continuation tokens, one
        per row), in batches."""
        for start in range(0, len(prefixes), self.batch_size):
            chunk = prefixes[start:start + self.batch_size]
            full = [self.prompt + row for row in chunk.tolist()]
            rows = np.asarray(self.model.next_logprobs(full), dtype=np.float64)
            self.forwards += len(full)
            yield start, rows


def _step_laws(rows: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(target, model)``: each row's log-prob at ``tokens`` and the model stratum's step law there (the
    rows renormalised over ``tokens``; uniform where the model gives them no mass at all). Steps are
    clipped at 0, as the prefix tree clips them, so that a member's log-prob is the index's."""
    target = np.minimum(rows[:, tokens], 0.0)
    top = target.max(axis=1, keepdims=True)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        mass = safe + np.log(np.exp(target - safe).sum(axis=1, keepdims=True))
    dead = ~np.isfinite(mass[:, 0])
    model = target - np.where(np.isfinite(mass), mass, 0.0)
    model[dead] = -math.log(len(tokens))
    return target, model


# ------------------------------------------------------------------------------------------- drawing
def _draw_tokens(walk: _Walk, n_model: int, n_uniform: int, model_rng: np.random.Generator,
                 uniform_rng: np.random.Generator, progress: Callable[[SampleProgress], None] | None):
    """Token sequences of the two strata, each with ``(target, model, uniform)`` log-laws."""
    n = n_model + n_uniform
    horizon = walk.max_len if walk.max_len is not None else walk.automaton.longest_path() + (
        1 if walk.eos is not None else 0)
    stratum = np.concatenate([np.zeros(n_model, dtype=np.int8), np.ones(n_uniform, dtype=np.int8)])
    tokens = np.full((n, max(horizon, 1)), -1, dtype=np.int64)
    target, model, uniform = np.zeros(n), np.zeros(n), np.zeros(n)
    states = np.zeros(n, dtype=np.int64)
    active = np.arange(n)
    node = np.zeros(n, dtype=np.int64)                 # each active draw's prefix at this depth
    for depth in range(horizon):
        if not len(active):
            break
        # One uniform number per draw and depth from its stratum's stream: the draws do not depend on how
        # the prefixes are batched.
        coin = np.where(stratum == 0, model_rng.random(n), uniform_rng.random(n))
        keys, first, node_of = np.unique(node[active], return_index=True, return_inverse=True)
        representative = active[first]
        prefixes = tokens[representative, :depth]
        node_state = states[representative]
        chosen = np.empty(len(active), dtype=np.int64)
        for start, rows in walk.rows(prefixes):
            members = np.arange(start, start + len(rows))
            for state in np.unique(node_state[members]):
                nodes = members[node_state[members] == state]
                allowed, targets = walk.viable(int(state), depth)
                if not len(allowed):
                    raise InputError("a prefix of the format has no viable continuation (an inconsistent automaton)")
                step_target, step_model = _step_laws(rows[nodes - start], allowed)
                draws = np.flatnonzero(np.isin(node_of, nodes))
                local = np.searchsorted(nodes, node_of[draws])
                pick = _invert(step_model, local, coin[active[draws]], stratum[active[draws]], len(allowed))
                who = active[draws]
                chosen[draws] = allowed[pick]
                target[who] += step_target[local, pick]
                model[who] += step_model[local, pick]
                uniform[who] -= math.log(len(allowed))
                states[who] = targets[pick]
        tokens[active, depth] = chosen
        done = walk.complete(chosen, states[active])
        node = np.zeros(n, dtype=np.int64)
        node[active] = node_of * (walk.model.vocab_size + 1) + chosen
        active = active[~done]
        if progress is not None:
            progress(SampleProgress(depth=depth + 1, live=len(active), forwards=walk.forwards))
    if len(active):
        raise InputError("a draw passed the format's longest member without completing it")
    lengths = (tokens >= 0).sum(axis=1)
    sequences = tuple(tuple(row[:length]) for row, length in zip(tokens.tolist(), lengths.tolist()))
    return sequences, stratum, target, model, uniform


def _invert(step_model: np.ndarray, local: np.ndarray, coin: np.ndarray, stratum: np.ndarray, k: int) -> np.ndarray:
    """The token index each draw takes: inverse CDF of its row's model law (model stratum) or ``floor(coin k)``
    (uniform stratum)."""
    pick = np.minimum((coin * k).astype(np.int64), k - 1)
    by_model = np.flatnonzero(stratum == 0)
    step = max(1, _DRAW_CELLS // max(k, 1))
    for lo in range(0, len(by_model), step):
        rows = by_model[lo:lo + step]
        cdf = np.cumsum(np.exp(step_model[local[rows]]), axis=1)
        # Scaled by the row's total, so that rounding in the sum never leaves a coin past the last token.
        pick[rows] = np.minimum((cdf < coin[rows, None] * cdf[:, -1:]).sum(axis=1), k - 1)
    return pick


def path_logprobs(walk: _Walk, sequences: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(target, model, uniform)`` log-laws of given member sequences, each distinct prefix forwarded once.
    Exact (the same rows and formulas as the draws)."""
    n = len(sequences)
    target, model, uniform = np.zeros(n), np.zeros(n), np.zeros(n)
    if not n:
        return target, model, uniform
    longest = max(len(s) for s in sequences)
    tokens = np.full((n, longest), -1, dtype=np.int64)
    for i, seq in enumerate(sequences):
        tokens[i, :len(seq)] = seq
    states = np.zeros(n, dtype=np.int64)
    for depth in range(longest):
        active = np.flatnonzero(tokens[:, depth] >= 0)
        if depth:
            prefixes, node_of = np.unique(tokens[active, :depth], axis=0, return_inverse=True)
            node_of = node_of.reshape(-1)
        else:
            prefixes, node_of = np.zeros((1, 0), dtype=np.int64), np.zeros(len(active), dtype=np.int64)
        first = np.full(len(prefixes), -1, dtype=np.int64)
        first[node_of[::-1]] = active[::-1]
        node_state = states[first]
        for start, rows in walk.rows(prefixes):
            members = np.arange(start, start + len(rows))
            for state in np.unique(node_state[members]):
                nodes = members[node_state[members] == state]
                allowed, targets = walk.viable(int(state), depth)
                step_target, step_model = _step_laws(rows[nodes - start], allowed)
                draws = np.flatnonzero(np.isin(node_of, nodes))
                local = np.searchsorted(nodes, node_of[draws])
                who = active[draws]
                at = _positions(allowed, tokens[who, depth])
                if (at < 0).any():
                    raise InputError("a sequence leaves the format")
                target[who] += step_target[local, at]
                model[who] += step_model[local, at]
                uniform[who] -= math.log(len(allowed))
                states[who] = targets[at]
    return target, model, uniform


def _positions(allowed: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Index of each ``wanted`` token in ``allowed`` (-1 where absent)."""
    order = np.argsort(allowed, kind="stable")
    ranked = allowed[order]
    at = np.minimum(np.searchsorted(ranked, wanted), len(ranked) - 1)
    return np.where(ranked[at] == wanted, order[at], -1)


# ------------------------------------------------------------------------------------------- public
def sample_format(model: Any, constraint: Any, *, prompt: Sequence[int] = (), samples: int = DEFAULT_SAMPLES,
                  seed: int | np.random.Generator = 0, strings: bool = False, eos: int | bool | None = None,
                  max_len: int | None = None, uniform_share: float = DEFAULT_UNIFORM_SHARE,
                  batch_size: int = DEFAULT_SAMPLE_BATCH, index: Any = None,
                  progress: Callable[[SampleProgress], None] | None = None) -> FormatSample:
    """``samples`` members of the format of ``constraint`` (``Regex`` / ``Choices``) after ``prompt``, drawn
    from the stratified proposal of the module doc, each with its exact laws. Token mode (items are token
    sequences) or ``strings=True`` (items are texts, laws summed over all their tokenizations).

    ``seed``: an int or a ``numpy.random.Generator``; the model and uniform strata draw from two separate
    streams spawned from it. ``uniform_share``: the fraction of uniform draws (0: the model alone, as in
    Dell'Amico & Filippone 2015; 1: uniform alone). ``index``: an ``AutoregressiveEnumerable`` over the same
    format, prompt and mode to reuse (its compiled automaton; in string mode its tokenizations).
    ``progress``: a callable receiving a :class:`SampleProgress` after each depth. Guarantee: exact laws.

    Example:
        >>> from speculum.models import MarkovModel
        >>> from speculum.enumeration import Regex
        >>> vocab = ["7", "8", "77", "x"]
        >>> sample = sample_format(MarkovModel.random(4, seed=0), Regex("[78]{2}", vocabulary=vocab),
        ...                        prompt=[3], samples=8, strings=True, seed=0)
        >>> set(sample.items) <= {"77", "78", "87", "88"}
        True
    """

    started = time.perf_counter()
    samples = check_int(samples, "samples", minimum=2)
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    uniform_share = check_number(uniform_share, "uniform_share", minimum=0.0, maximum=1.0)
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
    n_uniform = int(round(samples * uniform_share))
    n_model = samples - n_uniform
    if 0 < n_model < 2 or 0 < n_uniform < 2:
        raise InputError(f"{samples} samples with uniform_share={uniform_share} leave a stratum with one draw: "
                         "each stratum needs two or none for its variance")
    streams = np.random.default_rng(seed).spawn(2) if isinstance(seed, np.random.Generator) else [
        np.random.default_rng(s) for s in np.random.SeedSequence(check_int(seed, "seed", minimum=0)).spawn(2)]
    walk = _Walk(model, support, check_prompt(model, list(prompt), name="prompt"), batch_size)
    sequences, stratum, target, model_lp, uniform_lp = _draw_tokens(walk, n_model, n_uniform, streams[0],
                                                                     streams[1], progress)
    items: tuple = sequences
    if strings:
        items, target, model_lp, uniform_lp = _string_laws(walk, index, sequences, target, model_lp, uniform_lp)
    proposal = _mixture(model_lp, uniform_lp, n_model, n_uniform)
    return FormatSample(items=items, target_logprob=target, proposal_logprob=proposal, model_logprob=model_lp,
                        uniform_logprob=uniform_lp, stratum=stratum, strings=bool(strings), support=support,
                        prompt=prompt, forwards=walk.forwards, seconds=time.perf_counter() - started)


def _mixture(model_lp: np.ndarray, uniform_lp: np.ndarray, n_model: int, n_uniform: int) -> np.ndarray:
    """``log((n_model q_model + n_uniform u) / n)``: the law of a draw picked at random from the set."""
    n = n_model + n_uniform
    with np.errstate(divide="ignore"):
        parts = [np.log(n_model / n) + model_lp if n_model else np.full_like(model_lp, -np.inf),
                 np.log(n_uniform / n) + uniform_lp if n_uniform else np.full_like(uniform_lp, -np.inf)]
    return np.logaddexp(*parts)


def _string_laws(walk: _Walk, index: Any, sequences, target, model_lp, uniform_lp):
    """Each draw's string and its laws summed over every tokenization (the undrawn ones forwarded once)."""
    strings = index.queries            # the index's StringIndex: every tokenization of a member
    pieces, eos = walk.automaton.token_bytes, walk.eos
    known = {seq: (t, m, u) for seq, t, m, u in zip(sequences, target.tolist(), model_lp.tolist(),
                                                     uniform_lp.tolist())}
    texts = [b"".join(pieces[t] for t in seq if t != eos) for seq in sequences]
    spellings = {text: strings.tokenizations(text) for text in dict.fromkeys(texts)}
    missing = sorted({seq for seqs in spellings.values() for seq in seqs if seq not in known})
    for seq, t, m, u in zip(missing, *path_logprobs(walk, missing)):
        known[seq] = (float(t), float(m), float(u))
    laws = {}
    for text, seqs in spellings.items():
        values = np.array([known[seq] for seq in seqs])
        laws[text] = np.logaddexp.reduce(values, axis=0)
    stacked = np.array([laws[text] for text in texts])
    items = tuple(text.decode("utf-8", "replace") for text in texts)
    return items, stacked[:, 0], stacked[:, 1], stacked[:, 2]
