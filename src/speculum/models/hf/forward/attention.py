"""Causal attention in which every query row is a function of its own query, keys and values alone.

Why: a decode step attends one query per sequence, a speculative verification several, a packed forward
the blocks of many sequences, a prompt hundreds of queries at once. PyTorch's CPU attention kernel
(``scaled_dot_product_attention``, flash-style) blocks the queries and the keys by the sizes it is given,
so the same query row gets other float rounding beside other queries or other (masked) keys. Wherever a
next product rounds its input (bfloat16 weights), or a greedy choice sits at a near-tie, that rounding
changes tokens: speculative output would differ from plain output, and a server's answer from its answer
under another load.

How: each row is computed in a shape fixed by its own position ``p`` alone. It attends keys
``[0, span)`` with ``span`` = :func:`keys_needed` of ``p + 1`` (rounded up to a multiple of 16 within
the first 64 keys, of 64 beyond), the keys after ``p`` masked (weight exactly zero; their contents only
need to be finite), and on a sliding-window layer of window ``w`` those before ``p - w + 1`` too, its keys
then starting at :func:`keys_from` (that window's first key rounded down to a multiple of 64). The heads that share a key/value
head form the query rows of one attention item, ``(heads_per_kv, span)``, so every row is the same set of
items whatever else is in the forward. The rows of one sequence with the same span go in one kernel call
along its batch dimension, which the kernel computes item by item: :func:`items_are_independent` checks
that once per process on this machine's kernel, and where it fails every row gets a call of its own (the
same shapes, slower).

Guarantee: ROW-CANONICAL, each row's output bitwise the same in any block, batch or packing; relative to
exact attention, float32 rounding (the kernel's own, at the row's canonical shape).

Example:
    >>> q = torch.randn(1, 4, 3, 8)                      # (batch, heads, rows, head_dim) at positions 5, 6, 7
    >>> keys = values = torch.randn(1, 2, KEY_BLOCK, 8)  # (batch, kv_heads, >= keys_needed(8), head_dim)
    >>> rows = RowAttention(past=5, n=3)(q, keys, values, scale=8 ** -0.5)
    >>> torch.equal(rows[:, :, 1:2], RowAttention(past=6, n=1)(q[:, :, 1:2], keys, values, scale=8 ** -0.5))
    True
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["RowAttention", "SlotRows", "KEY_BLOCK", "keys_needed", "keys_from", "items_are_independent"]

KEY_BLOCK = 64      # past the first KEY_BLOCK keys a row's span is a multiple of this (one call per 64 rows)
SHORT_BLOCK = 16    # within them, a multiple of this: short contexts (enumerated prefixes) pad little


def keys_needed(end: int) -> int:
    """Keys the rows of positions below ``end`` read: ``end`` rounded up to a multiple of
    :data:`SHORT_BLOCK` up to :data:`KEY_BLOCK`, of :data:`KEY_BLOCK` beyond."""
    block = SHORT_BLOCK if end <= KEY_BLOCK else KEY_BLOCK
    return -(-end // block) * block


def keys_from(position: int, window: int | None) -> int:
    """The first key a row at ``position`` reads: 0 under full attention; on a sliding-window layer its
    window's first key rounded down to a multiple of :data:`KEY_BLOCK` (a function of the position alone, so
    the row's shape stays canonical, and a long context's sliding layers read about ``window + 64`` keys)."""
    if window is None:
        return 0
    return max(0, position - window + 1) // KEY_BLOCK * KEY_BLOCK


def _mask(limits: torch.Tensor, span: int, window: int | None = None) -> torch.Tensor:
    """Additive masks ``(items, 1, 1, span)``: item i sees keys ``0 .. limits[i]``, only the last ``window``
    of them on a sliding-window layer (transformers' window: key > query - window); built once per forward,
    as a bool mask would be converted in every layer's call."""
    keys, limits = torch.arange(span), limits.view(-1, 1, 1, 1)
    hidden = keys > limits if window is None else (keys > limits) | (keys <= limits - window)
    return torch.zeros(len(limits), 1, 1, span).masked_fill_(hidden, float("-inf"))


@functools.cache
def items_are_independent(kv_heads: int, group: int, head_dim: int) -> bool:
    """True when the attention kernel gives each item ``(kv_heads, group, head_dim)`` of a batched call
    bitwise what it gives that item alone on a contiguous copy of its keys, probed once per process and
    item shape on random items (2 to 33 of them over 16 to 640 keys) reading keys shared by
    every item (expanded), keys of their own as a view of a larger store, and copies of those. Not every
    kernel does: on some, a batch of single-head, single-row items rounds otherwise beside a long span."""
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows, span in ((2, SHORT_BLOCK), (5, KEY_BLOCK), (7, 3 * KEY_BLOCK), (33, 10 * KEY_BLOCK)):
            q = torch.randn(rows, kv_heads, group, head_dim, generator=generator)
            store = [torch.randn(rows + 1, kv_heads, span + KEY_BLOCK, head_dim, generator=generator)
                     for _ in range(2)]
            mask = _mask(torch.randint(0, span, (rows,), generator=generator), span)
            own = [t[1:, :, :span] for t in store]                               # item i: slot i + 1
            shared = [t[:1, :, :span].expand(rows, -1, -1, -1) for t in store]   # every item: slot 0
            for keys, values in (own, [t.contiguous() for t in own], shared, [t.contiguous() for t in shared]):
                together = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
                for i in range(rows):
                    alone = F.scaled_dot_product_attention(q[i:i + 1], keys[i:i + 1].contiguous(),
                                                           values[i:i + 1].contiguous(), attn_mask=mask[i:i + 1])
                    if not torch.equal(alone, together[i:i + 1]):
                        return False
    return True


class RowAttention:
    """The attention of one block of a sequence, rows at positions ``past .. past + n - 1`` (see the
    module): built once per forward, called once per layer. ROW-CANONICAL.

    ``keys`` is how many keys a call reads (:func:`keys_needed` of ``past + n``): the caller's key and
    value tensors must hold at least that many, the block's own keys written, those past it finite.
    ``window``: a sliding-window layer's (each row sees its last ``window`` keys); None, full attention."""

    def __init__(self, past: int, n: int, window: int | None = None) -> None:
        if past < 0 or n < 1 or (window is not None and window < 1):
            raise ValueError(f"a block needs past >= 0, n >= 1 rows and a window >= 1, not past={past}, n={n}, "
                             f"window={window}")
        self.past, self.n = past, n
        self.keys = keys_needed(past + n)
        # (first row, end row, span, mask over keys first .. span - 1, first key): rows sharing both ends
        self.groups: list[tuple[int, int, int, torch.Tensor, int]] = []
        start = 0
        while start < n:
            position = past + start
            span, first = keys_needed(position + 1), keys_from(position, window)
            stop = min(n, span - past)
            if window is not None:          # the next row whose window starts in the next key block
                stop = min(stop, first + KEY_BLOCK + window - 1 - past)
            limits = torch.arange(position, past + stop) - first
            self.groups.append((start, stop, span, _mask(limits, span - first, window), first))
            start = stop

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """``q (batch, heads, n, d)`` attending ``keys`` / ``values (batch, kv_heads, >= self.keys, d)``
        (head ``h`` reads key/value head ``h // (heads // kv_heads)``) -> ``(batch, heads, n, d)``, a
        transposed view of a ``(batch, n, heads, d)`` tensor (what the output projection reads)."""
        batch, heads, n, d = q.shape
        kv_heads = keys.shape[1]
        if n != self.n or keys.shape[2] < self.keys or heads % kv_heads:
            raise ValueError(f"attention of {n} rows on {keys.shape[2]} keys and {kv_heads} key heads does not "
                             f"fit a block of {self.n} rows reading {self.keys} keys with {heads} heads")
        group = heads // kv_heads
        alone = not items_are_independent(kv_heads, group, d)
        rows_first = q.transpose(1, 2)                                        # (batch, n, heads, d)
        out = None if len(self.groups) == 1 else q.new_empty(batch, n, heads, d)
        for start, stop, span, mask, first in self.groups:
            rows, width = stop - start, span - first
            items = rows_first[:, start:stop].reshape(batch * rows, kv_heads, group, d)
            if batch == 1 or rows == 1:     # one sequence's keys for every item, or one item per sequence
                k = keys[:, :, first:span].expand(batch * rows, -1, -1, -1)
                v = values[:, :, first:span].expand(batch * rows, -1, -1, -1)
                item_mask = mask.expand(batch * rows, -1, -1, -1)
            else:       # item (b, row) reads sequence b's keys: row-major over (batch, rows)
                k = keys[:, None, :, first:span].expand(-1, rows, -1, -1, -1).reshape(batch * rows, kv_heads, width, d)
                v = values[:, None, :, first:span].expand(-1, rows, -1, -1, -1).reshape(batch * rows, kv_heads, width,
                                                                                          d)
                item_mask = mask.repeat(batch, 1, 1, 1)
            if alone:
                attended = torch.cat([F.scaled_dot_product_attention(items[i:i + 1], k[i:i + 1], v[i:i + 1],
                                                                     attn_mask=item_mask[i:i + 1], scale=scale)
                                      for i in range(batch * rows)])
            else:
                attended = F.scaled_dot_product_attention(items, k, v, attn_mask=item_mask, scale=scale)
            attended = attended.view(batch, rows, heads, d)
            if out is None:
                return attended.transpose(1, 2)
            out[:, start:stop] = attended
        return out.transpose(1, 2)


class SlotRows:
    """The attention of one row each of several sequences on slots of one store (a decode step): rows with
    the same span attend in one call over the view of the store's slots from the lowest to the highest of
    theirs, each item reading its own slot (a slot in between without such a row computes a dummy item,
    discarded). Each row is the item :class:`RowAttention` gives it alone. ROW-CANONICAL.

    ``slots``, ``positions``: each row's slot and position in its sequence; ``window``: as for
    :class:`RowAttention`."""

    def __init__(self, slots: list[int], positions: list[int], window: int | None = None) -> None:
        self.groups: list[tuple[torch.Tensor, torch.Tensor, int, int, int, torch.Tensor, int]] = []
        ends = [(keys_from(p, window), keys_needed(p + 1)) for p in positions]
        for first, span in sorted(set(ends)):
            rows = [i for i, e in enumerate(ends) if e == (first, span)]
            low, high = min(slots[i] for i in rows), max(slots[i] for i in rows) + 1
            where = torch.tensor([slots[i] - low for i in rows])
            limits = torch.full((high - low,), first, dtype=torch.long)         # a dummy item reads one key
            limits[where] = torch.tensor([positions[i] for i in rows])
            self.groups.append((torch.tensor(rows), where, low, high, span, _mask(limits - first, span - first, window),
                                first))

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """``q (rows, heads, d)`` attending the store's ``keys`` / ``values (slots, kv_heads, >= every row's
        span, d)`` -> ``(rows, heads, d)``."""
        rows_total, heads, d = q.shape
        kv_heads = keys.shape[1]
        group = heads // kv_heads
        out = q.new_empty(rows_total, heads, d)
        alone = not items_are_independent(kv_heads, group, d)
        for rows, where, low, high, span, mask, first in self.groups:
            if alone:
                for row, at in zip(rows.tolist(), (where + low).tolist()):
                    out[row] = F.scaled_dot_product_attention(
                        q[row].view(1, kv_heads, group, d), keys[at:at + 1, :, first:span],
                        values[at:at + 1, :, first:span], attn_mask=mask[at - low:at - low + 1], scale=scale).view(heads, d)
                continue
            items = q.new_zeros(high - low, kv_heads, group, d)
            items[where] = q[rows].view(-1, kv_heads, group, d)
            attended = F.scaled_dot_product_attention(items, keys[low:high, :, first:span],
                                                      values[low:high, :, first:span], attn_mask=mask, scale=scale)
            out[rows] = attended[where].view(-1, heads, d)
        return out
