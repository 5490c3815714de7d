"""A fused CPU forward for Llama-family models: transformers' math without its per-module overhead.

Why: on a small model the Python around the matrix products is a large share of a decode step: on
SmolLM2-135M (30 blocks) transformers' ``LlamaForCausalLM`` spends about a third of a step outside its
kernels (module calls, mask building, cache bookkeeping, seven separate projections per block). This
forward runs the same operations from one function on pre-packed oneDNN weights (``kernels/onednn.py``)
with the query/key/value and gate/up projections fused into one product each: 4 matrix calls per block
instead of 7 (``benchmarks/decoding_llm.py`` measures the effect end to end).

Families: Llama, Mistral, Qwen2, Qwen3 and Gemma 3 run this one forward, which reads how each family's block
differs from Llama's from a small table (:mod:`~speculum.models.hf.forward.families`): q/k norms, norms
after attention and MLP, biases, the gate's activation, scaled embeddings, sliding-window layers with their
own rotary tables.

Exactness: the same formulas in the same order as transformers' forward of the family (RMSNorm in float32,
rotary tables from the model's own ``rotary_emb``, causal scaled-dot-product attention), on the same weights;
the fused products compute every output element as the same dot product. Log-probs agree with
transformers' forward to float32 rounding (tested ≤ 1e-4 nats).

Row-canonical: a row's logits are a function of its sequence's tokens up to it alone, bit for bit,
whether the tokens were fed whole, one at a time, in a speculative block, or packed with other sequences
(:attr:`FusedForward.canonical_rows`). Attention computes each row alone: every row of a layer in one call
of the compiled kernel (:mod:`~speculum.models.hf.kernels.attention_rows`) where it builds, else on PyTorch's
kernel in a shape the row's position alone fixes (:mod:`~speculum.models.hf.forward.attention`); the products keep every row on one kernel path, checked once
per shape at build (:mod:`~speculum.models.hf.kernels.products`), and the rest is row-wise. So greedy speculative
output is plain greedy output and a server's answer does not depend on what else it runs, as a guarantee
rather than up to near-ties.

The int8 twin (``speculum.drafts.twins``: every Linear int8 dynamically quantised) runs it too: its products call
the twin's own ``quantized::linear_dynamic`` ops on the same inputs, so its log-probs equal the twin's
transformers forward, at less cost per draft step (not row-canonical: its activation scale is the batch's).
Mixed or other quantisation keeps transformers' forward, as do biases beyond the family's (Qwen2's, on float
weights).

A ``q8`` module (:mod:`~speculum.models.hf.precision`) runs it with every product on its weight groups and 8-bit
activations (:mod:`~speculum.models.hf.kernels.q8_groups`): a target of its own, row-canonical like float32;
the load-time probe checks it against transformers' float32 forward of the expanded weights, to 8-bit
rounding (:data:`_SELF_CHECK_TOLERANCE_Q8`).

A bfloat16 module (the ``bfloat16`` target, the bf16 twin) runs it with bfloat16 weights and float32
everywhere else: each product's rows are rounded to bfloat16 and multiplied by oneDNN (AMX or AVX-512 BF16
where the CPU has them, accumulating in float32), while the residual stream, norms, rotary tables,
attention and logits stay float32. That is its own target, closer to float32 than transformers' bfloat16
forward (which rounds the residual stream to bfloat16 after every block), and row-canonical like float32.
The load-time probe checks it against transformers' float32 forward of the same bfloat16 weights, to
bfloat16 rounding (:data:`_SELF_CHECK_TOLERANCE_BF16`).

It reads and writes any :class:`~speculum.models.hf.kv.cache.KVCache` through its protocol (``length``,
``append``, ``exclusive``): a cache of its own, which transformers' forward reads too, or a slot of the
model's KV store. Only what it reproduces exactly is accepted (:func:`unsupported_reason`), and only after
a load-time probe agrees with transformers' own forward (:meth:`FusedForward.self_check`); anything else
keeps transformers' forward.

Example:
    >>> fused = FusedForward.build(model.module)          # doctest: +SKIP  (None if not applicable)
    >>> logits = fused(torch.tensor([[1, 2, 3]]), OwnCache(model.config), keep=1)  # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...memory.allocator import trim_heap
from ...interruption import Interruption
from ...memory.pages import drop_mapped_pages
from ..kernels.attention_rows import attention_unavailable
from ..kernels.onednn import onednn_available
from ..kernels.row_ops import RowOps, row_ops_unavailable
from ..kernels.products import RowProduct, build_product, is_float_linear, is_int8_linear, is_weight_int8
from ..kv.cache import KVCache, OwnCache, SlotCache
from ..kv.store import KVArena
from ..precision import activations_quantised, cast_module
from .attention import RowAttention, SlotRows, keys_needed
from .families import ACTIVATIONS, FAMILIES, Family, activation_of, family_of, layer_windows, structure_reason
from . import glued
from .glued import BoundShapes

__all__ = ["FusedForward", "unsupported_reason", "release_block_weights", "rms_norm", "RELEASED"]

# Relative logit difference above which the load-time probe rejects the fused forward: float32 reordering
# moves logits by ~1e-6 relative, a formula change by far more.
_SELF_CHECK_TOLERANCE = 1e-4
# The same for bfloat16 weights, against transformers' float32 forward of those very weights: the fused
# forward rounds each product's rows and outputs to bfloat16 (8 bits), which moves logits by 1-4e-2
# relative; a formula change (a rotation, a norm, a mask) moves them by far more.
_SELF_CHECK_TOLERANCE_BF16 = 1e-1
# Past this many float32 bytes the probe does not widen the module to float32 (that would double its memory
# at load); it compares with transformers' own bfloat16 forward, which rounds more, at a wider tolerance.
_SELF_CHECK_FLOAT32_BYTES = 2 << 30
_SELF_CHECK_TOLERANCE_BF16_OWN = 2e-1
# The ``q8`` target against transformers' float32 forward of the expanded weights: every product's rows carry
# 8 bits a block of 32 (llama.cpp's Q8_1), which moves logits by ~1e-2 relative; a formula change by far more.
_SELF_CHECK_TOLERANCE_Q8 = 1e-1
# Fused products per decoder block (and output head), keyed by the module itself: a layer-truncated draft
# shares the target's block objects and so shares their packed weights, and deep copies (the twins) never
# see oneDNN tensors, which cannot be copied.
_PACKED: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()


# Most positions whose rotary tables a forward keeps (2 x this x head_dim floats per layer kind); past them each
# forward computes its own.
_ROTARY_TABLE_POSITIONS = 8192

RELEASED = "_speculum_weights_released"   # set on a module whose block weights live only in packed form


@dataclass(frozen=True)
class _Norm:
    """An RMSNorm's float32 weight (its family's offset added) and epsilon: ``norm(x)`` over the last dimension."""
    weight: torch.Tensor       # (features,)
    eps: float

    @classmethod
    def of(cls, module: torch.nn.Module, offset: float) -> "_Norm":
        # Llama's and Qwen's name it variance_epsilon, Gemma's eps.
        eps = getattr(module, "variance_epsilon", None)
        return cls(module.weight.detach().float() + offset, float(module.eps if eps is None else eps))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@dataclass(frozen=True)
class _Block:
    qkv: RowProduct            # hidden -> q + k + v features
    out: RowProduct            # q features -> hidden
    gate_up: RowProduct        # hidden -> 2 * intermediate
    down: RowProduct           # intermediate -> hidden
    attn_norm: _Norm           # before attention
    mlp_norm: _Norm            # before the MLP
    qkv_bias: torch.Tensor | None = None      # (q + k + v features,): Qwen2
    qk_norm: _Norm | None = None              # each query head's, then each key head's: (heads + kv, head_dim)
    attn_out_norm: _Norm | None = None        # after attention, before its residual add: Gemma 3
    mlp_out_norm: _Norm | None = None         # after the MLP, before its residual add: Gemma 3


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm for float32 inputs (over the last dimension, row by row): ``weight * (x * rsqrt(mean(x²)
    + eps))`` in one call of PyTorch's ``rms_norm``, bitwise what transformers' module computes in five
    (tested)."""
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def _head_norms(attn: torch.nn.Module, offset: float) -> _Norm:
    """The query and key norms of ``attn`` as one: weights ``(heads + kv heads, head_dim)``, one row per head."""
    query, key = _Norm.of(attn.q_norm, offset), _Norm.of(attn.k_norm, offset)
    if query.eps != key.eps:
        raise RuntimeError("query and key norms with different epsilons")      # build() keeps transformers'
    heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
    return _Norm(torch.cat([query.weight.expand(heads, -1), key.weight.expand(kv_heads, -1)]), query.eps)


