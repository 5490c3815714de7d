"""Drafts derived from the target itself: quantised twins and a layer-truncated self-draft.

All three share the target's tokenizer, so their proposals are always in the target's vocabulary.

* ``int8_twin`` — int8 dynamic quantisation of every ``nn.Linear`` (weights int8, activations quantised
  on the fly); cheaper per token on CPU, and its top token is the target's about half the time.
* ``bf16_twin`` — a bfloat16 copy; agrees with the target almost always, but on CPUs without a bf16
  matrix path it is barely cheaper than the target, so mostly useful on hardware that has one.
* ``truncated_draft`` — the first k transformer blocks + the final norm + the output head, sharing the
  target's weights (no extra memory). Without training such early exits rarely agree with the target
  (LayerSkip, Elhoushi et al. 2024, trains for it); speculum's adaptive γ backs off when it does not pay.
  It declares itself a prefix of the target (``prefix_of``), so the decoding loop can hand it the
  target's cache instead of running it over accepted tokens.

Measured costs and agreement rates are in ``benchmarks/RESULTS.md``.

Each twin is a complete ``HFModel``: the decoding loop verifies it with the distribution-aware rule
(Leviathan et al. 2023), which is exact for any draft distribution.

Example:
    >>> target = speculum.load_model()            # doctest: +SKIP
    >>> draft = int8_twin(target)                   # doctest: +SKIP
    >>> speculum.generate(target, ids, draft=draft, temperature=0)   # doctest: +SKIP
"""
from __future__ import annotations

import copy
import warnings

import torch

from ..models.hf import HFModel
from ..models.hf.forward.fused import RELEASED
from ..models.hf.kernels.onednn import unpacked_copy
from ..models.hf.precision import activations_quantised, cast_module, float_activations, quantise_activations
from ..validation import InputError

__all__ = ["int8_twin", "bf16_twin", "truncated_draft"]


def _check_weights_held(target: HFModel) -> None:
    if getattr(target.module, RELEASED, False):
        raise InputError(f"{target.name} keeps its block weights only in its fused forward "
                         "(release_unfused_weights): derive drafts from it before releasing them")


def int8_twin(target: HFModel) -> HFModel:
    """A copy of ``target`` with int8 dynamically quantised Linear layers (the target is untouched)."""
    _check_weights_held(target)
    module = float_activations(unpacked_copy(target.module))
    with warnings.catch_warnings():
        # torch.ao.quantization is deprecated in favour of torchao, which is not a dependency here; the eager
        # dynamic path still ships with torch and is what this twin needs.
        warnings.simplefilter("ignore")
        from torch.ao.quantization import quantize_dynamic  # importing it warns too: inside the filter

        module = quantize_dynamic(module, {torch.nn.Linear}, dtype=torch.qint8)
    return HFModel(module, target.tokenizer, name=f"{target.name}-int8")


def bf16_twin(target: HFModel) -> HFModel:
    """A bfloat16 copy of ``target`` (its logits are converted to float32 before the log-softmax)."""
    _check_weights_held(target)
    module = cast_module(float_activations(unpacked_copy(target.module)), torch.bfloat16)
    return HFModel(module, target.tokenizer, name=f"{target.name}-bf16")


def truncated_draft(target: HFModel, layers: int) -> HFModel:
    """The first ``layers`` blocks of ``target`` + its final norm + head, sharing the target's weights.

    Raises ValueError unless ``1 <= layers < number of target blocks``, or when the architecture does not
    expose its blocks as ``get_decoder().layers``.

    Example:
        >>> draft = truncated_draft(target, 4)     # doctest: +SKIP
    """
    _check_weights_held(target)
    decoder = target.module.get_decoder() if hasattr(target.module, "get_decoder") else None
    blocks = getattr(decoder, "layers", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise InputError(f"layer truncation needs a decoder with a .layers list; {target.name} has none")
    if not isinstance(layers, int) or not 1 <= layers < len(blocks):
        raise InputError(f"layers must be an integer in [1, {len(blocks) - 1}] for {target.name}, got {layers!r}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    # Build the skeleton on the meta device (no memory, no init), then graft the target's own submodules.
    with torch.device("meta"):
        module = type(target.module)(config)
    draft_decoder = module.get_decoder()
    for name, child in decoder.named_children():
        setattr(draft_decoder, name, torch.nn.ModuleList(list(blocks)[:layers]) if name == "layers" else child)
    for name, child in target.module.named_children():
        if child is not decoder:
            setattr(module, name, child)
    leftovers = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if leftovers:
        raise InputError(f"cannot truncate {target.name}: unshared tensors {leftovers[:3]}")
    if activations_quantised(target.module):     # its blocks multiply as the target's: the same target, cut short
        quantise_activations(module)
    draft = HFModel(module.eval(), target.tokenizer, name=f"{target.name}-layers{layers}")
    # Its keys and values are the target's first `layers` layers': a decoding loop may hand the draft the
    # target's cache instead of running the draft over accepted tokens (HFSession.adopt_prefix_layers).
    draft.prefix_of = target
    return draft
