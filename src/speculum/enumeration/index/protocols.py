"""What an enumeration index offers, declared once: the interface rescoring and the CLI rely on.

:class:`EnumerationIndex` is what a draft index must offer to :class:`~speculum.enumeration.RescoredIndex`
(``SeekIndex``, ``AutoregressiveEnumerable`` and ``AREnvelopeIndex`` all do); :class:`ScoringIndex` adds
what a target index must offer to score what the draft index pulls. Both are runtime-checkable, so an
object is classified once, where it enters, by ``isinstance``.
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from .support import Support

__all__ = ["EnumerationIndex", "ScoringIndex"]


@runtime_checkable
class EnumerationIndex(Protocol):
    """Sequences of one :class:`Support` after ``prompt``, in the index's order with their log-probs.

    ``order_error``: for positions ``i < j``, ``log_prob(j) <= log_prob(i) + order_error`` (0.0 for an exact
    order, None when unknown). ``complete``: the index lists its whole support (no branch cap, no length
    cut). ``unrank`` raises ``IndexError`` past the support; ``slice`` returns fewer items there.
    """

    vocab_size: int
    support: Support
    prompt: tuple[int, ...]
    order_error: float | None
    complete: bool

    def unrank(self, i: int) -> tuple[tuple[int, ...], float]:
        ...

    def slice(self, start: int, k: int) -> list[tuple[tuple[int, ...], float]]:
        ...


@runtime_checkable
class ScoringIndex(EnumerationIndex, Protocol):
    """An index that also scores any sequence of its support exactly (a target index).

    ``capped``: the index enumerates only a sub-support (a branch cap), so it cannot vouch for the rest.
    """

    capped: bool

    def score_sequences(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
        ...
