"""Deprecated alias of :mod:`speculum.models.hf.kv_arena` (``KVArena``) and :mod:`speculum.models.hf.kv_cache`
(``SlotCache``); kept for one release."""
from __future__ import annotations

import warnings

from .hf.kv_arena import KVArena
from .hf.kv_cache import SlotCache

__all__ = ["KVArena", "SlotCache"]

warnings.warn("speculum.models.kv_arena is deprecated: import from speculum.models.hf.kv_arena and "
              "speculum.models.hf.kv_cache", DeprecationWarning, stacklevel=2)
