"""Walking a format's members with the model's rows: the viable steps after a prefix, each stratum's step
laws, and the exact laws of given members.

A token is *viable* after a prefix when a member can still be completed through it (within ``max_len``
tokens). A stratum of tilt ``beta`` takes a viable token ``t`` with probability ``p(t | prefix) ** beta /
Z_beta(prefix)`` (:mod:`.sampling`); a row giving the viable tokens no mass at all is
*dead* and every stratum takes them uniformly there. Step log-probs are clipped at 0, as the prefix tree
clips them, so that a member's log-prob is the index's. Guarantee: EXACT laws (up to float rounding of the
model's rows).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ...models.base import capabilities_of
from ...validation import InputError

__all__ = ["FormatWalk", "step_partitions", "laws_at", "mixture_logprob", "path_logprobs"]


class FormatWalk:
    """The format's allowed steps and the model's rows for them: what sampling and path scoring share.

    A token is *viable* after a prefix when a member can still be completed within ``max_len`` tokens
    through it; without a cap every allowed token is (every automaton state reaches acceptance)."""

    def __init__(self, model: Any, support: Any, prompt: Sequence[int], batch_size: int) -> None:
        self.model, self.support, self.prompt = model, support, list(prompt)
        self.automaton = support.constraint
        self.eos, self.max_len = support.eos, support.max_len
        self.batch_size = batch_size
        self.forwards = 0
        # Keys and values kept from one depth to the next: a node's row costs one token's forward.
        self.levels = capabilities_of(model).prefix_levels
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

    def group_size(self, draws: int, horizon: int) -> int:
        """Draws walked together: all of them, or ``batch_size`` within what a level of keys and values
        may hold."""
        if not self.levels:
            return max(draws, 1)
        return max(1, min(draws, self.batch_size, self.model.level_capacity(len(self.prompt) + horizon)))

    def start_level(self) -> Any:
        """The root of a walk (the model's level after the prompt less its last token), or None."""
        return self.model.start_levels(self.prompt) if self.levels else None

    def level_rows(self, level: Any, parents: np.ndarray, last: np.ndarray, prefixes: np.ndarray) -> tuple[Any, Any]:
        """``(level, chunks)``: the rows of the nodes ``parents[i]`` of ``level`` extended by ``last[i]``
        (continuation tokens ``prefixes[i]``), as ``(start, rows)`` chunks, and the level they make."""
        if self.levels:
            level, rows = self.model.extend_level(level, parents.tolist(), last.tolist())
            self.forwards += len(parents)
            return level, [(0, np.asarray(rows, dtype=np.float64))]
        return None, self.rows(prefixes)

    def rows(self, prefixes: np.ndarray) -> Any:
        """Yield ``(start, rows)``: the model's next-token rows for ``prefixes`` (continuation tokens, one
        per row), in batches."""
        for start in range(0, len(prefixes), self.batch_size):
            chunk = prefixes[start:start + self.batch_size]
            full = [self.prompt + row for row in chunk.tolist()]
            rows = np.asarray(self.model.next_logprobs(full), dtype=np.float64)
            self.forwards += len(full)
            yield start, rows


def step_partitions(target: np.ndarray, tilts: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """``(log_z, dead)``: ``(rows, strata)`` log-partition ``log sum_t exp(beta * target_t)`` of each row
    under each tilt, and ``(rows,)`` whether a row gives the viable tokens no mass at all (its laws are then
    uniform, whatever the tilt)."""
    k = target.shape[1]
    top = target.max(axis=1)
    dead = ~np.isfinite(top)
    safe = np.where(dead, 0.0, top)[:, None]
    log_z = np.empty((len(target), len(tilts)))
    for s, beta in enumerate(tilts):
        if beta == 0.0:
            log_z[:, s] = math.log(k)
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            shifted = np.exp(beta * (target - safe))
            log_z[:, s] = beta * safe[:, 0] + np.log(shifted.sum(axis=1))
    return log_z, dead


def laws_at(target_at: np.ndarray, log_z: np.ndarray, dead: np.ndarray, tilts: Sequence[float],
            k: int) -> np.ndarray:
    """``target_at.shape + (strata,)``: each stratum's step law at the tokens ``target_at`` (their target
    log-probs, over a row of ``k`` viable tokens), from their rows' partitions ``log_z`` (``(..., strata)``)
    and ``dead`` flags, both broadcast against ``target_at``: ``(draws,)`` with ``(draws, strata)`` for the
    tokens taken, ``(rows, k)`` with ``(rows, 1, strata)`` for every token of each row."""
    laws = np.empty(np.shape(target_at) + (len(tilts),))
    for s, beta in enumerate(tilts):
        if beta == 0.0:
            laws[..., s] = -math.log(k)
        else:
            with np.errstate(invalid="ignore"):
                laws[..., s] = np.where(dead, -math.log(k), beta * target_at - log_z[..., s])
    return laws


def mixture_logprob(laws: np.ndarray, counts: Sequence[int]) -> np.ndarray:
    """``log(sum_k n_k q_k / n)`` over the last axis of ``laws`` (``(..., strata)``; ``counts``:
    ``(strata,)``): the law of a draw picked at random from a set of ``counts[k]`` draws of each stratum."""
    counts = np.asarray(counts, dtype=np.float64)
    with np.errstate(divide="ignore"):
        weighted = laws + np.log(counts / counts.sum())
    return np.logaddexp.reduce(weighted, axis=-1)


def path_logprobs(walk: FormatWalk, sequences: Sequence[Sequence[int]],
                  tilts: Sequence[float] = (1.0, 0.0)) -> tuple[np.ndarray, np.ndarray]:
    """``(target, laws)``: the target log-prob ``(n,)`` and the ``(n, strata)`` laws of each tilt of given
    member sequences, each distinct prefix forwarded once. Exact (the same rows and formulas as the draws)."""
    n = len(sequences)
    target, laws = np.zeros(n), np.zeros((n, len(tilts)))
    if not n:
        return target, laws
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
                step_target = np.minimum(rows[nodes - start][:, allowed], 0.0)
                log_z, dead = step_partitions(step_target, tilts)
                draws = np.flatnonzero(np.isin(node_of, nodes))
                local = np.searchsorted(nodes, node_of[draws])
                who = active[draws]
                at = _positions(allowed, tokens[who, depth])
                if (at < 0).any():
                    raise InputError("a sequence leaves the format")
                taken = step_target[local, at]
                target[who] += taken
                laws[who] += laws_at(taken, log_z[local], dead[local], tilts, len(allowed))
                states[who] = targets[at]
    return target, laws


def _positions(allowed: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Index of each ``wanted`` token in ``allowed`` (-1 where absent)."""
    order = np.argsort(allowed, kind="stable")
    ranked = allowed[order]
    at = np.minimum(np.searchsorted(ranked, wanted), len(ranked) - 1)
    return np.where(ranked[at] == wanted, order[at], -1)
