"""Enumeration: a model's sequences in descending probability, with exact scores.

``AutoregressiveEnumerable`` / ``SeekIndex`` (exact order), ``AREnvelopeIndex`` (very deep ranks,
approximate rank coordinate, exact scores), ``RescoredIndex`` (draft-built, target-scored, certified).
``Regex`` / ``Choices`` constrain an index to a format or a label set (``StringIndex``: its strings over
all their tokenizations). ``sample_format`` draws members of a format with their laws, and
``rank_from_sample`` estimates a rank from them (``estimate_ranks(method="auto")``). ``Support`` says which
continuations an index enumerates; ``EnumerationIndex`` is what every index offers.

The folders follow the concepts, each importing only those listed before it:

* :mod:`.formats` — a format (``Regex``) or label set (``Choices``) as a token automaton; it imports nothing
  else of enumeration;
* :mod:`.index` — the exact index: ``Support``, the prefix tree, ``SeekIndex``, ``StringIndex``, and the
  protocols every index follows;
* :mod:`.enumerable` — ``AutoregressiveEnumerable``, the front class over the exact index;
* :mod:`.estimation` — ranks beyond the exact frontier: the envelope, sampled ranks, exposure;
* :mod:`.rescored` — ``RescoredIndex``, the speculative certificate: a draft's index, the target's scores;
* :mod:`.labels` — ``score_choices``: a label set scored in one pass over a trie.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "AutoregressiveEnumerable": ".enumerable",
    "SeekIndex": ".index.seek_index",
    "AREnvelopeIndex": ".estimation.envelope",
    "RescoredIndex": ".rescored",
    "estimate_rank": ".estimation.exposure",
    "RankReport": ".estimation.exposure",
    "Support": ".index.support",
    "EnumerationIndex": ".index.protocols",
    "Regex": ".formats.constraint",
    "Choices": ".formats.constraint",
    "TokenAutomaton": ".formats.automaton",
    "AutomatonBudgetError": ".formats.automaton",
    "StringIndex": ".index.strings",
    "score_choices": ".labels",
    "ChoiceScores": ".labels",
    "estimate_ranks": ".estimation.exposure",
    "ScoringIndex": ".index.protocols",
    "sample_format": ".estimation.sampling",
    "FormatSample": ".estimation.sampling",
    "rank_from_sample": ".estimation.estimate",
    "RankEstimate": ".estimation.estimate",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
