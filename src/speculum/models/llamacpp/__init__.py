"""The llama.cpp backend: any GGUF file through ``llama-cpp-python``, as a protocol model.

* :mod:`~speculum.models.llamacpp.backend` — :class:`LlamaCppModel` and its sessions on one llama context,
  :func:`load_llamacpp_model` (a GGUF path or an embedded model's name);
* :mod:`~speculum.models.llamacpp.tokenizer` — :class:`LlamaCppTokenizer`, the GGUF's own tokenizer;
* :mod:`~speculum.models.llamacpp.build_check` — the guard against llama.cpp builds whose CPU kernels crash
  the process, and the one list of build flags (``CMAKE_ARGS``).

Importing this package needs no ``llama-cpp-python``: it is imported when a model loads, and its absence
is then a one-line ``ImportError`` with the install command.

Example:
    >>> from speculum.models.llamacpp import load_llamacpp_model
    >>> model = load_llamacpp_model("smollm2-135m")            # doctest: +SKIP
"""
from __future__ import annotations

from .backend import (
    INSTALL_HINT,
    LlamaCppModel,
    LlamaCppSession,
    check_same_vocabulary,
    load_llamacpp_model,
)
from .build_check import CMAKE_ARGS, LLAMACPP_REQUIREMENT, REBUILD_COMMAND, check_native_build
from .tokenizer import LlamaCppTokenizer

__all__ = [
    "LlamaCppModel",
    "LlamaCppSession",
    "LlamaCppTokenizer",
    "load_llamacpp_model",
    "check_same_vocabulary",
    "INSTALL_HINT",
    "check_native_build",
    "CMAKE_ARGS",
    "LLAMACPP_REQUIREMENT",
    "REBUILD_COMMAND",
]
