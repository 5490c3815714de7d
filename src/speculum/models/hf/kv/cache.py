"""A session's keys and values as one object (:class:`KVCache`), in two kinds: a cache of its own
(:class:`OwnCache`, transformers' ``DynamicCache`` inside) and a slot of the model's KV store
(:class:`SlotCache`, in a :class:`~speculum.models.hf.kv.store.KVArena`).

Forwards, sessions and the model talk to the protocol only. What differs between the kinds - where the
keys live, whether transformers' own forward can read them, how they join the store, how a
layer-truncated draft adopts them - is a method of each kind, never a type test by a caller.

Guarantee: under the same appends and trims both kinds hold the same keys and values, bit for bit (an
append copies its tensors, a trim only forgets; neither computes), so a session's rows do not depend on
which kind holds its cache.

Example:
    >>> from speculum.models.hf.kv.store import KVArena
    >>> own = OwnCache()
    >>> slot = SlotCache(KVArena(layers=1, kv_heads=1, head_dim=4, dtype=torch.float32))
    >>> for cache in (own, slot):
    ...     keys, values = cache.append(torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4), 0)
    ...     cache.trim(1)
    >>> own.length, slot.length, tuple(keys.shape)
    (2, 2, (1, 1, 3, 4))
    >>> torch.equal(own.view(0)[0], slot.view(0)[0]), slot.store is not None, own.store
    (True, True, None)
"""
from __future__ import annotations

import contextlib
import copy
import weakref
from typing import Any, ContextManager, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from .store import KVArena

__all__ = ["KVCache", "OwnCache", "SlotCache"]


