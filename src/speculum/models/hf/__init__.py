"""The Hugging Face backend (PyTorch): any local causal language model behind the speculum protocol.

* ``model.py`` - :class:`HFModel`: loading, the batched calls, packed forwards of many sessions;
* ``session.py`` - :class:`HFSession`: one sequence's incremental state;
* ``precision.py`` - the dtypes a target loads in (``float32``, ``bfloat16``, ``float16``, ``int8``);
* ``logprobs.py`` - the one float64 formula of every log-prob the backend returns;
* ``threads.py`` - the thread count that follows the cores other processes leave free;
* ``forward/`` - the fused forward (Llama, Mistral, Qwen2, Qwen3, Gemma 3), row attention, packed forwards, the prefix walk;
* ``kernels/`` - the matrix products: each product's kernel, the C kernels and their build, the
  row-independence probe;
* ``kv/`` - the KV cache protocol, its two kinds, and the store the sessions of a packed forward share.

Example:
    >>> from speculum.models.hf import HFModel
    >>> model = HFModel.from_pretrained("path/to/model")            # doctest: +SKIP
"""
from __future__ import annotations

from .model import HFModel, parse_dtype
from .session import HFSession

__all__ = ["HFModel", "HFSession", "parse_dtype"]
