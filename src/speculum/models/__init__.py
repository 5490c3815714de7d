"""Models: the protocol (base), exact NumPy references, and real-model backends.

Backends that need optional dependencies (torch, llama-cpp-python) are imported lazily so that
``import speculum`` stays light.
"""
from __future__ import annotations

import importlib

from .base import (
    AutoregressiveModel,
    BaseModel,
    Proposer,
    Session,
    check_logits,
    check_prompt,
    check_token_ids,
    from_forward,
    log_softmax,
)
from .reference import MarkovModel

# name -> module (relative to this package, or absolute); resolved on first attribute access. The proposers
# live in speculum.drafts, a floor above models: named here lazily, importing models never imports drafts.
_LAZY = {
    "NGramModel": ".reference",
    "TinyTransformer": ".reference",
    "PromptLookup": "speculum.drafts.proposers",
    "NGramProposer": "speculum.drafts.proposers",
    "HFModel": ".hf",
    "load_model": ".backends",
    "ConversionProgress": ".hf_loading",
    "LlamaCppModel": ".llamacpp",
}

__all__ = [
    "AutoregressiveModel", "BaseModel", "Proposer", "Session", "MarkovModel",
    "check_logits", "check_prompt", "check_token_ids", "from_forward", "log_softmax", *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
