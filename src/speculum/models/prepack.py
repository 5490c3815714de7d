"""Deprecated alias of :mod:`speculum.models.hf.prepack`; kept for one release."""
from __future__ import annotations

import warnings

from .hf.prepack import (is_prepacked, onednn_available, pack_weight, packed_linear, prepack_linears,
                         unpack_linears, unpacked_copy)

__all__ = ["prepack_linears", "unpack_linears", "unpacked_copy", "is_prepacked", "onednn_available", "pack_weight",
           "packed_linear"]

warnings.warn("speculum.models.prepack is deprecated: import from speculum.models.hf.prepack",
              DeprecationWarning, stacklevel=2)
