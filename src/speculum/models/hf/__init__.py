"""The Hugging Face backend (PyTorch): any local causal language model behind the speculum protocol.

* ``model.py`` - :class:`HFModel`: loading, the batched calls, packed forwards of many sessions;
* ``session.py`` - :class:`HFSession`: one sequence's incremental state;
* ``kv_cache.py`` - the KV cache protocol and its two kinds, a cache of its own and a slot of the store;
* ``kv_arena.py`` - the KV store the sessions of a packed forward share;
* ``fused_llama.py`` - the fused CPU forward of Llama models; ``prepack.py`` - pre-packed oneDNN Linear layers;
* ``logprobs.py`` - the one float64 formula of every log-prob the backend returns.

Example:
    >>> from speculum.models.hf import HFModel
    >>> model = HFModel.from_pretrained("path/to/model")            # doctest: +SKIP
"""
from __future__ import annotations

from .model import HFModel, parse_dtype
from .session import HFSession

__all__ = ["HFModel", "HFSession", "parse_dtype"]
