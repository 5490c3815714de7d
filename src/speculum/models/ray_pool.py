"""Deprecated alias of :mod:`speculum.distributed.ray_pool` (import ``RayPool``, ``ModelSpec`` and
``ClusterUnreachableError`` from ``speculum.distributed``); kept for one release."""
from __future__ import annotations

import importlib
import warnings

warnings.warn("speculum.models.ray_pool is deprecated: import from speculum.distributed",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    # The pool sits a floor above models: resolved on first use, so models never imports distributed.
    return getattr(importlib.import_module("speculum.distributed.ray_pool"), name)
