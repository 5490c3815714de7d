"""The PyTorch backend's keys and values: the protocol every forward reads a session's cache through, its two
kinds, and the store the sessions of a packed forward share.

Why a package: the cache kinds and the store change together (a slot cache is a slot of the store, a cache
of its own moves into it), and forwards, sessions and the model talk to the protocol only; nothing else
in the backend knows where keys live.

* ``cache.py`` - :class:`KVCache` (the protocol), :class:`OwnCache` (a cache of its own, transformers'
  ``DynamicCache`` inside) and :class:`SlotCache` (a slot of the store);
* ``store.py`` - :class:`KVArena`: the KV store, key and value buffers with a slot per session.

Example:
    >>> import torch
    >>> from speculum.models.hf.kv import KVArena, SlotCache
    >>> cache = SlotCache(KVArena(layers=1, kv_heads=1, head_dim=4, dtype=torch.float32))
    >>> _ = cache.append(torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4), 0)
    >>> cache.length
    3
"""
from __future__ import annotations

from .cache import KVCache, OwnCache, SlotCache
from .store import KVArena

__all__ = ["KVCache", "OwnCache", "SlotCache", "KVArena"]
