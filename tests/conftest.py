"""Shared test set-up.

NumPy's multithreaded BLAS makes the small float64 matrix products of the reference models 3-20x
slower on 2 shared cores, so tests pin it to one thread (before NumPy loads its BLAS).
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from support.reference_target import REFERENCE_TARGET, reference_model  # noqa: E402


@pytest.fixture
def reference_target(monkeypatch):
    """Make ``speculum enumerate`` / ``rank`` load :func:`reference_model` for ``--target REFERENCE_TARGET``
    (any other target loads as usual); returns that target name."""
    import speculum.cli.enumerate as enumerate_cli

    load_target = enumerate_cli.load_target

    def load(spec, **options):
        return reference_model() if spec == REFERENCE_TARGET else load_target(spec, **options)

    monkeypatch.setattr(enumerate_cli, "load_target", load)
    return REFERENCE_TARGET
