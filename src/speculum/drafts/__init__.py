"""Drafts: what proposes tokens for the target to verify (decoding) or builds an index for it to score
(enumeration). A draft never decides what is returned: verification and the enumeration certificate keep
every output the target's.

* :mod:`~speculum.drafts.registry` — every draft kind by name (``--draft``): :func:`make_draft` for
  decoding, :func:`make_enumeration_draft` for enumeration, :func:`check_draft_spec` without loading;
* :mod:`~speculum.drafts.proposers` — :class:`PromptLookup` and :class:`NGramProposer`, drafts of fixed
  tokens;
* :mod:`~speculum.drafts.ngram_fit` — the n-gram draft model fitted to the target's samples;
* :mod:`~speculum.drafts.twins` — int8 / bf16 / first-K-layers drafts built from a PyTorch target
  (torch is imported on first use of these names).

Example:
    >>> from speculum.drafts import PromptLookup
    >>> PromptLookup(max_ngram=2).propose([5, 6, 7, 5, 6], max_tokens=2)
    [7, 5]
"""
from __future__ import annotations

import importlib

from .ngram_fit import NGRAM_ORDER, fit_ngram_draft, sample_continuations
from .proposers import NGramProposer, PromptLookup
from .registry import (
    DECODING,
    DRAFT_KINDS,
    DRAFT_REGISTRY,
    ENUMERATION,
    ENUMERATION_DRAFTS,
    DraftKind,
    DraftRequest,
    build_draft,
    check_draft_spec,
    check_same_tokenizer,
    draft_kinds,
    is_embedded_model,
    is_twin_draft,
    make_draft,
    make_enumeration_draft,
)

# The twins need torch (the [llm] extra): resolved on first attribute access.
_LAZY = {"int8_twin": ".twins", "bf16_twin": ".twins", "truncated_draft": ".twins"}

__all__ = [
    "make_draft", "make_enumeration_draft", "build_draft", "check_draft_spec", "check_same_tokenizer",
    "is_embedded_model", "is_twin_draft", "draft_kinds", "DraftKind", "DraftRequest", "DRAFT_REGISTRY",
    "DRAFT_KINDS", "ENUMERATION_DRAFTS", "DECODING", "ENUMERATION", "PromptLookup", "NGramProposer", "NGRAM_ORDER",
    "fit_ngram_draft", "sample_continuations", *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
