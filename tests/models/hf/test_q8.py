"""The ``q8`` target: rows quantised to 8 bits in blocks of 32 (llama.cpp's Q8_0 / Q8_1 rounding), multiplied by
GGUF weight groups with integer dot products. Its products are checked against a numpy reference of the
formula the C source states (bit for bit), against float32 (close), and row by row (each row alone)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from speculum.models.hf.kernels.gguf_records import pack  # noqa: E402
from speculum.models.hf.kernels.probe import gives_rows_alone  # noqa: E402
from speculum.models.hf.kernels.q8_groups import q8_run, q8_unavailable, quantised_rows  # noqa: E402
from support.grouped_weights import random_blocks  # noqa: E402

pytestmark = pytest.mark.skipif(q8_unavailable() is not None, reason=f"8-bit kernel unavailable: {q8_unavailable()}")

ROW_COUNTS = (1, 2, 5, 17, 300)


def reference_quantised(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q8_1_ref in numpy float32 (the scale kept float32): per block of 32, d = amax
    / 127, q = roundf(x * (1 / d)) (half away from zero), the sum of q."""
    blocks = rows.astype(np.float32).reshape(rows.shape[0], -1, 32)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    scaled = blocks * inverse[..., None]
    whole = np.trunc(scaled)
    fraction = scaled - whole
    q = (whole + (fraction >= 0.5) - (fraction <= -0.5)).astype(np.int64)
    return q.reshape(rows.shape).astype(np.int8), d.astype(np.float32), q.sum(axis=-1).astype(np.int32)


def reference_product(weight, rows: np.ndarray) -> np.ndarray:
    """The C source's formula in numpy float32: per group in order, ``out += (scale * d) * I`` and for q4_1
    ``out += (minimum * d) * S``, with I the exact integer dot product of the group's quants."""
    records = weight.records.numpy()
    blocks, groups = records.shape[:2]
    floats = records[..., :128].copy().view(np.float32).reshape(blocks, groups, -1, 16)
    scale = floats[:, :, 0]                                                   # (blocks, groups, 16)
    if weight.kind == "q8_0":
        quants = records[..., 64:].copy().view(np.int8).reshape(blocks, groups, 32, 16).astype(np.int64)
    else:
        start = 128 if weight.kind == "q4_1" else 64
        pairs = records[..., start:start + 256].reshape(blocks, groups, 16, 16).astype(np.int64)
        quants = np.concatenate([pairs & 15, pairs >> 4], axis=2)
        if weight.kind == "q4_0":
            quants = (quants ^ 8) - 8
    q, d, sums = reference_quantised(rows)
    xq = q.astype(np.int64).reshape(rows.shape[0], groups, 32)
    out = np.zeros((rows.shape[0], blocks, 16), np.float32)
    for g in range(groups):
        integer = np.einsum("rk,bkl->rbl", xq[:, g], quants[:, g]).astype(np.float32)
        out = out + (scale[None, :, g] * d[:, g, None, None]) * integer
        if weight.kind == "q4_1":
            minimum = floats[:, g, 1]
            out = out + (minimum[None] * d[:, g, None, None]) * sums[:, g, None, None].astype(np.float32)
    return out.reshape(rows.shape[0], -1)


def _blocks(kind: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "q4_0":      # a Q4_0 block is a Q4_1 block without the minimum: 18 bytes
        q41 = random_blocks("q4_1", rows, columns, rng).reshape(rows, -1, 20)
        return np.concatenate([q41[..., :2], q41[..., 4:]], axis=-1).reshape(rows, -1)
    return random_blocks(kind, rows, columns, rng)


def test_rows_are_quantised_as_llama_cpp_rounds():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((7, 128)).astype(np.float32)
    rows[1, :32] = 0                                 # a block of zeros: d = 0, q = 0
    rows[2, 32:64] = np.arange(32) - 15.5            # halves: rounded away from zero
    rows[3] *= 1e-30
    q, d, sums = quantised_rows(torch.from_numpy(rows))
    expected = reference_quantised(rows)
    assert np.array_equal(q.numpy(), expected[0])
    assert np.array_equal(d.numpy(), expected[1])
    assert np.array_equal(sums.numpy(), expected[2])
    assert int(q.abs().max()) == 127 and not q[1, :32].any()


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
def test_product_is_the_stated_formula_close_to_float32_and_row_alone(kind):
    rng = np.random.default_rng(1)
    weight = pack(kind, _blocks(kind, 48, 160, rng))
    product = q8_run([weight])
    expanded = weight.expanded()
    whole = torch.randn(max(ROW_COUNTS), 160, generator=torch.Generator().manual_seed(3))
    for count in ROW_COUNTS:
        rows = whole[:count]
        out = product(rows)
        assert np.array_equal(out.numpy(), reference_product(weight, rows.numpy()))
        assert torch.equal(out, product(whole)[:count])
        exact = rows @ expanded.T
        assert float((out - exact).abs().max()) <= 2e-2 * float(exact.abs().max())
    assert gives_rows_alone(product, 160, torch.Generator().manual_seed(0))


def test_layers_of_two_kinds_run_side_by_side():
    rng = np.random.default_rng(4)
    weights = [pack("q4_1", _blocks("q4_1", 32, 64, rng)), pack("q8_0", _blocks("q8_0", 16, 64, rng)),
               pack("q8_0", _blocks("q8_0", 32, 64, rng))]
    product = q8_run(weights)
    rows = torch.randn(3, 64)
    assert product.kind == "q4_1+q8_0"
    assert torch.equal(product(rows), torch.cat([q8_run([w])(rows) for w in weights], dim=1))
    with pytest.raises(ValueError, match="not q6_k"):
        q8_run([pack("q6_k", np.zeros((16, 210), np.uint8))])
