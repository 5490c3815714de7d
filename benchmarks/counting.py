"""The call-counting model wrapper of the test suite (``tests/support/counting.py``), for the enumeration benchmarks.

One definition serves both: the benchmarks run as scripts with ``benchmarks/`` on the import path, the
tests with ``tests/``, so this module loads the tests' file by its path under a name of its own.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

_SOURCE = Path(__file__).resolve().parent.parent / "tests" / "support" / "counting.py"
_spec = importlib.util.spec_from_file_location("speculum_tests_counting", _SOURCE)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

CountingModel = _module.CountingModel

__all__ = ["CountingModel"]
