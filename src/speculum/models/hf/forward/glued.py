"""The fused forward's blocks with the work between their products in compiled calls: a handful a block.

Why: on a small model the products are only part of a decode step. Between them a block runs about twenty
small PyTorch operations (RMSNorms, the rotary rotation, residual adds, the gate), each a few microseconds
of dispatch for nanoseconds of arithmetic: on SmolLM2-135M's 30 blocks they cost more than the products.
Here each stretch of row-wise work between two products is one C call
(:mod:`~speculum.models.hf.kernels.row_ops`), and attention one more
(:mod:`~speculum.models.hf.kernels.attention_rows`).

How, per block (``x`` is the residual stream, ``h`` its normalised rows):
  1. ``qkv = products.qkv(h)``; one call adds Qwen2's biases, normalises each query and key head (Gemma 3,
     Qwen3) and rotates them;
  2. the caller's ``attend`` writes the new keys and values and attends (one kernel call);
  3. ``out`` product; one call adds it to ``x`` (after Gemma 3's post-attention norm) and normalises for
     the MLP;
  4. ``gate_up`` product; one call gates (SiLU or GELU-tanh times up); ``down`` product; one call adds it to
     ``x`` (after the post-MLP norm) and normalises with the next block's input norm, or the final norm.

Entry points, one per way the fused forward holds keys: :func:`call` (one cache, a batch of sequences),
:func:`packed` (packed sequences on caches of their own), :func:`packed_on_store` (packed sequences on slots
of one KV store). Where a cache has room (a store's slots; an own cache's buffers), the attention kernel
writes the rows' new keys and values itself before attending.

Every forward runs its blocks on buffers with every product and row operation bound to them once
(:class:`BoundBlocks`). A forward of at most :data:`BOUND_ROWS` rows (decode steps, verification blocks,
packed steps of a few sessions) reuses the buffers kept for its row count: a step then makes the same C
calls without the checks, allocations and argument building around each, and gives bitwise the rows fresh
buffers give (tested). Kept buffers whose calls are all compiled kernels also hold them as one
:class:`~speculum.models.hf.kernels.call_list.CallList`: where the attention gives every layer's arguments
up front (a session's own cache with room on every layer, or the KV store) and nothing may stop the forward
between layers, the whole forward is one call from Python, the same calls in the same order (the same bits,
tested).

Guarantee: the formulas of :class:`~speculum.models.hf.forward.fused.FusedForward`'s PyTorch path, to
float32 rounding (sums in another fixed order, exp by a polynomial: tested against it); ROW-CANONICAL, as
every call is row-wise or computes each row alone. A model takes this path or the PyTorch one at build,
for its whole life.
"""
from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Callable

import torch

from ..kernels.attention_rows import AttentionRows, attention_call
from ..kernels.call_list import CallList, KernelCall, KernelCalls, call_list_unavailable

if TYPE_CHECKING:
    from ..kv.cache import KVCache, SlotCache
    from ..kv.store import KVArena
    from .fused import FusedForward

__all__ = ["run_blocks", "call", "packed", "packed_on_store", "Attend", "BoundBlocks", "BOUND_ROWS",
           "use_call_lists"]

# attend(block index, q (T, heads, d), k (T, kv_heads, d), v (T, kv_heads, d), out (T, heads, d)): writes the
# new keys and values where the forward keeps them, attends into out and returns it.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

BOUND_ROWS = 64         # forwards of at most this many rows run on bound buffers
# False: every forward makes its calls from Python, none as a call list (what benchmarks/call_lists.py compares).
use_call_lists = True


