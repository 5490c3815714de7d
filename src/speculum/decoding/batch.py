"""Deprecated alias of :mod:`speculum.decoding.scheduler` (import ``Scheduler``, ``PackedCost`` and
``generate_batch`` from there); kept for one release."""
from __future__ import annotations

import warnings

from .scheduler import PackedCost, Scheduler, generate_batch

__all__ = ["Scheduler", "PackedCost", "generate_batch"]

warnings.warn("speculum.decoding.batch is deprecated: import from speculum.decoding.scheduler",
              DeprecationWarning, stacklevel=2)
