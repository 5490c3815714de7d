"""Deprecated alias of :mod:`speculum.models.hf.session` (import ``HFSession`` from ``speculum.models.hf``);
kept for one release."""
from __future__ import annotations

import warnings

from .hf.session import HFSession

__all__ = ["HFSession"]

warnings.warn("speculum.models.hf_session is deprecated: import HFSession from speculum.models.hf",
              DeprecationWarning, stacklevel=2)
