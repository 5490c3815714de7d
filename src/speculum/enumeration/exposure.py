"""A continuation's rank among all continuations of its length, and its exposure.

Exposure (Carlini et al. 2019, "The Secret Sharer", Sec. 4): ``log2(V^L) - log2(rank + 1)`` bits —
how much more likely the model makes this continuation than a uniformly random one of the same token
length. The rank is exact (the exact index) when it is shallow enough to count, and otherwise estimated
by the sampled envelope with a bracket; the report says which.

Example:
    >>> from speculum.models import MarkovModel
    >>> report = estimate_rank(MarkovModel.random(5, seed=0), [1, 2, 3], prompt=[0])
    >>> report.method, report.rank_lo == report.rank == report.rank_hi, report.exposure_bits > 0
    ('exact', True, True)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from ..models.base import as_model, check_prompt, check_token_ids
from ..validation import InputError, check_int
from .envelope import DEFAULT_RESOLUTION, AREnvelopeIndex
from .support import Support

__all__ = ["RankReport", "estimate_rank", "DEFAULT_EXACT_RANK_LIMIT"]

DEFAULT_EXACT_RANK_LIMIT = 1_000  # count exactly when the envelope says the rank is at most this


@dataclass(frozen=True)
class RankReport:
    """Rank of a continuation among the ``vocab_size ** length`` continuations of its length.

    ``method`` is ``"exact"`` (``rank_lo == rank == rank_hi``; ties count lexicographically smaller
    sequences as before it) or ``"envelope"`` (approximate: ``rank`` estimated, ``[rank_lo, rank_hi]``
    sound when every prefix's sorted next-token row lies within the sampled envelopes).
    """

    rank: int  # number of continuations strictly more probable
    rank_lo: int
    rank_hi: int
    method: str
    log_prob: float  # exact log p(continuation | prompt), nats
    length: int
    vocab_size: int

    def _exposure(self, rank: int) -> float:
        return self.length * math.log2(self.vocab_size) - math.log2(rank + 1)

    @property
    def exposure_bits(self) -> float:
        """``log2(V^L) - log2(rank + 1)`` (Carlini et al., "The Secret Sharer")."""
        return self._exposure(self.rank)

    @property
    def exposure_bracket(self) -> tuple[float, float]:
        """``(low, high)`` exposure from the rank bracket's ends."""
        return self._exposure(self.rank_hi), self._exposure(self.rank_lo)


def estimate_rank(model: Any, continuation: Sequence[int], *, prompt: Sequence[int] = (),
                  exact_limit: int = DEFAULT_EXACT_RANK_LIMIT, n_paths: int = 16, seed: int = 0,
                  resolution: float = DEFAULT_RESOLUTION) -> RankReport:
    """Rank and exposure of ``continuation`` after ``prompt``, exact when cheap, else enveloped.

    The exact index is used when the whole space (every continuation of the same length) or the
    envelope's upper bracket is at most ``exact_limit``; otherwise the envelope's estimate and bracket are
    reported (APPROXIMATE).
    """
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
    if Support(max_len=length).size(vocab_size) > exact_limit:
        envelope = AREnvelopeIndex(model, max_len=length, prompt=prompt, n_paths=n_paths, seed=seed,
                                   resolution=resolution, exact_limit=0)
        estimate, lo, hi = envelope.rank_estimate(seq)
        if hi > exact_limit:
            return RankReport(estimate, lo, hi, "envelope", log_prob, length, vocab_size)
    from .exact import AutoregressiveEnumerable

    rank = AutoregressiveEnumerable(model, max_len=length, prompt=prompt).rank(seq)
    return RankReport(rank, rank, rank, "exact", log_prob, length, vocab_size)
