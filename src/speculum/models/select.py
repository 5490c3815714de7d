"""Deprecated alias of :mod:`speculum.drafts.registry` (import ``make_draft``, ``check_draft_spec`` and the
registry from ``speculum.drafts``); kept for one release."""
from __future__ import annotations

import importlib
import warnings

warnings.warn("speculum.models.select is deprecated: import from speculum.drafts", DeprecationWarning,
              stacklevel=2)


def __getattr__(name: str):
    # The registry sits a floor above models: resolved on first use, so models never imports drafts.
    return getattr(importlib.import_module("speculum.drafts.registry"), name)
