"""The model families the fused forward runs, as a table of how each one's decoder block differs from Llama's.

Why a table: Llama, Mistral, Qwen2, Qwen3 and Gemma 3 share one decoder block (RMSNorm, rotary attention
over grouped key/value heads, a gated MLP) and differ in a few switches. One forward that reads the
switches covers them all (:class:`~speculum.models.hf.forward.fused.FusedForward`), and its load-time probe
checks each module against transformers' own forward, whatever its family.

=============  ==================================================================================
family         differences from Llama (``model_type``)
=============  ==================================================================================
llama          none
mistral        a sliding window on every layer, when its config sets one
qwen2          biases on the query, key and value projections
qwen3          RMSNorm of each query and key head before the rotation
gemma3_text    q/k norms; norms after attention and after the MLP too; RMSNorm by ``1 + weight``;
               GELU (tanh) gate; embeddings times sqrt(hidden); sliding-window layers with their own
               rotary base (``layer_types``)
=============  ==================================================================================

What the config says for every family is read from it rather than tabled: each layer's window
(``layer_types`` and ``sliding_window``), the gate's activation, the attention scale (the attention
module's own ``scaling``: Gemma's ``query_pre_attn_scalar``) and the rotary tables (the module's own
``rotary_emb``, per layer type where it has several). :func:`unsupported_reason` names the first thing a
module has that the forward does not reproduce.

Example:
    >>> FAMILIES["qwen3"].qk_norm, FAMILIES["qwen2"].qkv_bias
    (True, True)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = ["Family", "FAMILIES", "ACTIVATIONS", "family_of", "layer_windows", "activation_of", "has_bias",
           "structure_reason"]


@dataclass(frozen=True)
class Family:
    """How a family's decoder block differs from Llama's (all False: Llama)."""

    norm_offset: float = 0.0         # RMSNorm multiplies by (offset + weight): Gemma stores its weights minus one
    qk_norm: bool = False            # per-head RMSNorm of queries and keys before the rotation
    sandwich_norms: bool = False     # a norm after attention and after the MLP too, before each residual add
    scaled_embeddings: bool = False  # embeddings times the embedding module's ``embed_scale`` (sqrt(hidden))
    qkv_bias: bool = False           # biases on the query, key and value projections


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qk_norm=True),
    "gemma3_text": Family(norm_offset=1.0, qk_norm=True, sandwich_norms=True, scaled_embeddings=True),
}

# The gate activations by their config names, as transformers' ACT2FN computes them.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def family_of(module: torch.nn.Module) -> Family | None:
    """The family of a ``*ForCausalLM`` module, by its config's ``model_type``; None for another."""
    return FAMILIES.get(getattr(getattr(module, "config", None), "model_type", None))


def has_bias(layer: Any) -> bool:
    """Whether a projection adds a bias (a float ``nn.Linear``'s is a tensor; a quantised one's, a method)."""
    bias = getattr(layer, "bias", None)
    return (bias() if callable(bias) else bias) is not None


def activation_of(config: Any) -> str | None:
    """The config's name for its MLP gate's activation (Gemma calls it ``hidden_activation``)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


def layer_windows(config: Any) -> list[int | None] | str:
    """Each layer's sliding window (a row at position p sees keys p - window + 1 .. p), None for full
    attention; or why a layer's attention is not one the forward reproduces (one line)."""
    count = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:       # Llama has no window; Mistral's applies to every layer when set
        return [window] * count
    unknown = sorted(set(types[:count]) - {"full_attention", "sliding_attention"})
    if unknown:
        return f"layer types {unknown} (neither full nor sliding-window attention)"
    if "sliding_attention" in types[:count] and not window:
        return "sliding-window layers without a window"
    return [window if kind == "sliding_attention" else None for kind in types[:count]]


def structure_reason(module: torch.nn.Module, family: Family) -> str | None:
    """None when ``module``'s blocks have exactly the parts ``family`` says (norms, biases), else why not."""
    config = module.config
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None):
        return "soft-capped logits"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if getattr(config, "mlp_bias", False) or (getattr(config, "attention_bias", False) and not family.qkv_bias):
        return "biased projections"
    decoder = module.get_decoder()
    if family.scaled_embeddings and not hasattr(decoder.embed_tokens, "embed_scale"):
        return "embeddings without their scale"
    for block in decoder.layers:
        attn, mlp = block.self_attn, block.mlp
        if has_bias(getattr(attn, "o_proj", None)) or \
                any(has_bias(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")):
            return "biased projections"
        biases = [has_bias(getattr(attn, n, None)) for n in ("q_proj", "k_proj", "v_proj")]
        if biases != [family.qkv_bias] * 3:
            return "biased projections" if not family.qkv_bias else "query/key/value projections without biases"
        if all(hasattr(attn, n) for n in ("q_norm", "k_norm")) != family.qk_norm:
            return "query/key norms other than its family's"
        sandwich = all(hasattr(block, n) for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm"))
        if sandwich != family.sandwich_norms or not hasattr(attn, "scaling"):
            return "block norms other than its family's"
    return None
