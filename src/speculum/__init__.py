"""speculum: draft-then-verify inference over autoregressive models.

* Speculative decoding — ``speculum.generate`` / ``speculum.stream``: a cheap draft proposes, the
  target verifies in one forward; the output law is exactly the target's (greedy: identical tokens).
* Speculative enumeration — ``speculum.enumeration``: the k most probable sequences, the i-th, rank,
  count, threshold and mass, with target-exact scores and sound certificates.

Heavy parts (torch, transformers) are imported lazily.
"""
from __future__ import annotations

import importlib
import os

# PyTorch's CPU build multiplies small matrices with MKL, whose sums may round otherwise by the memory
# alignment of their operands (a thread's own buffer, say) unless its conditional numerical reproducibility
# mode is on: the same attention row could then differ beside other rows. The mode is read once, at MKL's
# first call, so it is set on import; a value the user set is kept.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

__version__ = "0.3.0"

_LAZY = {
    "generate": "speculum.decoding",
    "generate_batch": "speculum.decoding",
    "stream": "speculum.decoding",
    "DecodingStats": "speculum.decoding",
    "GenerationResult": "speculum.decoding",
    "SpeculativeDecoder": "speculum.decoding",
    "SpeculativeDecodingStats": "speculum.decoding",
    "load_model": "speculum.models",
    "from_forward": "speculum.models",
    "InputError": "speculum.validation",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'speculum' has no attribute {name!r}")
