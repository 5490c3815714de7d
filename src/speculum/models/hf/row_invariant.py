"""Several sequences' tokens in one forward, each sequence's rows bitwise what it gets in that forward alone.

Why: scoring prompts for an evaluator is many short forwards (the part of each prompt not shared with one
scored before), and on a CPU a short forward costs about one read of every weight, however few its rows.
Packing the chunks of several prompts into one forward reads the weights once for all of them. The
answers must not depend on what else was packed (an evaluation must give the same log-likelihoods at any
concurrency), which rounding does not promise in general: a matrix kernel may pick another algorithm,
blocking or reduction order for another number of rows.

How: only the matrix products run over the packed rows; attention runs per sequence with the shapes it
has alone. The other operations are row-wise (RMSNorm over each row's features, rotary tables per
position, SiLU and sums per element). :class:`RowInvariantForward` checks that property on this
machine's kernels once, before it first packs:

* every product (per block: query/key/value, output, gate/up, down; the vocabulary head) on random rows
  gives each row bitwise the same for every row count from 2 to :data:`MAX_ROWS` and every offset tried
  (one-row products are padded to two: a kernel's matrix-vector path differs from its matrix one);
* a probe of three sequences packed equals each sequence alone, bitwise, through the whole forward.

Where the check fails (a kernel that depends on the row count, such as dynamically quantised int8
products, whose activation scale is the whole batch's) every sequence gets a forward of its own: the same
rows, without the saving. Guarantee: BATCH-INVARIANT, each sequence's logits a function of its own tokens
and cache alone; relative to transformers' forward the fused forward's float32 rounding (see
``fused_llama.py``).

Example:
    >>> forward = RowInvariantForward(FusedLlama.build(model.module))          # doctest: +SKIP
    >>> a, b = forward([[1, 2, 3], [4, 5]], [OwnCache(model.config), OwnCache(model.config)])  # doctest: +SKIP
    >>> a.shape, b.shape                                                        # doctest: +SKIP
    (torch.Size([3, 49152]), torch.Size([2, 49152]))
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Callable

import torch
import torch.nn.functional as F

from .fused_llama import FusedLlama, rms_norm
from .kv_cache import KVCache, OwnCache
from .prepack import PROBE_ROWS, gives_rows_alone

__all__ = ["RowInvariantForward", "MAX_ROWS"]

MAX_ROWS = PROBE_ROWS   # most rows one packed forward holds (and the range the load check covers)


def _product_rows(product: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """``product(rows)``, a single row padded to two (so it takes the matrix path, as packed rows do)."""
    if rows.shape[0] == 1:
        return product(torch.cat([rows, rows]))[:1]
    return product(rows)


class RowInvariantForward:
    """``(token_lists, caches) -> [logits (len(tokens), vocab)]``: each sequence's tokens read after its
    cache (extended in place), packed into forwards of at most :data:`MAX_ROWS` rows where the load check
    passes (see the module docstring), else one forward per sequence. BATCH-INVARIANT."""

    def __init__(self, fused: FusedLlama) -> None:
        self.fused = fused
        self._packs: bool | None = None          # decided by the first call (the load check)

    @property
    def packs(self) -> bool:
        """True when sequences are packed into shared forwards (the kernels passed the check)."""
        if self._packs is None:
            self._packs = self._rows_independent() and self._probe_agrees()
        return self._packs

    @torch.inference_mode()
    def __call__(self, token_lists: list[list[int]], caches: list[KVCache]) -> list[torch.Tensor]:
        if not token_lists:
            return []
        if any(not tokens for tokens in token_lists):
            raise ValueError("every sequence needs at least one token")
        if not self.packs:
            return [self._forward([tokens], [cache])[0] for tokens, cache in zip(token_lists, caches)]
        out: list[torch.Tensor] = []
        group: list[int] = []
        rows = 0
        for b, tokens in enumerate(token_lists):
            # A sequence longer than MAX_ROWS goes alone: its row count is its own, whatever is packed.
            if group and rows + len(tokens) > MAX_ROWS:
                out += self._forward([token_lists[i] for i in group], [caches[i] for i in group])
                group, rows = [], 0
            group.append(b)
            rows += len(tokens)
        out += self._forward([token_lists[i] for i in group], [caches[i] for i in group])
        return out

    def _forward(self, token_lists: list[list[int]], caches: list[KVCache]) -> list[torch.Tensor]:
        fused = self.fused
        lengths = [len(tokens) for tokens in token_lists]
        bounds = [0, *itertools.accumulate(lengths)]                            # sequence b: bounds[b]:bounds[b+1]
        ids = torch.tensor([t for tokens in token_lists for t in tokens])       # (T,)
        x = fused.embedded(ids)                                                 # (T, hidden)
        tables, masks = [], []
        for b, (n, cache) in enumerate(zip(lengths, caches)):
            past = cache.length
            positions = (torch.arange(n) + past).unsqueeze(0)                   # (1, n)
            tables.append([t.unsqueeze(1) for t in fused.rotary(x[None, bounds[b]:bounds[b + 1]], positions)])
            masks.append(None if n == 1 else torch.ones(n, past + n, dtype=torch.bool).tril(diagonal=past))
        heads, d = fused.heads, fused.head_dim
        with contextlib.ExitStack() as held:
            for cache in caches:
                held.enter_context(cache.exclusive())
            for index, block in enumerate(fused.blocks):
                qkv = _product_rows(block.qkv, rms_norm(x, block.attn_norm, block.attn_eps))   # (T, q+k+v)
                parts = []
                for b, cache in enumerate(caches):
                    n, (cos, sin) = lengths[b], tables[b]
                    q, k, v = fused.split_heads(qkv[None, bounds[b]:bounds[b + 1]], cos, sin)  # (1, heads, n, d)
                    keys, values = cache.append(k, v, index)
                    attended = fused.attend(q, keys, values, masks[b])                     # (1, heads, n, d)
                    parts.append(attended[0].transpose(0, 1).reshape(n, heads * d))
                x = x + _product_rows(block.out, torch.cat(parts))
                gate, up = _product_rows(block.gate_up, rms_norm(x, block.mlp_norm, block.mlp_eps)).chunk(2, dim=-1)
                x = x + _product_rows(block.down, F.silu(gate) * up)
        logits = _product_rows(fused.head, rms_norm(x, fused.norm, fused.norm_eps))       # (T, vocab)
        return list(logits.split(lengths))

    # ------------------------------------------------------------------------------------ the load check
    def _rows_independent(self) -> bool:
        """Every product gives each row bitwise the same whatever rows surround it (1..MAX_ROWS)."""
        fused = self.fused
        block = fused.blocks[0]
        hidden = fused.embed.shape[1]
        generator = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            intermediate = block.gate_up(torch.zeros(2, hidden)).shape[1] // 2
        probes = [(block.qkv, hidden), (block.out, fused.heads * fused.head_dim), (block.gate_up, hidden),
                  (block.down, intermediate), (fused.head, hidden)]
        return all(gives_rows_alone(lambda rows, p=product: _product_rows(p, rows), width, generator)
                   for product, width in probes)

    def _probe_agrees(self) -> bool:
        """Three sequences (1, 6 and 3 tokens, then 2, 1 and 4 more) packed equal each one alone."""
        vocab = self.fused.embed.shape[0]
        generator = torch.Generator().manual_seed(1)
        draw = lambda n: torch.randint(0, vocab, (n,), generator=generator).tolist()   # noqa: E731
        chunks = [[draw(1), draw(6), draw(3)], [draw(2), draw(1), draw(4)]]
        packed, alone = [OwnCache() for _ in range(3)], [OwnCache() for _ in range(3)]
        with torch.inference_mode():
            for chunk in chunks:
                together = self._forward(chunk, packed)
                for tokens, cache, rows in zip(chunk, alone, together):
                    if not torch.equal(self._forward([tokens], [cache])[0], rows):
                        return False
        return True
