"""The fused forward's blocks with the work between their products in compiled calls: a handful a block.

Why: on a small model the products are only part of a decode step. Between them a block runs about twenty
small PyTorch operations (RMSNorms, the rotary rotation, residual adds, the gate), each a few microseconds
of dispatch for nanoseconds of arithmetic: on SmolLM2-135M's 30 blocks that was more than the products.
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

Guarantee: the formulas of :class:`~speculum.models.hf.forward.fused.FusedForward`'s PyTorch path, to
float32 rounding (sums in another fixed order, exp by a polynomial: tested against it); ROW-CANONICAL, as
every call is row-wise or computes each row alone. A model takes this path or the PyTorch one at build,
for its whole life.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from .fused import FusedForward

__all__ = ["run_blocks", "Attend"]

# attend(block index, q (T, heads, d), k (T, kv_heads, d), v (T, kv_heads, d)) -> (T, heads, d) contiguous
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def run_blocks(forward: "FusedForward", x: torch.Tensor, tables: dict, attend: Attend) -> torch.Tensor:
    """Every block of ``forward`` over the embedded rows ``x (T, hidden)`` (updated in place: the residual
    stream), with ``tables`` ``{layer kind: (cos, sin)}`` each ``(T, head_dim)`` (rows contiguous, any row
    stride) -> the rows after the final norm, ``(T, hidden)``, what the vocabulary head multiplies."""
    ops = forward.row_ops
    rows = x.shape[0]
    heads, kv_heads, dim = forward.heads, forward.kv_heads, forward.head_dim
    k_from, v_from = heads * dim, (heads + kv_heads) * dim
    blocks = forward.blocks
    normed = torch.empty_like(x)
    ops.norm(x, blocks[0].attn_norm.weight, blocks[0].attn_norm.eps, normed)
    gated = None
    for index, block in enumerate(blocks):
        qkv = block.qkv(normed).contiguous()                                 # (T, q + k + v features)
        cos, sin = tables[forward.rotary_kinds[index]]
        head_norm = block.qk_norm
        ops.rotate(qkv, heads, kv_heads, dim, cos, sin, block.qkv_bias,
                   None if head_norm is None else head_norm.weight, 0.0 if head_norm is None else head_norm.eps)
        attended = attend(index, qkv[:, :k_from].view(rows, heads, dim), qkv[:, k_from:v_from].view(rows, kv_heads, dim),
                          qkv[:, v_from:].view(rows, kv_heads, dim))
        post = block.attn_out_norm
        ops.residual_norm(x, block.out(attended.view(rows, k_from)).contiguous(), block.mlp_norm.weight,
                          block.mlp_norm.eps, normed, None if post is None else post.weight,
                          0.0 if post is None else post.eps)
        gate_up = block.gate_up(normed).contiguous()
        if gated is None:
            gated = gate_up.new_empty(rows, gate_up.shape[1] // 2)
        ops.gated(gate_up, forward.activation_name, gated)
        following = blocks[index + 1].attn_norm if index + 1 < len(blocks) else forward.norm
        post = block.mlp_out_norm
        ops.residual_norm(x, block.down(gated).contiguous(), following.weight, following.eps, normed,
                          None if post is None else post.weight, 0.0 if post is None else post.eps)
    return normed
