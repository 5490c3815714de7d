"""The law every bfloat16 product kernel keeps (AMX tiles, AVX-512 BF16 dot products), checked in one place."""
from __future__ import annotations

import torch


def check_bfloat16_product(product_type, out_features: int, in_features: int, rows: int, seed: int) -> None:
    """A ``product_type(weight)`` of a random bfloat16 weight gives float32 ``(rows, out_features)``: each output
    the float32 sum of the bfloat16-rounded row times the weights, to float32 rounding of the sum of the terms'
    sizes; every row bitwise the same alone, and the middle rows the same without the first and last."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    inputs = torch.randn(rows, in_features, generator=generator) * 10
    product = product_type(weight)
    out = product(inputs)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32 and out.is_contiguous()
    terms = inputs.bfloat16().double()[:, None, :] * weight.double()[None, :, :]     # (rows, out, in)
    # float32 sums of exact products: within a few float32 roundings of the sum of the terms' sizes.
    assert torch.all((out.double() - terms.sum(-1)).abs() <= 4 * in_features * 2**-24 * terms.abs().sum(-1) + 1e-30)
    for start in range(rows):
        assert torch.equal(product(inputs[start:start + 1]), out[start:start + 1])
    if rows > 3:
        assert torch.equal(product(inputs[1:rows - 1]), out[1:rows - 1])
