"""Deprecated alias of :mod:`speculum.models.hf.fused_llama`; kept for one release."""
from __future__ import annotations

import warnings

from .hf.fused_llama import FusedLlama, unsupported_reason

__all__ = ["FusedLlama", "unsupported_reason"]

warnings.warn("speculum.models.fused_llama is deprecated: import from speculum.models.hf.fused_llama",
              DeprecationWarning, stacklevel=2)
