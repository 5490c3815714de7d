"""Pre-packed float32 ``nn.Linear`` layers on CPU (oneDNN): cheap verification of short blocks.

Why: PyTorch's default CPU matmul (MKL) runs one row through a matrix-vector kernel but re-packs the whole
weight matrix on every call with two or more rows, so a forward of even 2 tokens costs far more than a
one-token decode step, and speculative decoding pays that on every verification. oneDNN's inner product
with the weights reordered *once* into its blocked layout (the path ``torch.compile`` takes for frozen CPU
weights) brings a 2-token forward close to the cost of one step and makes the step itself cheaper
(``benchmarks/decoding_llm.py`` measures both).

Exactness: the layers compute the same products summed in another order, so results agree with the default
kernels to float32 rounding (≤ 1e-4 nats on SmolLM2's log-probs, tested). Plain and speculative decoding
run the same kernels, so greedy speculative output still equals plain greedy output; near-ties may break
differently from an unpacked model, as they may between two BLAS libraries.

Cost: a second copy of every packed weight (the originals stay: tied embeddings, twins and ``.to()`` use
them). Packing is skipped where it cannot apply (no oneDNN, not float32, not on CPU); a layer whose inputs
are not float32 CPU tensors, or that needs gradients, falls back to ``torch.nn.functional.linear``.

Example:
    >>> layer = torch.nn.Linear(8, 4)
    >>> prepack_linears(layer)
    1
    >>> x = torch.randn(3, 8)
    >>> bool(torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5))
    True
"""
from __future__ import annotations

import copy
import types

import torch

__all__ = ["prepack_linears", "unpack_linears", "unpacked_copy", "is_prepacked", "onednn_available",
           "onednn_bf16_available", "pack_weight", "packed_linear"]

_PACKED = "_speculum_packed"          # instance attribute holding the oneDNN weight
_SELF_CHECK_TOLERANCE = 1e-3          # relative: a packed layer must reproduce F.linear this closely


def onednn_available() -> bool:
    """True when this torch build has oneDNN and the packed-weight linear ops used here."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def onednn_bf16_available() -> bool:
    """True when oneDNN has bfloat16 kernels for this CPU: it needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and
    refuses to pack a bfloat16 weight on a CPU with AVX2 alone."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return onednn_available() and supported is not None and bool(supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A ``(out, in)`` float32 weight reordered once into oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``rows (m, in) -> (m, out)`` through a weight from :func:`pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    packed = self.__dict__.get(_PACKED)
    if (packed is None or x.dtype != torch.float32 or x.device.type != "cpu" or self.weight.dtype != torch.float32
            or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
        return torch.nn.functional.linear(x, self.weight, self.bias)
    rows = x.reshape(-1, x.shape[-1])
    out = packed_linear(rows, packed, self.bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def is_prepacked(layer: torch.nn.Module) -> bool:
    """True when ``layer`` runs through a pre-packed oneDNN weight."""
    return layer.__dict__.get(_PACKED) is not None


@torch.no_grad()
def _pack(layer: torch.nn.Linear) -> bool:
    weight = layer.weight.detach()
    packed = pack_weight(weight)
    # Self-check once per layer (a few microseconds): a kernel that does not reproduce F.linear is not used.
    probe = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0))
    expected = torch.nn.functional.linear(probe, weight, layer.bias)
    got = packed_linear(probe, packed, layer.bias)
    scale = float(expected.abs().max()) or 1.0
    if got.shape != expected.shape or not float((got - expected).abs().max()) <= _SELF_CHECK_TOLERANCE * scale:
        return False
    layer.__dict__[_PACKED] = packed
    layer.forward = types.MethodType(_packed_forward, layer)
    return True


def prepack_linears(module: torch.nn.Module) -> int:
    """Route every float32 CPU ``nn.Linear`` in ``module`` through a pre-packed oneDNN weight, in place.

    Returns how many layers were packed (0 when oneDNN is unavailable). Idempotent. Pack after the weights
    are final: a later in-place change of ``layer.weight`` is not seen by the packed copy (re-pack, or call
    :func:`unpack_linears` first). Guarantee: same results as ``F.linear`` up to float32 rounding.
    """
    if not onednn_available():
        return 0
    count = 0
    for layer in module.modules():
        if (type(layer) is torch.nn.Linear and not is_prepacked(layer) and layer.weight.dtype == torch.float32
                and layer.weight.device.type == "cpu"):
            try:
                packed = _pack(layer)
            except RuntimeError:       # an op this torch build lacks, or a shape oneDNN refuses
                packed = False
            if not packed:
                unpack_linears(module)
                return 0
            count += 1
    return count


def unpack_linears(module: torch.nn.Module) -> None:
    """Undo :func:`prepack_linears`: every layer uses its (unchanged) original weight again."""
    for layer in module.modules():
        if _PACKED in layer.__dict__:
            del layer.__dict__[_PACKED]
            layer.__dict__.pop("forward", None)


def unpacked_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``module`` without packed weights (oneDNN tensors cannot be deep-copied)."""
    saved = {}
    for layer in module.modules():
        if _PACKED in layer.__dict__:
            saved[layer] = (layer.__dict__.pop(_PACKED), layer.__dict__.pop("forward", None))
    try:
        return copy.deepcopy(module)
    finally:
        for layer, (packed, forward) in saved.items():
            layer.__dict__[_PACKED] = packed
            if forward is not None:
                layer.__dict__["forward"] = forward