def _rope_types(config: Any) -> set:
    """The rotary types a config names (one, or one per layer kind: Gemma 3)."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    nested = [v for v in parameters.values() if isinstance(v, dict)] if isinstance(parameters, dict) else []
    return {str(p.get("rope_type", p.get("type", "default"))) for p in nested or [parameters]}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotary embedding's half rotation of the last dimension: ``(a, b) -> (-b, a)``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def release_block_weights(module: torch.nn.Module) -> int:
    """Free the float32 weights of ``module``'s block projections, which its fused forward holds packed
    (one copy of each weight in memory instead of two); returns the bytes given back to the system.

    The fused forward is unchanged. What needs the module's own weights afterwards is refused with a clear
    error (copies of it, such as the twins, and fused forwards built on it later). The embedding, the
    norms and the output head keep their tensors. Weights mapped from the checkpoint file have their pages
    dropped (:func:`~speculum.models.memory.pages.drop_mapped_pages`), the output head's too: it is held
    packed, and what still reads its weight (the embedding, when tied) reads its rows back from the file
    on demand, the very values loaded, with only the rows of tokens in use resident."""
    blocks = list(module.get_decoder().layers)
    head = module.get_output_embeddings()
    if any(part not in _PACKED for part in [*blocks, head]):
        raise ValueError("build the fused forward of this module before releasing its weights")
    # An int8 head (``--dtype int8``) has no float weight: its int8 tensors are what its product runs on.
    ranges = [(head.weight.data_ptr(), head.weight.numel() * head.weight.element_size())] \
        if is_float_linear(head) else []
    for block in blocks:
        attn, mlp = block.self_attn, block.mlp
        for layer in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if is_float_linear(layer) and layer.weight.numel():
                ranges.append((layer.weight.data_ptr(), layer.weight.numel() * layer.weight.element_size()))
                layer.weight = torch.nn.Parameter(layer.weight.new_empty(0, layer.in_features), requires_grad=False)
    setattr(module, RELEASED, True)
    return drop_mapped_pages(ranges)


def unsupported_reason(module: torch.nn.Module) -> str | None:
    """None when :class:`FusedForward` reproduces ``module``'s forward, else why not (one line)."""
    config = getattr(module, "config", None)
    family = family_of(module)
    if family is None:
        return (f"architecture {getattr(config, 'model_type', None)!r} is not one the fused forward covers "
                f"({', '.join(FAMILIES)})")
    if not onednn_available():
        return "this torch build has no oneDNN"
    if activation_of(config) not in ACTIVATIONS or getattr(config, "pretraining_tp", 1) != 1:
        return f"activation {activation_of(config)!r} or tensor-parallel layout differs from its family's"
    decoder = module.get_decoder() if hasattr(module, "get_decoder") else None
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    layers = getattr(decoder, "layers", None)
    if decoder is None or layers is None:
        return "no decoder layers"
    if not all(hasattr(decoder, name) for name in ("embed_tokens", "norm", "rotary_emb")):
        return "decoder lacks embed_tokens, norm or rotary_emb"
    windows = layer_windows(config)
    reason = windows if isinstance(windows, str) else structure_reason(module, family)
    if reason is not None:
        return reason
    linears = [head]
    for block in layers:
        attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
        linears += [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not any(all(kind(lin) for lin in linears) for kind in (is_float_linear, is_int8_linear, is_weight_int8)):
        return ("projections are neither all plain float Linear layers, nor all int8 dynamically quantised, "
                "nor all int8 weight-only ones (other quantisation?)")
    if family.qkv_bias and not all(is_float_linear(lin) for lin in linears):
        return "quantised projections with biases"
    if any(is_float_linear(lin) and not lin.weight.numel() for lin in linears):
        return "its block weights were released (release_block_weights): only its own fused forward runs it"
    tensors = [*module.parameters()]
    if any(t.device.type != "cpu" for t in tensors):
        return "not on CPU"
    dtypes = {t.dtype for t in tensors}
    if dtypes == {torch.bfloat16}:
        if not all(is_float_linear(lin) for lin in linears):
            return "bfloat16 with quantised projections"
    elif dtypes != {torch.float32}:
        return "neither float32 nor bfloat16 throughout"
    return None


class FusedForward:
    """``(input_ids (batch, n), KVCache, keep) -> logits (batch, keep or n, vocab)``: the forward of a
    Llama ``*ForCausalLM`` module, exact to float32 rounding (see the module docstring). Build it with
    :meth:`build`, which returns None when the module is not one it reproduces. Build it after the weights
    are final: the packed copies do not see later in-place changes of the module's weights."""

    def __init__(self, module: torch.nn.Module) -> None:
        config = module.config
        decoder = module.get_decoder()
        self.family: Family = family_of(module)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        count = int(config.num_hidden_layers)
        layers = list(decoder.layers)[:count]
        self.scale = float(layers[0].self_attn.scaling)        # head_dim ** -0.5, or Gemma's query_pre_attn_scalar's
        self.embed = decoder.embed_tokens.weight
        self.embed_scale = float(decoder.embed_tokens.embed_scale) if self.family.scaled_embeddings else None
        self.weight_dtype = self.embed.dtype
        self.q8 = activations_quantised(module)       # every product with 8-bit activations (the q8 target)
        self.rotary = decoder.rotary_emb
        self.activation_name = activation_of(config)
        self.activation = ACTIVATIONS[self.activation_name]
        self.norm = _Norm.of(decoder.norm, self.family.norm_offset)
        self.intermediate = int(config.intermediate_size)
        # Each layer's window, and the rotary tables it reads: one per layer type where the rotary module has
        # several (Gemma 3's sliding layers rotate with another base), else the one table for every layer.
        self.windows = layer_windows(config)
        kinds = getattr(self.rotary, "layer_types", None)
        self.rotary_kinds = list(config.layer_types[:count]) if kinds else [None] * count
        self._rotary_static = not {"dynamic", "longrope"} & _rope_types(config)
        self._rotary_rows: tuple[int, dict] | None = None        # (positions held, tables), see rotary_tables
        # Attention and the work between the products in compiled calls (forward/glued.py) where both kernels
        # build, else on PyTorch's operations, for life: the two round differently, and a row must come out the
        # same in every forward.
        compiled = attention_unavailable() is None and row_ops_unavailable() is None
        self.row_ops = RowOps() if compiled else None
        # Where a caller asked it and the model can undo it, packed forwards stop between two layers.
        self.interruption = Interruption()
        self.bound_blocks = BoundShapes(self)          # the glued blocks bound to buffers, by row count
        self.blocks = [self._block(block, self.family, self.q8) for block in layers]
        head = module.get_output_embeddings()
        if head not in _PACKED:
            _PACKED[head] = build_product([head], self.q8)
        self.head = _PACKED[head]

    @property
    def canonical_rows(self) -> bool:
        """True when every product gives each row bitwise the same whatever rows surround it (probed once
        per shape at build, :mod:`~speculum.models.hf.kernels.products`): with attention computed per row
        (:mod:`~speculum.models.hf.forward.attention`) and the other operations row-wise, a row's logits are
        then a function of its sequence's tokens up to it alone, however they were fed (ROW-CANONICAL)."""
        return all(product.rows_alone for product, _ in self.products())

    def products(self) -> list[tuple[RowProduct, int]]:
        """Every matrix product of a forward with its input width: the blocks' in order, then the head (what
        a benchmark times to see the kernels' cost per row)."""
        hidden, attended = self.embed.shape[1], self.heads * self.head_dim
        products = [(p, width) for b in self.blocks for p, width in
                    ((b.qkv, hidden), (b.out, attended), (b.gate_up, hidden), (b.down, self.intermediate))]
        return [*products, (self.head, hidden)]

    @classmethod
    def build(cls, module: torch.nn.Module) -> "FusedForward | None":
        """The fused forward of ``module``, or None when :func:`unsupported_reason` finds a difference,
        packing fails, or the load-time probe (:meth:`self_check`) disagrees (with a warning). The caller
        then keeps transformers' forward."""
        if unsupported_reason(module) is not None:
            return None
        try:
            with torch.no_grad():
                fused = cls(module)
        except RuntimeError:        # a shape or op this oneDNN build refuses
            return None
        if fused.weight_dtype != torch.bfloat16:
            difference = fused.self_check(module, _SELF_CHECK_TOLERANCE_Q8 if fused.q8 else _SELF_CHECK_TOLERANCE)
        elif 4 * sum(t.numel() for t in module.parameters()) > _SELF_CHECK_FLOAT32_BYTES:
            difference = fused.self_check(module, _SELF_CHECK_TOLERANCE_BF16_OWN)
        else:
            # The reference is transformers' float32 forward of the same weights (bfloat16 -> float32 ->
            # bfloat16 is lossless): its own bfloat16 forward rounds far more than the fused one.
            cast_module(module, torch.float32)
            try:
                difference = fused.self_check(module, _SELF_CHECK_TOLERANCE_BF16)
            finally:
                cast_module(module, torch.bfloat16)
        trim_heap()              # the probes' temporary products would otherwise stay resident
        if difference is not None:
            warnings.warn(f"the fused forward differs from transformers' forward by {difference:.2g} "
                          "(relative) on a probe; using transformers' forward", RuntimeWarning, stacklevel=2)
            return None
        return fused

    def self_check(self, module: torch.nn.Module, tolerance: float = _SELF_CHECK_TOLERANCE) -> float | None:
        """None when this forward reproduces ``module``'s own forward on a probe, else the relative
        difference. The probe is a prefill of 3 tokens, then 2 more on that cache (causal mask offset by
        the cached length), each against transformers' forward on its own cache: a guard against a
        transformers release whose Llama math this module no longer mirrors, at the cost of one short
        forward at load."""
        from transformers import DynamicCache  # transformers loads after torch, with the first model

        vocab = int(module.config.vocab_size)
        probe = torch.randint(0, vocab, (1, 5), generator=torch.Generator().manual_seed(0))
        # Ours holds every key (a sliding-window layer masks the old ones); theirs, what transformers keeps.
        ours_cache, theirs_cache = OwnCache(), DynamicCache(config=module.config)
        worst = 0.0
        with torch.inference_mode():
            for chunk in (probe[:, :3], probe[:, 3:]):
                ours = self(chunk, ours_cache)
                theirs = module(input_ids=chunk, cache=theirs_cache, use_cache=True).logits.float()
                scale = float(theirs.abs().max()) or 1.0
                if ours.shape != theirs.shape:
                    return float("inf")
                worst = max(worst, float((ours - theirs).abs().max()) / scale)
        return None if worst <= tolerance else worst

    @staticmethod
    def _block(block: torch.nn.Module, family: Family, q8: bool = False) -> _Block:
        if block not in _PACKED:
            attn, mlp, offset = block.self_attn, block.mlp, family.norm_offset
            sandwich = family.sandwich_norms
            # Llama's post_attention_layernorm is the MLP's input norm; a sandwich block names that norm
            # pre_feedforward_layernorm and normalises attention's output with post_attention_layernorm.
            _PACKED[block] = _Block(
                qkv=build_product([attn.q_proj, attn.k_proj, attn.v_proj], q8),
                out=build_product([attn.o_proj], q8),
                gate_up=build_product([mlp.gate_proj, mlp.up_proj], q8),
                down=build_product([mlp.down_proj], q8),
                attn_norm=_Norm.of(block.input_layernorm, offset),
                mlp_norm=_Norm.of(block.pre_feedforward_layernorm if sandwich else block.post_attention_layernorm,
                                  offset),
                qkv_bias=torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach().float()
                if family.qkv_bias else None,
                qk_norm=_head_norms(attn, offset) if family.qk_norm else None,
                attn_out_norm=_Norm.of(block.post_attention_layernorm, offset) if sandwich else None,
                mlp_out_norm=_Norm.of(block.post_feedforward_layernorm, offset) if sandwich else None,
            )
        return _PACKED[block]

    def rotary_tables(self, x: torch.Tensor, positions: torch.Tensor, run: bool = False) -> dict:
        """``{layer kind: (cos, sin)}``, each ``(1, 1, n, head_dim)``, for tokens ``x`` at ``positions (1, n)``
        (``run``: they are one run ``p, p + 1, ...``, read as a view).

        Rows of tables computed once for the first positions (grown by doubling up to
        :data:`_ROTARY_TABLE_POSITIONS`): each entry is an element-wise function of its position, so a row
        read from the table is bitwise the row the rotary module computes for that position alone; a forward
        saves one rotary call per layer kind. Rotary types that rescale with the sequence's length
        (``dynamic``, ``longrope``) are computed per forward. ROW-CANONICAL: a position's rows are the same
        in any call."""
        end = int(positions.max()) + 1
        tables = self._rotary_rows
        if tables is None or end > tables[0]:
            if not self._rotary_static or end > _ROTARY_TABLE_POSITIONS:
                return self._rotary_call(x, positions)
            length = min(max(end, 2 * (tables[0] if tables else 0), 256), _ROTARY_TABLE_POSITIONS)
            tables = (length, self._rotary_call(x, torch.arange(length).unsqueeze(0)))
            self._rotary_rows = tables
        if run:
            first = int(positions[0, 0])
            return {kind: (cos[:, :, first:end], sin[:, :, first:end]) for kind, (cos, sin) in tables[1].items()}
        at = positions[0]
        return {kind: (cos[:, :, at], sin[:, :, at]) for kind, (cos, sin) in tables[1].items()}

    def _rotary_call(self, x: torch.Tensor, positions: torch.Tensor) -> dict:
        """:meth:`rotary_tables` from the rotary module itself."""
        tables = {}
        for kind in dict.fromkeys(self.rotary_kinds):
            cos, sin = self.rotary(x, positions) if kind is None else self.rotary(x, positions, kind)
            tables[kind] = (cos.unsqueeze(1), sin.unsqueeze(1))
        return tables

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, cache: KVCache, keep: int = 0) -> torch.Tensor:
        with cache.exclusive():               # a store's buffers must not be replaced mid-forward
            return self._call(input_ids, cache, keep)

    def _call(self, input_ids: torch.Tensor, cache: KVCache, keep: int) -> torch.Tensor:
        batch, n = input_ids.shape
        past = cache.length
        x = self.embedded(input_ids)                                                # (batch, n, hidden)
        positions = (torch.arange(n) + past).unsqueeze(0)                           # (1, n)
        tables = self.rotary_tables(x, positions, run=True)
        if self.row_ops is not None:
            return glued.call(self, x, tables, cache, positions, keep)
        attentions = {window: RowAttention(past, n, window) for window in set(self.windows)}
        for index, block in enumerate(self.blocks):
            attention = attentions[self.windows[index]]
            q, k, v = self._qkv(block, x, *tables[self.rotary_kinds[index]])
            k, v = cache.append(k, v, index, attention.keys)                        # (batch, kv, >= past+n, d)
            x = self._after_attention(block, x, attention(q, k, v, self.scale))
        if keep:
            x = x[:, -keep:]
        return self._head(x)

    @torch.inference_mode()
    def forward_packed(self, token_lists: list[list[int]], caches: list[KVCache], keep: list[int] | None = None
                       ) -> list[torch.Tensor]:
        """Several sequences in one forward, each extending its own cache (updated in place): logits
        ``(keep[b], vocab)`` for each, those of its last ``keep[b]`` positions (default: all of them).

        The per-token work (embedding, norms, projections, MLP, vocabulary head) runs once over every
        token packed into one matrix, without padding; attention runs per sequence
        (:class:`~speculum.models.hf.forward.attention.RowAttention`), on a view of its slot when every cache
        is a slot of one :class:`~speculum.models.hf.kv.store.KVArena` (new keys written by one indexed
        write per layer, :meth:`_forward_store`), else on its own cache."""
        lengths = [len(tokens) for tokens in token_lists]
        pasts = [cache.length for cache in caches]
        bounds = [0, *itertools.accumulate(lengths)]                                # sequence b: bounds[b]:bounds[b+1]
        ids = torch.tensor([[t for tokens in token_lists for t in tokens]])        # (1, T)
        x = self.embedded(ids)                                                      # (1, T, hidden)
        position = torch.cat([torch.arange(n) + past for n, past in zip(lengths, pasts)])   # (T,) in its sequence
        tables = self.rotary_tables(x, position.unsqueeze(0))                      # each (1, 1, T, head_dim)
        store = caches[0].store if caches else None
        if store is not None and all(cache.store is store for cache in caches):
            with store.lock:
                return self._forward_store(x, tables, position, pasts, bounds, caches, store, keep)
        if self.row_ops is not None:
            return glued.packed(self, x, tables, pasts, bounds, caches, keep)
        attentions = {window: [RowAttention(past, n, window) for past, n in zip(pasts, lengths)]
                      for window in set(self.windows)}
        with contextlib.ExitStack() as held:
            for cache in caches:
                held.enter_context(cache.exclusive())
            for index, block in enumerate(self.blocks):
                self.interruption.between_layers()
                q, k, v = self._qkv(block, x, *tables[self.rotary_kinds[index]])    # (1, heads, T, d)
                attn = q.new_empty(1, q.shape[2], self.heads, self.head_dim)          # (1, T, heads, d)
                for b, (cache, attention) in enumerate(zip(caches, attentions[self.windows[index]])):
                    at = slice(bounds[b], bounds[b + 1])
                    keys, values = cache.append(k[:, :, at], v[:, :, at], index, attention.keys)
                    attn[:, at] = attention(q[:, :, at], keys, values, self.scale).transpose(1, 2)
                x = self._after_attention(block, x, attn.transpose(1, 2))
        return self.kept_logits(x, bounds, keep)

    def _forward_store(self, x: torch.Tensor, tables: dict, position: torch.Tensor,
                       pasts: list[int], bounds: list[int], caches: list[SlotCache], arena: KVArena,
                       keep: list[int] | None) -> list[torch.Tensor]:
        """:meth:`forward_packed` on slots of one store, from its embedded tokens ``x``, their rotary
        ``tables`` and ``position``, and each sequence's cached length ``pasts``: every new key and
        value is written in place by one indexed write per layer; the sequences feeding one token attend
        together over a view of the store (:class:`~speculum.models.hf.forward.attention.SlotRows`), each
        longer block over a view of its slot."""
        lengths = [end - start for start, end in zip(bounds, bounds[1:])]
        arena.reserve(max(keys_needed(past + n) for past, n in zip(pasts, lengths)))
        slot = torch.tensor([cache.slot for cache, n in zip(caches, lengths) for _ in range(n)])   # (T,)
        if self.row_ops is not None:
            return glued.packed_on_store(self, x, tables, position, slot, pasts, lengths, bounds, caches, arena, keep)
        singles = [b for b, n in enumerate(lengths) if n == 1]
        single_rows = torch.tensor([bounds[b] for b in singles], dtype=torch.long)  # their rows in the packing
        windows = set(self.windows)
        together = {w: SlotRows([caches[b].slot for b in singles], [pasts[b] for b in singles], w)
                    for w in windows} if singles else None
        blocks = {w: {b: RowAttention(pasts[b], n, w) for b, n in enumerate(lengths) if n > 1} for w in windows}
        for index, block in enumerate(self.blocks):
            self.interruption.between_layers()
            window = self.windows[index]
            q, k, v = self._qkv(block, x, *tables[self.rotary_kinds[index]])    # (1, heads, T, d)
            keys, values = arena.keys[index], arena.values[index]
            keys[slot, :, position] = k[0].transpose(0, 1)                       # (T, kv_heads, d)
            values[slot, :, position] = v[0].transpose(0, 1)
            attn = q.new_empty(1, len(slot), self.heads, self.head_dim)          # (1, T, heads, d)
            if together is not None:
                attn[0, single_rows] = together[window](q[0, :, single_rows].transpose(0, 1), keys, values,
                                                        self.scale)
            for b, attention in blocks[window].items():
                at, own = slice(bounds[b], bounds[b + 1]), slice(caches[b].slot, caches[b].slot + 1)
                attn[:, at] = attention(q[:, :, at], keys[own, :, :attention.keys],
                                        values[own, :, :attention.keys], self.scale).transpose(1, 2)
            x = self._after_attention(block, x, attn.transpose(1, 2))
        for cache, past, n in zip(caches, pasts, lengths):
            cache.filled_to(past + n)
        return self.kept_logits(x, bounds, keep)

    def kept_logits(self, x: torch.Tensor, bounds: list[int], keep: list[int] | None, normed: bool = False
                     ) -> list[torch.Tensor]:
        """The logits of the last ``keep[b]`` positions of each sequence ``b`` (``x[:, bounds[b]:bounds[b+1]]``):
        the vocabulary head runs on those rows only (a deferred prompt needs none of its own). ``normed``: the
        rows are already after the final norm."""
        sequences = len(bounds) - 1
        if keep is None:
            keep = [bounds[b + 1] - bounds[b] for b in range(sequences)]
        elif not sum(keep):
            return [x.new_zeros(0, 0) for _ in keep]
        else:
            rows = torch.cat([torch.arange(bounds[b + 1] - keep[b], bounds[b + 1]) for b in range(sequences)])
            x = x[:, rows]
        logits = (self.head(x[0]) if normed else self._head(x)[0])              # (kept, vocab)
        return list(logits.split(keep))

    def embedded(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 embeddings of token ids ``(...,)`` -> ``(..., hidden)`` (bfloat16 tables widened, times
        the family's embedding scale where it has one)."""
        rows = F.embedding(ids, self.embed).float()
        return rows if self.embed_scale is None else rows * self.embed_scale

    def _qkv(self, block: _Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """Rotated queries and keys, and values, of ``x (batch, n, hidden)``: ``(batch, heads, n, d)``."""
        batch, n, hidden = x.shape
        qkv = block.qkv(block.attn_norm(x).reshape(batch * n, hidden))
        if block.qkv_bias is not None:
            qkv = qkv + block.qkv_bias
        return self.split_heads(qkv.view(batch, n, -1), cos, sin, block)

    def split_heads(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, block: _Block | None = None
                    ) -> tuple:
        """Rotated queries and keys, and values, ``(batch, heads, n, d)``, of projected rows ``qkv (batch, n,
        q + k + v features)`` at the positions of the rotary tables ``cos`` / ``sin`` (each head normalised
        first where ``block`` has q/k norms)."""
        batch, n, _ = qkv.shape
        k_end = (self.heads + self.kv_heads) * self.head_dim
        # Queries and keys are normalised and rotate together: the same row-wise formulas, fewer operations.
        qk = qkv[..., :k_end].view(batch, n, self.heads + self.kv_heads, self.head_dim)
        if block is not None and block.qk_norm is not None:
            # Weighted after the norm: bitwise what the norm with each head's weight gives (tested).
            qk = F.rms_norm(qk, qk.shape[-1:], None, block.qk_norm.eps) * block.qk_norm.weight
        cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)                      # (1, n, 1, head_dim)
        rotated = (qk * cos + _rotate_half(qk) * sin).transpose(1, 2)            # (batch, heads + kv, n, d)
        v = qkv[..., k_end:].view(batch, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotated[:, :self.heads], rotated[:, self.heads:], v

    def _after_attention(self, block: _Block, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The block's output projection and MLP, with their residuals."""
        batch, n, hidden = x.shape
        attended = block.out(attn.transpose(1, 2).reshape(batch * n, self.heads * self.head_dim)).view(batch, n, hidden)
        x = x + (attended if block.attn_out_norm is None else block.attn_out_norm(attended))
        gate, up = block.gate_up(block.mlp_norm(x).reshape(batch * n, hidden)).chunk(2, dim=-1)
        mlp = block.down(self.activation(gate) * up).view(batch, n, hidden)
        return x + (mlp if block.mlp_out_norm is None else block.mlp_out_norm(mlp))

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        batch, n, hidden = x.shape
        x = self.norm(x)
        return self.head(x.reshape(-1, hidden)).view(batch, n, -1)