def call(forward: "FusedForward", x: torch.Tensor, tables: dict, cache: "KVCache", positions: torch.Tensor,
         keep: int) -> torch.Tensor:
    """The fused forward's call on one cache: embedded rows ``x (batch, n, hidden)`` at ``positions (1, n)``
    with their rotary ``tables`` -> logits ``(batch, keep or n, vocab)``; row ``(b, t)`` attends sequence
    ``b``'s keys. A batch-1 cache with room takes its new keys from the attention kernel itself."""
    batch, n, hidden = x.shape
    plans = {window: AttentionRows(positions[0].repeat(batch), torch.arange(batch).repeat_interleave(n), window)
             for window in set(forward.windows)}
    row_tables = {kind: (cos[0, 0], sin[0, 0]) if batch == 1 else (cos[0, 0].repeat(batch, 1), sin[0, 0].repeat(batch, 1))
                  for kind, (cos, sin) in tables.items()}
    shape = (batch, n, forward.kv_heads, forward.head_dim)
    room_for = getattr(cache, "room_for", None) if batch == 1 else None
    rooms_for = getattr(cache, "rooms_for", None) if batch == 1 else None

    def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        room = room_for(n, index) if room_for is not None else None
        if room is not None:            # the kernel writes the new keys and values into the cache's room
            return plans[forward.windows[index]](q, *room, forward.scale, out, k, v)
        keys, values = cache.append(k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2), index)
        return plans[forward.windows[index]](q, keys, values, forward.scale, out)

    def layer_arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> list[tuple] | None:
        rooms = rooms_for(n, len(forward.blocks)) if rooms_for is not None else None
        if rooms is None:
            return None
        return _layer_arguments(forward, plans, [room[0] for room in rooms], [room[1] for room in rooms], q, k, v,
                                out)

    attend.layer_arguments = layer_arguments     # type: ignore[attr-defined]
    normed = run_blocks(forward, x.view(batch * n, hidden), row_tables, attend).view(batch, n, hidden)
    if keep:
        normed = normed[:, -keep:]
    return forward.head(normed.reshape(-1, hidden)).view(batch, normed.shape[1], -1)


def packed(forward: "FusedForward", x: torch.Tensor, tables: dict, pasts: list[int], bounds: list[int],
           caches: list["KVCache"], keep: list[int] | None) -> list[torch.Tensor]:
    """The fused forward's packed sequences on caches of their own (``x (1, T, hidden)``, sequence ``b`` rows
    ``bounds[b]:bounds[b+1]`` after ``pasts[b]`` cached tokens): each sequence's rows attend its own cache, one
    kernel call a sequence and layer -> each sequence's kept logits."""
    lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    plans = {window: [AttentionRows(torch.arange(n) + past, torch.zeros(n, dtype=torch.long), window)
                      for past, n in zip(pasts, lengths)] for window in set(forward.windows)}

    room_fors = [getattr(cache, "room_for", None) for cache in caches]

    def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for b, (cache, plan) in enumerate(zip(caches, plans[forward.windows[index]])):
            at = slice(bounds[b], bounds[b + 1])
            room = room_fors[b](lengths[b], index) if room_fors[b] is not None else None
            if room is not None:        # the kernel writes the new keys and values into the cache's room
                plan(q[at], *room, forward.scale, out[at], k[at], v[at])
                continue
            keys, values = cache.append(k[at].unsqueeze(0).transpose(1, 2), v[at].unsqueeze(0).transpose(1, 2), index)
            plan(q[at], keys, values, forward.scale, out[at])
        return out

    with contextlib.ExitStack() as held:
        for cache in caches:
            held.enter_context(cache.exclusive())
        normed = run_blocks(forward, x[0], {kind: (cos[0, 0], sin[0, 0]) for kind, (cos, sin) in tables.items()},
                            attend)
    return forward.kept_logits(normed.unsqueeze(0), bounds, keep, normed=True)


def packed_on_store(forward: "FusedForward", x: torch.Tensor, tables: dict, position: torch.Tensor,
                    slot: torch.Tensor, pasts: list[int], lengths: list[int], bounds: list[int],
                    caches: list["SlotCache"], arena: "KVArena", keep: list[int] | None) -> list[torch.Tensor]:
    """The fused forward's packed sequences on slots of one KV store (row ``t`` at ``position[t]`` in slot
    ``slot[t]``): every row of every sequence attends in one kernel call a layer, which first writes the rows'
    new keys and values at their slots and positions -> each sequence's kept logits."""
    plans = {window: AttentionRows(position, slot, window) for window in set(forward.windows)}

    def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return plans[forward.windows[index]](q, arena.keys[index], arena.values[index], forward.scale, out, k, v)

    def layer_arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> list[tuple] | None:
        return _layer_arguments(forward, plans, arena.keys, arena.values, q, k, v, out)

    attend.layer_arguments = layer_arguments     # type: ignore[attr-defined]
    normed = run_blocks(forward, x[0], {kind: (cos[0, 0], sin[0, 0]) for kind, (cos, sin) in tables.items()}, attend)
    for cache, past, n in zip(caches, pasts, lengths):
        cache.filled_to(past + n)
    return forward.kept_logits(normed.unsqueeze(0), bounds, keep, normed=True)


