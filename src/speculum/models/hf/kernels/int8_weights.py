"""int8 weight-only products (the ``int8`` target's kernel): a Linear whose weights are int8 with a float32
scale per output channel, multiplied by PyTorch's CPU ``_weight_int8pack_mm`` on float32 activations.

Why: an ``int8`` target holds a quarter of float32's weight bytes; the kernel converts the weights inside
the product. Which modules become :class:`Int8Linear` is the precision's choice
(:func:`~speculum.models.hf.precision.quantise_int8`); whether its rows come out alone is probed like every
product's (:mod:`~speculum.models.hf.kernels.products`).

Example:
    >>> import torch
    >>> layer = torch.nn.Linear(64, 32, bias=False)
    >>> quantised = Int8Linear.from_linear(layer)
    >>> x = torch.randn(3, 64)
    >>> bool(torch.allclose(quantised(x), layer(x), atol=0.05))
    True
"""
from __future__ import annotations

import torch

__all__ = ["Int8Linear"]


class Int8Linear(torch.nn.Module):
    """A bias-free Linear with int8 weights and a float32 scale per output channel (symmetric, round to
    nearest: ``weight ~ scales[:, None] * weight_int8``): ``x @ (scales * weight_int8).T`` computed by
    ``torch.ops.aten._weight_int8pack_mm`` on float32 activations."""

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8.contiguous())      # (out, in) int8
        self.register_buffer("scales", scales.contiguous())                # (out,) float32

    @classmethod
    def from_linear(cls, layer: torch.nn.Linear) -> "Int8Linear":
        weight = layer.weight.detach().float()                             # (out, in)
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        quantised = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(quantised, scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:              # (..., in) -> (..., out)
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        return out.reshape(*x.shape[:-1], self.out_features)
