"""Several sequences' tokens in one forward, each sequence's rows bitwise what it gets in that forward alone.

Why: scoring prompts for an evaluator is many short forwards (the part of each prompt not shared with one
scored before), and on a CPU a short forward costs about one read of every weight, however few its rows.
Packing the chunks of several prompts into one forward reads the weights once for all of them. The
answers must not depend on what else was packed (an evaluation must give the same log-likelihoods at any
concurrency), which rounding does not promise in general: a matrix kernel may pick another algorithm,
blocking or reduction order for another number of rows.

How: the fused forward computes every row in a shape of its own (``fused.py``): its products run
each row on one kernel path, attention gives each row the shapes its position alone fixes
(:mod:`~speculum.models.hf.forward.attention`), and the other operations are row-wise (RMSNorm over each
row's features, rotary tables per position, SiLU and sums per element). :class:`RowInvariantForward`
checks that property on this machine's kernels once, before it first packs:

* every product (per block: query/key/value, output, gate/up, down; the vocabulary head) on random rows
  gives each row bitwise the same for every row count from 1 to :data:`MAX_ROWS` and every offset tried;
* a probe of three sequences packed equals each sequence alone, bitwise, through the whole forward.

Where the check fails (a kernel that depends on the row count, such as dynamically quantised int8
products, whose activation scale is the whole batch's) every sequence gets a forward of its own: the same
rows, without the saving. Guarantee: BATCH-INVARIANT, each sequence's logits a function of its own tokens
and cache alone; relative to transformers' forward the fused forward's float32 rounding (see
``fused.py``).

Example:
    >>> forward = RowInvariantForward(FusedForward.build(model.module))          # doctest: +SKIP
    >>> a, b = forward([[1, 2, 3], [4, 5]], [OwnCache(model.config), OwnCache(model.config)])  # doctest: +SKIP
    >>> a.shape, b.shape                                                        # doctest: +SKIP
    (torch.Size([3, 49152]), torch.Size([2, 49152]))
"""
from __future__ import annotations

import torch

from ..kernels.probe import PROBE_ROWS
from ..kv.cache import KVCache, OwnCache
from .fused import FusedForward

__all__ = ["RowInvariantForward", "MAX_ROWS"]

MAX_ROWS = PROBE_ROWS   # most rows one packed forward holds (and the range the load check covers)


class RowInvariantForward:
    """``(token_lists, caches) -> [logits (len(tokens), vocab)]``: each sequence's tokens read after its
    cache (extended in place), packed into forwards of at most :data:`MAX_ROWS` rows where the load check
    passes (see the module docstring), else one forward per sequence. BATCH-INVARIANT."""

    def __init__(self, fused: FusedForward) -> None:
        self.fused = fused
        self._packs: bool | None = None          # decided by the first call (the load check)

    @property
    def packs(self) -> bool:
        """True when sequences are packed into shared forwards (the kernels passed the check)."""
        if self._packs is None:
            self._packs = self.fused.canonical_rows and self._probe_agrees()
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
        return self.fused.forward_packed(token_lists, caches)

    # ------------------------------------------------------------------------------------ the load check
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
