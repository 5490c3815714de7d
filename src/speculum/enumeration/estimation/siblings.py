"""A draw's last step, counted over every token it could have taken: the conditional (Rao-Blackwell) term.

The rank estimate (:mod:`.estimate`) averages ``1[x before c] / q(x)`` over draws
``x = (y, t)``. When the step after the prefix ``y`` is *final* (every viable token completes a member, as
the last digit of ``" \\d{9}"`` does), the row that drew ``t`` already holds the exact log-probability of
every sibling member ``y t'``. Averaging the term over the draw's own step law instead of taking the one
token drawn,

    E[1[x before c] / q(x) | y, stratum k] = sum_t' q_k(t' | y) 1[y t' before c] / q(y t'),

keeps the estimate UNBIASED and never raises its variance (the Rao-Blackwell theorem: Blackwell 1947;
conditional Monte Carlo, Hammersley 1956), at no forward. The draws stay independent within each stratum,
so the interval's variance formula holds for the conditional terms unchanged.

Kept for final steps of at most :data:`MAX_SIBLINGS` tokens (``(draws, width, strata)`` laws are stored),
in token mode (a string's law sums tokenizations that end on different steps).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Siblings", "SiblingRecorder", "MAX_SIBLINGS"]

MAX_SIBLINGS = 64       # widest final step whose siblings are kept (digits: 10)


@dataclass(frozen=True, eq=False)
class Siblings:
    """Per draw, the members one last token away from its prefix. ``token``: ``(n, width)`` the last
    tokens (-1: none; a draw without siblings has a row of -1). ``target``: their exact log-probs.
    ``laws``: ``(n, width, strata)`` each stratum's law of the sibling member. ``own``: ``(n, width)`` the
    draw's own stratum's step law of each last token (the weights of the conditional term)."""

    token: np.ndarray
    target: np.ndarray
    laws: np.ndarray
    own: np.ndarray

    @property
    def present(self) -> np.ndarray:
        """``(n,)``: the draws whose term is conditional."""
        return (self.token >= 0).any(axis=1)

    @staticmethod
    def none(n: int, strata: int) -> "Siblings":
        return Siblings(np.full((n, 0), -1, dtype=np.int64), np.zeros((n, 0)), np.zeros((n, 0, strata)),
                        np.zeros((n, 0)))

    def concatenated(self, other: "Siblings") -> "Siblings":
        """The rows of both, padded to the wider width."""
        width = max(self.token.shape[1], other.token.shape[1])
        parts = [_padded(s, width) for s in (self, other)]
        return Siblings(*(np.concatenate([a, b]) for a, b in zip(*parts)))


def _padded(siblings: Siblings, width: int) -> tuple[np.ndarray, ...]:
    extra = width - siblings.token.shape[1]
    if not extra:
        return siblings.token, siblings.target, siblings.laws, siblings.own
    n, strata = len(siblings.token), siblings.laws.shape[2]
    return (np.concatenate([siblings.token, np.full((n, extra), -1, dtype=np.int64)], axis=1),
            np.concatenate([siblings.target, np.full((n, extra), -np.inf)], axis=1),
            np.concatenate([siblings.laws, np.full((n, extra, strata), -np.inf)], axis=1),
            np.concatenate([siblings.own, np.full((n, extra), -np.inf)], axis=1))


class SiblingRecorder:
    """Collects the final steps of the draws while they are made; :meth:`finish` lays them out."""

    def __init__(self, n: int, strata: int) -> None:
        self.n, self.strata = n, strata
        self._parts: list[tuple[np.ndarray, ...]] = []

    def record(self, who: np.ndarray, allowed: np.ndarray, member_target: np.ndarray, prefix_laws: np.ndarray,
               step_laws: np.ndarray, stratum: np.ndarray) -> None:
        """Draws ``who`` (``(d,)``), at a final step over ``allowed`` (``(k,)``): the sibling members'
        target log-probs ``(d, k)``, their prefixes' laws ``(d, strata)``, the rows' step laws
        ``(d, k, strata)`` and each draw's stratum ``(d,)``."""
        if not 1 < len(allowed) <= MAX_SIBLINGS:
            return
        own = step_laws[np.arange(len(who)), :, stratum.astype(np.int64)]          # (d, k)
        self._parts.append((who, np.broadcast_to(allowed, member_target.shape), member_target,
                            prefix_laws[:, None, :] + step_laws, own))

    def finish(self) -> Siblings:
        if not self._parts:
            return Siblings.none(self.n, self.strata)
        width = max(part[1].shape[1] for part in self._parts)
        token = np.full((self.n, width), -1, dtype=np.int64)
        target = np.full((self.n, width), -np.inf)
        laws = np.full((self.n, width, self.strata), -np.inf)
        own = np.full((self.n, width), -np.inf)
        for who, tokens, step_target, member_laws, weights in self._parts:
            k = tokens.shape[1]
            token[who, :k], target[who, :k], laws[who, :k], own[who, :k] = tokens, step_target, member_laws, weights
        return Siblings(token, target, laws, own)