@runtime_checkable
class KVCache(Protocol):
    """The keys and values of every layer of one sequence (batch 1 for a session), as forwards read them.

    Declared capabilities: ``is_trimmable`` (``trim`` forgets tokens without recomputing anything),
    ``store`` (the store the cache is a slot of, None for a cache of its own) and ``transformers_cache``
    (the object transformers' own forward reads and writes, None when only the fused forward can)."""

    @property
    def is_trimmable(self) -> bool:
        ...

    @property
    def store(self) -> KVArena | None:
        ...

    @property
    def transformers_cache(self) -> Any:
        ...

    @property
    def length(self) -> int:
        """Tokens held by every layer (read it before or after a forward, not between its layers)."""

    def append(self, keys: torch.Tensor, values: torch.Tensor, layer: int, span: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``keys`` / ``values (batch, kv_heads, n, head_dim)`` after the held tokens of ``layer``;
        returns what attention reads for that layer, ``(batch, kv_heads, max(length + n, span), head_dim)``:
        the keys past ``length + n`` (up to ``span``) are finite and otherwise unspecified, for attention
        that masks them (:mod:`~speculum.models.hf.forward.attention`). The length moves once every layer of a
        forward is written."""

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s held keys and values, ``(batch, kv_heads, length, head_dim)`` (not to be written)."""

    def trim(self, n: int) -> None:
        """Forget the last ``n`` tokens (``0 <= n <= length``); ``ValueError`` otherwise."""

    def cut_to(self, length: int) -> None:
        """Hold the first ``length`` tokens on every layer again, after a forward stopped between two layers
        (:mod:`~speculum.models.interruption`) left the layers it wrote longer than the others. ``length`` is
        the cache's length before that forward."""

    def exclusive(self) -> ContextManager[Any]:
        """A context during which the cache's buffers stay where they are: what a forward holds."""

    def into_store(self, store: KVArena) -> "KVCache":
        """A cache in a slot of ``store`` holding these keys and values (itself when already there)."""

    def prefix_layers(self, count: int, config: Any) -> "OwnCache | None":
        """A cache of its own holding the first ``count`` layers, for a model of ``config`` that is this
        cache's model truncated to them (the layer draft); None when the layout does not allow it."""


class OwnCache:
    """Keys and values of its own: transformers' ``DynamicCache`` (any batch size), which transformers'
    forward reads too. Appends concatenate (a copy per append), except the fused forward's batch-1 appends,
    which write into buffers with room; trims crop (a view, no copy).

    Args:
        config: the model's config (lays out one cache layer per model layer); None lays layers out as
            appends reach them.
        dynamic: an existing ``DynamicCache`` to hold instead of a new one (taken, not copied).
    """

    def __init__(self, config: Any = None, *, dynamic: Any = None) -> None:
        if dynamic is None:
            from transformers import DynamicCache       # transformers loads in seconds: only when a cache is made

            dynamic = DynamicCache(config=config)
        self.config = config
        self.dynamic = dynamic
        self._room: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}    # layer -> (keys, values) with room

    @property
    def is_trimmable(self) -> bool:
        # transformers declares it per layer: a sliding-window layer past its window forgets keys for good.
        return all(getattr(layer, "is_croppable", True) for layer in getattr(self.dynamic, "layers", ()))

    @property
    def store(self) -> None:
        return None

    @property
    def transformers_cache(self) -> Any:
        return self.dynamic

    @property
    def length(self) -> int:
        return int(self.dynamic.get_seq_length())

    def append(self, keys: torch.Tensor, values: torch.Tensor, layer: int, span: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
        held = self._held(layer)
        if held is not None:
            return self._append_in_room(held, keys, values, layer, span)
        keys, values = self.dynamic.update(keys, values, layer)
        if span > keys.shape[2]:        # zeros past the held keys (a copy: the cache holds exactly its keys)
            pad = (0, 0, 0, span - keys.shape[2])
            keys, values = F.pad(keys, pad), F.pad(values, pad)
        return keys, values

    def _append_in_room(self, held: Any, keys: torch.Tensor, values: torch.Tensor, layer: int, span: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """An append written in place into buffers with room (grown by doubling), the layer holding views of
        them: no copy of the held keys per token, and the zeros up to ``span`` are already there. Only this
        cache writes its buffers, and only past its length, so caches sharing its layers
        (:meth:`prefix_layers`) keep theirs; a trim drops the buffers, so a write never lands inside a length
        another cache shares."""
        held_keys, held_values = held.keys, held.values
        length = held_keys.shape[2]
        end = length + keys.shape[2]
        reach = max(end, span)
        room = self._room_reaching(layer, held, reach)
        if room is None:
            previous = self._room.get(layer)
            capacity = reach if previous is None else max(reach, 2 * previous[0].shape[2])
            room = tuple(old.new_empty(old.shape[0], old.shape[1], capacity, old.shape[3])
                         for old in (held_keys, held_values))
            for buffer, old in zip(room, (held_keys, held_values)):
                buffer[:, :, :length] = old
                buffer[:, :, end:].zero_()      # read up to span as zeros: finite, masked
            self._room[layer] = room
        room[0][:, :, length:end], room[1][:, :, length:end] = keys, values
        self._count(held, room, end)
        return room[0][:, :, :reach], room[1][:, :, :reach]

    def room_for(self, n: int, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Room for ``n`` more keys and values on ``layer``, counted as held: the layer's keys and values
        ``(batch, kv_heads, length + n, head_dim)`` whose last ``n`` positions the caller writes before anything
        reads them (what an attention kernel that writes its rows' keys does). None where the layer holds no
        buffers with room yet (its first append): call :meth:`append` then."""
        ahead = self._room_ahead(n, layer)
        return None if ahead is None else self._count(*ahead)

    def rooms_for(self, n: int, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """:meth:`room_for` of layers ``0 .. layers - 1``, or None (and nothing counted) where any of them has
        no room: a forward that writes every layer's keys itself, or none."""
        found = []
        for layer in range(layers):
            ahead = self._room_ahead(n, layer)
            if ahead is None:
                return None
            found.append(ahead)
        return [self._count(*ahead) for ahead in found]

    def _room_ahead(self, n: int, layer: int) -> tuple[Any, tuple[torch.Tensor, torch.Tensor], int] | None:
        """(the layer's held keys, its buffers, its length + ``n``) where the buffers have room for ``n`` more,
        else None; nothing counted."""
        held = self._held(layer)
        if held is None:
            return None
        end = held.keys.shape[2] + n
        room = self._room_reaching(layer, held, end)
        return None if room is None else (held, room, end)

    @staticmethod
    def _count(held: Any, room: tuple[torch.Tensor, torch.Tensor], end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values counted as held up to ``end`` (views of its buffers)."""
        held.keys, held.values = room[0][:, :, :end], room[1][:, :, :end]
        return held.keys, held.values

    def _held(self, layer: int) -> Any:
        """The layer's transformers ``DynamicLayer`` where it holds keys already (appends then go into room of
        this cache's own), else None."""
        layers = getattr(self.dynamic, "layers", None)
        held = layers[layer] if isinstance(layers, list) and layer < len(layers) else None
        return held if type(held).__name__ == "DynamicLayer" and getattr(held, "is_initialized", False) else None

    def _room_reaching(self, layer: int, held: Any, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's buffers where the layer's keys are views of them and they reach ``end`` positions, else
        None."""
        room = self._room.get(layer)
        if room is None or room[0].shape[2] < end or room[0].data_ptr() != held.keys.data_ptr():
            return None
        return room

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        held = self.dynamic.layers[layer]
        if held.keys is None:
            raise ValueError(f"layer {layer} of this cache has held no keys yet")
        return held.keys, held.values

    def trim(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"trim({n}) of a cache holding {self.length} tokens")
        if n:                       # crop(0) may still shorten a sliding-window layer: nothing to forget, no call
            self.dynamic.crop(-n)
            self._room.clear()

    def cut_to(self, length: int) -> None:
        # Per layer: a stopped forward wrote only its first layers. Their buffers with room are kept, since
        # what was written past `length` is not shared (a cache is forked between forwards, never during one).
        for layer in getattr(self.dynamic, "layers", ()):
            extra = layer.get_seq_length() - length
            if extra > 0:
                layer.crop(-extra)

    def exclusive(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def into_store(self, store: KVArena) -> "SlotCache":
        return SlotCache.holding(store, self)

    def prefix_layers(self, count: int, config: Any) -> "OwnCache | None":
        layers = getattr(self.dynamic, "layers", None)
        if not isinstance(layers, list) or len(layers) < count:
            return None
        adopted = OwnCache(config)
        if not isinstance(getattr(adopted.dynamic, "layers", None), list):
            return None
        # Shallow copies: appending or cropping re-binds a copy's tensors and leaves this cache's alone.
        adopted.dynamic.layers = [copy.copy(layer) for layer in layers[:count]]
        return adopted

    def rows(self, index: torch.Tensor) -> "OwnCache":
        """A new cache whose batch row i is row ``index[i]`` (``(batch,)`` long) of this one, which is left
        untouched. Layer objects are shallow-copied (``batch_select_indices`` re-binds their tensors, never
        writes them), so this works for every cache-layer kind of the installed transformers."""
        if self.length == 0:        # nothing encoded yet: a fresh cache serves any batch size
            return OwnCache(self.config)
        clone = copy.copy(self.dynamic)
        clone.layers = [copy.copy(layer) for layer in self.dynamic.layers]
        clone.batch_select_indices(index)
        return OwnCache(self.config, dynamic=clone)


class SlotCache:
    """Keys and values in a slot of a :class:`~speculum.models.hf.kv.store.KVArena` (batch 1): appends
    write in place, a trim sets the length, and the slot goes back to the store when the cache is
    garbage-collected. Only the fused forward reads it (``transformers_cache`` is None)."""

    is_trimmable = True
    transformers_cache = None

    def __init__(self, arena: KVArena, length: int = 0) -> None:
        self.arena = arena
        self.slot = arena.allocate(length)
        self._length = 0
        weakref.finalize(self, arena.release, self.slot)

    @classmethod
    @torch.inference_mode()
    def holding(cls, arena: KVArena, cache: KVCache) -> "SlotCache":
        """A slot of ``arena`` holding copies of what the batch-1 ``cache`` holds (``cache`` is left as it is)."""
        length = cache.length
        slot_cache = cls(arena, length)
        if length:
            with arena.lock:
                for layer in range(arena.layers):
                    keys, values = cache.view(layer)
                    arena.keys[layer][slot_cache.slot, :, :length] = keys[0]
                    arena.values[layer][slot_cache.slot, :, :length] = values[0]
        slot_cache.filled_to(length)
        return slot_cache

    @property
    def store(self) -> KVArena:
        return self.arena

    @property
    def length(self) -> int:
        return self._length

    @torch.inference_mode()
    def append(self, keys: torch.Tensor, values: torch.Tensor, layer: int, span: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
        arena, end = self.arena, self._length + keys.shape[2]
        if layer == 0:
            arena.reserve(max(end, span))
        arena.keys[layer][self.slot, :, self._length:end] = keys[0]
        arena.values[layer][self.slot, :, self._length:end] = values[0]
        if layer == arena.layers - 1:
            self._length = end
        own, read = slice(self.slot, self.slot + 1), max(end, span)     # past end: zeros or a trimmed key
        return arena.keys[layer][own, :, :read], arena.values[layer][own, :, :read]

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        own = slice(self.slot, self.slot + 1)
        return self.arena.keys[layer][own, :, : self._length], self.arena.values[layer][own, :, : self._length]

    def trim(self, n: int) -> None:
        if not 0 <= n <= self._length:
            raise ValueError(f"trim({n}) of a cache holding {self._length} tokens")
        self._length -= n

    def cut_to(self, length: int) -> None:
        # The length moves when a forward's last layer is written: a stopped forward left it as it was.
        if not 0 <= length <= self._length:
            raise ValueError(f"cut_to({length}) of a cache holding {self._length} tokens")
        self._length = length

    def filled_to(self, length: int) -> None:
        """Record that this slot's keys and values of every layer are written up to ``length`` tokens by a
        writer other than :meth:`append` (a packed forward's one indexed write for many slots, a copy)."""
        self._length = length

    def exclusive(self) -> ContextManager[Any]:
        return self.arena.lock

    def into_store(self, store: KVArena) -> "SlotCache":
        return self if store is self.arena else SlotCache.holding(store, self)

    @torch.inference_mode()
    def prefix_layers(self, count: int, config: Any) -> OwnCache | None:
        if self.arena.layers < count:
            return None
        adopted = OwnCache(config)
        with self.arena.lock:
            for layer in range(count):
                # DynamicCache.update concatenates: it keeps a copy, not a view of the store.
                adopted.append(*self.view(layer), layer)
        return adopted