def _layer_arguments(forward: "FusedForward", plans: dict, keys: list[torch.Tensor], values: list[torch.Tensor],
                     q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> list[tuple] | None:
    """Each layer's attention kernel arguments (``plans`` by window; layer ``i`` on ``keys[i]``, ``values[i]``,
    writing ``k``, ``v`` there first), or None where there are no rows."""
    found: list[tuple] = [()] * len(forward.blocks)
    for window, plan in plans.items():
        layers = [index for index, each in enumerate(forward.windows) if each == window]
        arguments = plan.layer_arguments(q, [keys[i] for i in layers], [values[i] for i in layers], forward.scale,
                                         out, k, v)
        if arguments is None:
            return None
        for index, each in zip(layers, arguments):
            found[index] = each
    return found


def run_blocks(forward: "FusedForward", x: torch.Tensor, tables: dict, attend: Attend) -> torch.Tensor:
    """Every block of ``forward`` over the embedded rows ``x (T, hidden)``, with ``tables`` ``{layer kind: (cos,
    sin)}`` each ``(T, head_dim)`` (rows contiguous, any row stride) -> the rows after the final norm,
    ``(T, hidden)``, what the vocabulary head multiplies. At most :data:`BOUND_ROWS` rows run on the buffers
    the forward keeps for their count; more rows, or buffers in use by another thread, on buffers of the
    call's own (the same calls, bound once more)."""
    rows = x.shape[0]
    bound = forward.bound_blocks.get(rows) if rows <= BOUND_ROWS else None
    if bound is None:
        return BoundBlocks(forward, rows)(x, tables, attend)
    with bound.lock:
        # A copy: once the lock is let go, another thread's forward of as many rows may refill the buffers.
        return bound(x, tables, attend).clone()


class BoundBlocks:
    """The blocks for forwards of ``rows`` rows on buffers of its own: each product and row operation bound to
    them once (``bind``), so a forward calls each with the thread count alone. ``lock`` is held while a forward
    runs on buffers a forward keeps; a forward that finds it held makes buffers of its own. The calls a block
    makes are the module's steps 1 to 4."""

    def __init__(self, forward: "FusedForward", rows: int, shared: "SharedBuffers | None" = None) -> None:
        ops, blocks = forward.row_ops, forward.blocks
        heads, kv_heads, dim = forward.heads, forward.kv_heads, forward.head_dim
        hidden, inner = forward.embed.shape[1], forward.intermediate
        # Buffers of its own, or the first `rows` rows of buffers shared by every row count (and their lock).
        buffer = (lambda *shape: torch.empty(rows, *shape)) if shared is None else shared.rows(rows)
        self.lock = threading.Lock() if shared is None else shared.lock
        self.x, self.normed = buffer(hidden), buffer(hidden)
        self.tables = {kind: (buffer(dim), buffer(dim)) for kind in sorted(set(forward.rotary_kinds))}
        self.qkv = buffer((heads + 2 * kv_heads) * dim)
        k_from, v_from = heads * dim, (heads + kv_heads) * dim
        self.q = self.qkv[:, :k_from].view(rows, heads, dim)
        self.k = self.qkv[:, k_from:v_from].view(rows, kv_heads, dim)
        self.v = self.qkv[:, v_from:].view(rows, kv_heads, dim)
        self.attended = buffer(heads, dim)
        self.projected, self.mlp = buffer(hidden), buffer(hidden)
        self.gate_up, self.gated = buffer(2 * inner), buffer(inner)
        first = blocks[0].attn_norm
        self.first_norm = ops.norm(self.x, first.weight, first.eps, self.normed, bind=True)
        self.between_layers = forward.interruption.between_layers
        self.layers = []
        for index, block in enumerate(blocks):
            cos, sin = self.tables[forward.rotary_kinds[index]]
            head_norm, after_attention, after_mlp = block.qk_norm, block.attn_out_norm, block.mlp_out_norm
            following = blocks[index + 1].attn_norm if index + 1 < len(blocks) else forward.norm
            self.layers.append((
                block.qkv.bind(self.normed, self.qkv),
                ops.rotate(self.qkv, heads, kv_heads, dim, cos, sin, block.qkv_bias,
                           None if head_norm is None else head_norm.weight,
                           0.0 if head_norm is None else head_norm.eps, bind=True),
                block.out.bind(self.attended.view(rows, k_from), self.projected),
                ops.residual_norm(self.x, self.projected, block.mlp_norm.weight, block.mlp_norm.eps, self.normed,
                                  None if after_attention is None else after_attention.weight,
                                  0.0 if after_attention is None else after_attention.eps, bind=True),
                block.gate_up.bind(self.normed, self.gate_up),
                ops.gated(self.gate_up, forward.activation_name, self.gated, bind=True),
                block.down.bind(self.gated, self.mlp),
                ops.residual_norm(self.x, self.mlp, following.weight, following.eps, self.normed,
                                  None if after_mlp is None else after_mlp.weight,
                                  0.0 if after_mlp is None else after_mlp.eps, bind=True),
            ))
        self.interruption = forward.interruption
        # kept buffers only: a call list takes longer to build than the one forward of a passing shape saves
        listed = _call_list(self.first_norm, self.layers) if shared is not None else None
        self.calls, self.attention_at = listed if listed is not None else (None, [])

    def __call__(self, x: torch.Tensor, tables: dict, attend: Attend) -> torch.Tensor:
        """The blocks over ``x`` on the bound buffers (see :func:`run_blocks`; where the buffers are a
        forward's to keep, the caller holds ``lock``) -> the normed rows, a buffer of this object."""
        self.x.copy_(x)
        for kind, (cos, sin) in self.tables.items():
            cos.copy_(tables[kind][0])
            sin.copy_(tables[kind][1])
        threads = torch.get_num_threads()
        q, k, v, attended = self.q, self.k, self.v, self.attended
        # One C call for the whole forward where attend gives every layer's arguments up front; a forward
        # that may be stopped between layers makes its calls from here.
        layer_arguments = getattr(attend, "layer_arguments", None)
        if (self.calls is not None and layer_arguments is not None and use_call_lists
                and not self.interruption.stoppable()):
            found = layer_arguments(q, k, v, attended)
            if found is not None:
                for at, arguments in zip(self.attention_at, found):
                    self.calls.set_arguments(at, arguments)
                self.calls(threads)
                return self.normed
        self.first_norm(threads)
        between_layers = self.between_layers
        for index, (qkv, rotate, out, attention_residual, gate_up, gated, down, mlp_residual) in enumerate(self.layers):
            between_layers()
            qkv(threads)
            rotate(threads)
            attend(index, q, k, v, attended)
            out(threads)
            attention_residual(threads)
            gate_up(threads)
            gated(threads)
            down(threads)
            mlp_residual(threads)
        return self.normed


def _call_list(first_norm: Callable[[int], None], layers: list[tuple]) -> tuple[CallList, list[int]] | None:
    """A forward's calls as one :class:`CallList` (the first norm, then each layer's qkv product, rotation,
    attention, then the rest of the layer; a product of several weight kinds as its parts' calls) and the
    index of each layer's attention record, whose arguments each forward sets; None where call lists are
    unavailable or a call has no record."""
    if call_list_unavailable() is not None:
        return None
    attention = attention_call()
    calls, attention_at = [], []
    for call in [first_norm] + [call for layer in layers for call in (*layer[:2], None, *layer[2:])]:
        if call is None:
            attention_at.append(len(calls))
            calls.append(attention)
            continue
        for each in call.calls if isinstance(call, KernelCalls) else [call]:
            if not isinstance(each, KernelCall) or each.kind is None:
                return None
            calls.append(each)
    return CallList(calls), attention_at


class SharedBuffers:
    """The buffers of :data:`BOUND_ROWS` rows that a forward's kept :class:`BoundBlocks` of every row count take
    their first rows of (one forward runs on them at a time: ``lock``): the row counts of a server's steps
    vary from step to step, and each is bound once, on memory allocated once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._buffers: list[torch.Tensor] = []
        self._taken = 0

    def rows(self, rows: int) -> Callable[..., torch.Tensor]:
        """A maker of the next buffers, in the order a :class:`BoundBlocks` asks for them: the first ``rows``
        rows of the shared buffer of that place and width (allocated by the first to ask)."""
        self._taken = 0

        def buffer(*shape: int) -> torch.Tensor:
            if self._taken == len(self._buffers):
                self._buffers.append(torch.empty(BOUND_ROWS, *shape))
            kept = self._buffers[self._taken]
            if tuple(kept.shape[1:]) != shape:
                raise ValueError(f"shared buffer {self._taken} is {tuple(kept.shape)}, asked for rows of {shape}")
            self._taken += 1
            return kept[:rows]

        return buffer


class BoundShapes:
    """A forward's :class:`BoundBlocks` by row count (up to :data:`BOUND_ROWS`), made on first use and kept, all
    on one set of :class:`SharedBuffers`."""

    def __init__(self, forward: "FusedForward") -> None:
        self.forward = forward
        self.shapes: dict[int, BoundBlocks] = {}
        self.lock = threading.Lock()
        self.shared = SharedBuffers()

    def get(self, rows: int) -> BoundBlocks | None:
        """The bound blocks for ``rows`` rows, or None where the shared buffers are in use by another thread."""
        with self.lock:
            bound = self.shapes.get(rows)
            if bound is None:
                bound = self.shapes[rows] = BoundBlocks(self.forward, rows, self.shared)
        return None if bound.lock.locked() else bound      # the shared buffers' lock
