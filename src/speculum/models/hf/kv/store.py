"""One KV store for many sessions of a model (:class:`KVArena`): the key and value buffers a packed forward
writes in place and attends over once per layer; a session's part of it is a
:class:`~speculum.models.hf.kv.cache.SlotCache`.

The decoding scheduler verifies the blocks of many generations in one packed forward. With a cache per
session, attention runs once per session per layer and every append re-copies the session's keys
(``torch.cat``). With one store, each layer writes every session's new keys and values in place (one
indexed write) and attends once, over a view of the store in which each session's row is masked to its
own keys: a masked key gets weight exactly zero, so the padding adds nothing to the softmax's sums.

Layout: per layer, ``keys`` and ``values`` of shape ``(slots, kv_heads, capacity, head_dim)``; a session
owns a slot and a length. Rolling back sets the length; a session whose cache is garbage-collected frees
its slot. The store grows by doubling (slots or capacity, one copy) and gives its memory back when no slot
is in use. After growing it trims the C heap, so the old buffers leave the process's resident memory.
``lock`` guards the layout: a forward that reads or writes the store holds it, since growing replaces the
buffers. The buffers are inference-mode tensors, written in inference mode only.

Example:
    >>> arena = KVArena(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32)
    >>> slot = arena.allocate(3)
    >>> arena.slots, arena.capacity, arena.in_use
    (4, 256, 1)
    >>> arena.release(slot); arena.keys
    []
"""
from __future__ import annotations

import heapq
import threading

import torch

from ...memory.allocator import trim_heap

__all__ = ["KVArena"]


class KVArena:
    """Key and value buffers shared by the sessions of one model: a slot per session (see the module)."""

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 first_slots: int = 4, first_capacity: int = 256, fill: float | None = 0.0) -> None:
        self.layers, self.kv_heads, self.head_dim, self.dtype = layers, kv_heads, head_dim, dtype
        # What new buffers hold past the sessions' keys: zeros for a reader that attends over a whole slot and
        # masks what lies past a session's length (a masked key still enters q·k, and NaN bits would spread);
        # None (uninitialised) where every reader stays within a session's length: pages never written are
        # then never faulted in or cleared.
        self.fill = fill
        self.first_slots, self.first_capacity = first_slots, first_capacity   # sizes of the first buffers
        self.lock = threading.RLock()
        self.keys: list[torch.Tensor] = []       # per layer (slots, kv_heads, capacity, head_dim)
        self.values: list[torch.Tensor] = []
        self.slots = self.capacity = 0
        self._free: list[int] = []               # a heap: the lowest free slot first keeps views short
        self.in_use = 0

    def bytes_for(self, slots: int, capacity: int) -> int:
        """Bytes the buffers take with ``slots`` slots of ``capacity`` tokens."""
        return 2 * self.layers * slots * self.kv_heads * capacity * self.head_dim * torch.finfo(self.dtype).bits // 8

    def allocate(self, length: int) -> int:
        """A free slot able to hold ``length`` tokens (growing the store if needed)."""
        with self.lock:
            if not self._free:
                self._grow(max(self.first_slots, 2 * self.slots), max(self.capacity, length))
            self.reserve(length)
            self.in_use += 1
            return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        """Give ``slot`` back; with no slot in use the buffers are freed."""
        with self.lock:
            heapq.heappush(self._free, slot)
            self.in_use -= 1
            if self.in_use == 0:
                self.keys, self.values, self.slots, self.capacity, self._free = [], [], 0, 0, []

    def reserve(self, length: int) -> None:
        """Make every slot able to hold ``length`` tokens."""
        with self.lock:
            if length > self.capacity:
                self._grow(self.slots, length)

    @torch.inference_mode()
    def _grow(self, slots: int, length: int) -> None:
        capacity = self.capacity or self.first_capacity
        replacing = self.slots > 0             # buffers to copy from, then free
        while capacity < length:
            capacity *= 2
        shape = (slots, self.kv_heads, capacity, self.head_dim)
        keys, values = ([self._new(shape) for _ in range(self.layers)] for _ in range(2))
        if self.slots:
            for new, old in zip(keys + values, self.keys + self.values):
                new[: self.slots, :, : self.capacity] = old
        for slot in range(self.slots, slots):
            heapq.heappush(self._free, slot)
        self.keys, self.values, self.slots, self.capacity = keys, values, slots, capacity
        if replacing:
            trim_heap()        # the old buffers' blocks, which the C heap would otherwise keep resident

    def _new(self, shape: tuple[int, ...]) -> torch.Tensor:
        empty = torch.empty(shape, dtype=self.dtype)
        return empty if self.fill is None else empty.fill_(self.fill)

