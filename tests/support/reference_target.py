"""The tiny reference target of the CLI tests: a six-token Markov model whose eos is token 5.

The user CLI loads real models only; the tests reach this one through the ``reference_target`` fixture
(conftest.py) in process, or through :data:`PATCH_LOADER` in a child process.
"""
from __future__ import annotations

from pathlib import Path

from speculum.models import MarkovModel

# The --target name the tests give; no real model has it.
REFERENCE_TARGET = "test-reference-markov"

# Python run in a child process before the CLI: makes `enumerate` / `rank` load the reference model.
PATCH_LOADER = (
    f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
    "import speculum.cli.enumerate as enumerate_cli\n"
    "from reference_target import reference_model\n"
    "enumerate_cli.load_target = lambda spec, **options: reference_model()\n"
)


def reference_model() -> MarkovModel:
    """``MarkovModel.random(6, seed=0, eos_token_id=5)``: small enough to enumerate by brute force."""
    return MarkovModel.random(6, seed=0, eos_token_id=5)
