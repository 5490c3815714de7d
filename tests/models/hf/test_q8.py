"""The ``q8`` target: rows quantised to 8 bits in blocks of 32 (llama.cpp's Q8_0 / Q8_1 rounding), multiplied by
GGUF weight groups with integer dot products. Its products are checked against a numpy reference of the
formula the C source states (bit for bit), against float32 (close), and row by row (each row alone)."""
from __future__ import annotations

import copy
import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

import speculum  # noqa: E402
from speculum.drafts import PromptLookup  # noqa: E402
from speculum.drafts.twins import int8_twin, truncated_draft  # noqa: E402
from speculum.models.hf import HFModel  # noqa: E402
from speculum.models.hf.kernels.build import FLAGS  # noqa: E402
from speculum.models.hf.kernels.gguf_records import pack  # noqa: E402
from speculum.models.hf.kernels.probe import gives_rows_alone  # noqa: E402
from speculum.models.hf.kernels.q8_groups import (Q8_KINDS, Q8Product, factored, q8_run, q8_source,  # noqa: E402
                                                  q8_unavailable, quantised_rows, repack, vector_bits)
from speculum.models.hf.precision import DTYPES, dtype_advice, parse_dtype, prepare_module  # noqa: E402
from speculum.validation import InputError  # noqa: E402
from support.grouped_weights import grouped_tiny  # noqa: E402
from support.hf_tiny import save_tiny_model  # noqa: E402

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
    """The C source's formula in numpy float32: per group in order, ``out = fma(scale * d, I, out)`` (and for
    q4_1, q5_1 ``out = fma(minimum, d * S, out)``; for q6_k one term per 16 inputs), with I the exact integer
    dot product of the group's quants (minus offset * S where the weight is ``scale * (q - offset)``)."""
    records = weight.records.numpy()
    blocks, groups = records.shape[:2]
    two = weight.kind in ("q4_1", "q5_1", "q6_k")
    floats = records[..., :128 if two else 64].copy().view(np.float32).reshape(blocks, groups, -1, 16)
    quants = _signed_quants(weight.kind, records[..., 128 if two else 64:])       # (blocks, groups, 32, 16)
    q, d, sums = reference_quantised(rows)
    xq = q.astype(np.int64).reshape(rows.shape[0], groups, 32)
    out = np.zeros((rows.shape[0], blocks, 16), np.float32)
    for g in range(groups):
        halves = [slice(0, 16), slice(16, 32)] if weight.kind == "q6_k" else [slice(0, 32)]
        for half, inputs in enumerate(halves):
            integer = np.einsum("rk,bkl->rbl", xq[:, g, inputs], quants[:, g, inputs]).astype(np.float32)
            out = fma32(floats[None, :, g, half] * d[:, g, None, None], integer, out)
        if weight.kind in ("q4_1", "q5_1"):
            d_sum = d[:, g] * sums[:, g].astype(np.float32)
            out = fma32(floats[None, :, g, 1], d_sum[:, None, None], out)
    return out.reshape(rows.shape[0], -1)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``a * b + c`` rounded once to float32, as the fused multiply-add instruction. The product of two float32
    is exact in float64; the float64 sum is rounded to odd (Boldo and Melquiond 2008: inexact sums take the odd
    one of their two float64 neighbours), which makes its rounding to float32 that of the exact sum."""
    product = a.astype(np.float64) * b.astype(np.float64)
    addend = np.broadcast_to(c, product.shape).astype(np.float64)
    total = product + addend
    virtual = total - product                      # Knuth's two-sum: what the float64 sum dropped, exactly
    dropped = (product - (total - virtual)) + (addend - virtual)
    even = (total.view(np.int64) & 1) == 0
    odd = np.where(dropped > 0, np.nextafter(total, np.inf), np.nextafter(total, -np.inf))
    return np.where((dropped != 0) & even, odd, total).astype(np.float32)


def _signed_quants(kind: str, quants: np.ndarray) -> np.ndarray:
    """The integer weights of records (gguf_records.py's layout): q, or q - offset where the weight is
    ``scale * (q - offset)``, as int64 ``(blocks, groups, 32 inputs, 16 lanes)``."""
    blocks, groups = quants.shape[:2]
    if kind == "q8_0":
        return quants.copy().view(np.int8).reshape(blocks, groups, 32, 16).astype(np.int64)
    pairs = quants[..., :256].reshape(blocks, groups, 16, 16).astype(np.int64)
    values = np.concatenate([pairs & 15, pairs >> 4], axis=2)
    lane = np.arange(16)
    if kind in ("q5_0", "q5_1"):
        values |= ((quants[..., 256:].copy().view(np.uint16).astype(np.int64)[..., None] >> lane) & 1) << 4
    if kind == "q6_k":
        values |= ((quants[..., 256:].copy().view(np.uint32).astype(np.int64)[..., None] >> (2 * lane)) & 3) << 4
    bits = {"q4_0": 4, "q5_0": 5, "q6_k": 6}.get(kind)
    if bits is None:
        return values
    return values - ((values >> (bits - 1)) << bits)        # stored q XOR offset: q - offset, sign-extended


# GGUF block (weights, bytes) and the float16 fields of each type (scale, minimum / dmin).
_GGUF = {"q4_0": (32, 18, (0,)), "q4_1": (32, 20, (0, 2)), "q5_0": (32, 22, (0,)), "q5_1": (32, 24, (0, 2)),
         "q8_0": (32, 34, (0,)), "q4_k": (256, 144, (0, 2)), "q5_k": (256, 176, (0, 2)), "q6_k": (256, 210, (208,))}


def _blocks(gguf_type: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF blocks of ``gguf_type``: random quants, small float16 scales (and minimums)."""
    per_block, size, halves = _GGUF[gguf_type]
    blocks = rng.integers(0, 256, size=(rows, columns // per_block, size), dtype=np.uint8)
    for at in halves:
        values = rng.uniform(0.001, 0.05 if per_block == 32 else 0.004, size=blocks.shape[:2])
        blocks[..., at:at + 2] = values.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


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
    assert np.array_equal(sums.numpy(), expected[0].astype(np.int32).reshape(7, 4, 2, 16).sum(axis=-1))
    assert np.array_equal(sums.numpy().sum(axis=-1), expected[2])
    assert int(q.abs().max()) == 127 and not q[1, :32].any()


@pytest.mark.parametrize("gguf_type", list(_GGUF))
def test_product_is_the_stated_formula_close_to_float32_and_row_alone(gguf_type):
    rng = np.random.default_rng(1)
    weight = pack(gguf_type, _blocks(gguf_type, 48, 256, rng))
    product = q8_run([weight])
    expanded = weight.expanded()
    whole = torch.randn(max(ROW_COUNTS), 256, generator=torch.Generator().manual_seed(3))
    for count in ROW_COUNTS:
        rows = whole[:count]
        out = product(rows)
        assert np.array_equal(out.numpy(), reference_product(weight, rows.numpy()))
        assert torch.equal(out, product(whole)[:count])
        exact = rows @ expanded.T
        assert float((out - exact).abs().max()) <= 2e-2 * float(exact.abs().max())
    assert gives_rows_alone(product, 256, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("gguf_type", list(_GGUF))
def test_the_largest_quants_times_the_largest_inputs_are_the_stated_formula(gguf_type):
    """Every weight quant at its largest magnitude times rows whose quants are all +127 or all -127: the integer
    sums' extremes (the AVX2 path adds up to 8 of maddubs' int16 pair sums before widening them), bit for bit
    the formula."""
    per_block, size, halves = _GGUF[gguf_type]
    blocks = _blocks(gguf_type, 16, 256, np.random.default_rng(12)).reshape(16, -1, size)
    quants = np.ones(size, dtype=bool)
    for at in halves:
        quants[at:at + 2] = False                        # the float16 fields keep their small values
    blocks[:, :, quants] = 0x80 if gguf_type == "q8_0" else 0xFF     # q8_0: -128; the others: every bit set
    weight = pack(gguf_type, blocks.reshape(16, -1))
    rows = torch.ones(4, 256)
    rows[1] = -1
    rows[2, ::2] = -1                                    # signs alternating within each block
    rows[3, 128:] = -1
    assert torch.equal(quantised_rows(rows)[0].abs(), torch.full((4, 256), 127, dtype=torch.int8))
    assert np.array_equal(q8_run([weight])(rows).numpy(), reference_product(weight, rows.numpy()))


@pytest.mark.parametrize("gguf_type", ["q4_k", "q5_k", "q6_k"])
def test_k_quant_floats_are_kept_factored_smaller_and_multiply_to_the_same_bits(gguf_type):
    """K-quant records' floats factor per super-block (a float32 a lane times an int8 a group): fewer bytes,
    the same outputs as the records' float32 values, for several super-blocks, with negative d (Q6_K's
    scale -128 times it needs the factor negated), zero scales and minimums among them."""
    rng = np.random.default_rng(6)
    blocks = _blocks(gguf_type, 32, 768, rng)
    d_at, scales_at = {"q6_k": (208, slice(192, 208))}.get(gguf_type, (0, slice(4, 16)))
    blocks[0, d_at:d_at + 2] = np.float16(-0.003).reshape(1).view(np.uint8)    # a negative d
    blocks[2, d_at:d_at + 2] = np.float16(-0.003).reshape(1).view(np.uint8)
    blocks[2, scales_at] = 0x80 if gguf_type == "q6_k" else blocks[2, scales_at]     # its scales -128
    blocks[1, scales_at] = 0                                                    # every sub-block scale (and minimum) 0
    weight = pack(gguf_type, blocks)
    product = q8_run([weight])
    assert product.kind == {"q4_k": "q4_1f", "q5_k": "q5_1f", "q6_k": "q6_kf"}[gguf_type]
    assert product.records.numel() * 6 <= weight.records.numel() * 5 - 1        # at least a sixth fewer bytes
    rows = torch.randn(19, 768, generator=torch.Generator().manual_seed(4))
    assert np.array_equal(product(rows).numpy(), reference_product(weight, rows.numpy()))


def unfactored(weight):
    """``weight`` with one float of its first record replaced by one that factors with no other (a float32
    of 24 significant bits): its product keeps the unfactored records."""
    records = weight.records.clone()
    records[0, 0, :4] = torch.tensor([0.1234567], dtype=torch.float32).view(torch.uint8)
    return type(weight)(weight.kind, records, weight.out_features, weight.in_features)


def test_floats_that_do_not_factor_keep_their_records():
    rng = np.random.default_rng(7)
    weight = unfactored(pack("q6_k", _blocks("q6_k", 16, 512, rng)))
    product = q8_run([weight])
    rows = torch.randn(11, 512, generator=torch.Generator().manual_seed(5))
    assert product.kind == "q6_k" and np.array_equal(product(rows).numpy(), reference_product(weight, rows.numpy()))
    assert factored("q4_1", repack(pack("q4_1", _blocks("q4_1", 16, 256, rng)))) is None   # independent float16s
    assert factored("q4_1", repack(pack("q4_k", _blocks("q4_k", 16, 256, rng)))[:, :4]) is None   # not whole
    assert factored("q8_0", repack(pack("q8_0", _blocks("q8_0", 16, 256, rng)))) is None    # no factored form
    assert q8_run([pack("q4_1", _blocks("q4_1", 16, 256, rng))]).kind == "q4_1"


def test_products_do_not_depend_on_the_thread_count():
    weight = pack("q4_1", _blocks("q4_1", 64, 128, np.random.default_rng(5)))
    product, rows = q8_run([weight]), torch.randn(37, 128)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = product(rows)
        torch.set_num_threads(2)
        assert torch.equal(product(rows), alone)
    finally:
        torch.set_num_threads(before)
    held, out = torch.empty(37, 128), torch.empty(37, 64)     # bound to buffers: the same rows
    bound = product.bind(held, out)
    held.copy_(rows)
    bound(2)
    assert torch.equal(out, alone)
    with pytest.raises(ValueError, match="cannot bind"):
        product.bind(held.double(), out)


def test_layers_of_two_kinds_run_side_by_side():
    rng = np.random.default_rng(4)
    weights = [pack("q4_1", _blocks("q4_1", 32, 64, rng)), pack("q8_0", _blocks("q8_0", 16, 64, rng)),
               pack("q8_0", _blocks("q8_0", 32, 64, rng))]
    product = q8_run(weights)
    rows = torch.randn(3, 64)
    assert product.kind == "q4_1+q8_0"
    assert torch.equal(product(rows), torch.cat([q8_run([w])(rows) for w in weights], dim=1))
    with pytest.raises(ValueError, match="one input width"):
        q8_run([weights[0], pack("q8_0", _blocks("q8_0", 16, 32, rng))])


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_avx2_build_computes_the_native_builds_bits(tmp_path):
    """The AVX2 path (4 rows a pass, its own quantiser) against this CPU's build: quantised rows, with zeros,
    halves and NaN among them, and every record kind at every row count across the passes and the tiles."""
    if vector_bits() != 512:
        pytest.skip("this CPU builds the AVX2 path itself")
    # Without OpenMP (no second runtime in this process): one thread gives the same bits as any other count.
    flags = ["-march=x86-64-v3" if flag == "-march=native" else flag for flag in FLAGS if flag != "-fopenmp"]
    built = tmp_path / "q8-avx2.so"
    subprocess.run(["gcc", *flags, "-shared", str(q8_source()), "-o", str(built)], check=True, capture_output=True)
    other = ctypes.CDLL(str(built))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    assert other.q8_vector_bits() == 256
    rows = torch.randn(300, 256, generator=torch.Generator().manual_seed(8)) * 3
    rows[1, :32], rows[2, 32:64], rows[3, 70] = 0, torch.arange(32) - 15.5, float("nan")
    theirs = (torch.empty(300, 256, dtype=torch.int8), torch.empty(300, 8), torch.empty(300, 8, 2, dtype=torch.int32))
    other.quantise_rows.argtypes = [pointer, size, size, pointer, pointer, pointer, ctypes.c_int]
    other.quantise_rows(rows.data_ptr(), 300, 256, *(t.data_ptr() for t in theirs), 1)
    for ours, its in zip(quantised_rows(rows), theirs):
        assert torch.equal(ours, its)
    rows[3, 70] = 1.0
    rng = np.random.default_rng(9)
    for gguf_type in ("q4_0", "q4_1", "q5_0", "q5_1", "q6_k", "q8_0", "q4_k", "q5_k", "q6_k unfactored"):
        weight = pack(gguf_type.split()[0], _blocks(gguf_type.split()[0], 32, 256, rng))
        if gguf_type == "q6_k unfactored":
            weight = unfactored(weight)
        product = q8_run([weight])
        assert product.kind in (*Q8_KINDS, "q4_1f", "q5_1f", "q6_kf")
        function = getattr(other, f"{product.kind}_rows")
        function.argtypes = [pointer, size, size, pointer, size, pointer, ctypes.c_int]
        for count in (*range(1, 19), 129, 300):
            out = torch.empty(count, 32)
            assert function(rows.data_ptr(), count, 256, product.records.data_ptr(), 32, out.data_ptr(), 1) == 0
            assert torch.equal(out, product(rows[:count])), (gguf_type, count)


# ------------------------------------------------------------------------------------------ the q8 target

def _q8_tiny(folder):
    """The tiny Llama with random Q4_1 blocks and a Q8_0 head, as a ``q8`` model (and its float32 twin)."""
    grouped, groups = grouped_tiny(folder, "q4_1", head="q8_0")
    module = prepare_module(copy.deepcopy(grouped.module), "q8")
    return HFModel(module, grouped.tokenizer, groups=groups), HFModel(grouped.module, grouped.tokenizer, groups=groups)


def test_tiny_q8_model_runs_every_product_on_8_bit_rows_and_keeps_greedy_output(tmp_path):
    model, float32 = _q8_tiny(tmp_path)
    assert model.fused is not None and model.capabilities.canonical_rows
    kinds = [product.run.kind for product, _ in model.fused.products()]
    assert set(kinds) == {"q4_1", "q8_0"} and kinds[-1] == "q8_0"
    assert type(model.fused.products()[0][0].run) is Q8Product
    prompt = [1, 4, 5, 6, 4, 5, 6, 4, 5]
    ours, theirs = model.start(prompt).next_logprobs(), float32.start(prompt).next_logprobs()
    assert not np.array_equal(ours, theirs)                                 # another target ...
    assert float(np.abs(np.exp(ours) - np.exp(theirs)).sum()) < 0.1        # ... close to float32
    plain = speculum.generate(model, prompt, max_new_tokens=24, temperature=0).tokens
    assert speculum.generate(model, prompt, draft=PromptLookup(), max_new_tokens=24, temperature=0).tokens == plain
    # Twins are float-activation targets of their own; a truncated draft shares the q8 blocks.
    for draft in (int8_twin(model), truncated_draft(model, 1)):
        assert speculum.generate(model, prompt, draft=draft, max_new_tokens=24, temperature=0).tokens == plain


def test_q8_refuses_a_model_without_weight_groups(tmp_path):
    grouped, groups = grouped_tiny(tmp_path / "blocks")         # the head has no groups
    with pytest.raises(InputError, match="q8 multiplies a GGUF file's weight groups"):
        HFModel(prepare_module(grouped.module, "q8"), grouped.tokenizer, groups=groups)
    folder = save_tiny_model(tmp_path / "plain")
    with pytest.raises(InputError, match="q8 multiplies a GGUF file's weight groups"):
        speculum.load_model(str(folder), dtype="q8", progress=False)


def test_q8_without_its_kernels_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("SPECULUM_KERNELS", "off")
    with pytest.raises(InputError, match="q8 needs its compiled kernels: compiled kernels are off"):
        speculum.load_model(dtype="q8", progress=False)
    assert "does not run here" in dtype_advice("q8")


def test_q8_is_advised_wherever_its_kernel_runs():
    # AVX2's path too: q8 serves faster than float32 there (benchmarks/RESULTS.md).
    assert "q8" in DTYPES and parse_dtype("q8") == torch.float32
    assert dtype_advice("q8", frozenset({"avx2", "avx512f", "avx512_vnni"})) is None
    assert dtype_advice("q8", frozenset({"avx2", "fma"})) is None


def test_embedded_model_as_q8_keeps_greedy_output_under_prompt_lookup():
    model = speculum.load_model(dtype="q8", progress=False)
    assert model.capabilities.canonical_rows and model.grouped_layers == 30 * 7 + 1
    prompt = model.encode("List the days of the week: Monday, Tuesday, Wednesday, Thursday, then the days again:")
    plain = speculum.generate(model, prompt, max_new_tokens=40, temperature=0).tokens
    assert speculum.generate(model, prompt, draft=PromptLookup(), max_new_tokens=40, temperature=0).tokens == plain


@pytest.mark.slow
def test_embedded_model_as_q8_stays_close_to_float32():
    """8-bit activations move SmolLM2's next-token distributions by a few thousandths of a nat (measured:
    mean KL 5e-3 over a continuation, the greedy token the same at 93% of positions)."""
    float32, q8 = (speculum.load_model(dtype=dtype, progress=False) for dtype in ("float32", "q8"))
    prompt = float32.encode("Write a short story about a robot who learns to paint.")
    sequence = prompt + list(speculum.generate(float32, prompt, max_new_tokens=40, temperature=0).tokens)
    ours, theirs = (torch.log_softmax(model.fused(torch.tensor([sequence]), model.new_cache())[0], -1)
                    for model in (q8, float32))
    divergence = (theirs.exp() * (theirs - ours)).sum(-1)
    assert float(divergence.mean()) < 2e-2 and float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()) > 0.8
