"""The target's precision (``dtype``): int8 weight-only and bfloat16 targets, and the advice on which dtype pays.

Invariants: an :class:`Int8Linear` computes the product of its dequantised weights (to float rounding); an
int8 target runs the fused forward with the same kernels for one session and for packed ones; greedy
speculative output of an int8 target equals that target's plain greedy output; the batched rows equal its
sessions' rows; a bfloat16 target runs the fused forward (bfloat16 weights, float32 activations) with
products that give each row the same in any batch, its batched rows equal its sessions' rows to bfloat16
rounding, and it is closer to float32 than transformers' bfloat16 forward; a bad dtype is a clear error;
bfloat16 / float16 advice follows the CPU's flags.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import speculum  # noqa: E402
from support.hf_tiny import save_tiny_model  # noqa: E402
from speculum.models import PromptLookup  # noqa: E402
from speculum.models.base import Feed  # noqa: E402
from speculum.models.hf import HFModel  # noqa: E402
from speculum.models.hf.kernels.int8_weights import Int8Linear  # noqa: E402
from speculum.models.hf.precision import dtype_advice, parse_dtype, quantise_int8  # noqa: E402
from speculum.validation import InputError  # noqa: E402

# The int8 warning (its kernel is slower than float32) is checked by the advice test, not repeated here.
pytestmark = pytest.mark.filterwarnings("ignore:dtype=int8")


@pytest.fixture(scope="module")
def tiny_int8(tmp_path_factory) -> HFModel:
    return HFModel.from_pretrained(save_tiny_model(tmp_path_factory.mktemp("tiny8") / "model"), dtype="int8")


@pytest.mark.parametrize("shape", [(32, 64), (96, 32), (7, 16)])
def test_int8_linear_is_the_product_of_its_dequantised_weights(shape):
    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(shape[1], shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(shape, generator=generator))
    quantised = Int8Linear.from_linear(layer)
    dequantised = quantised.weight_int8.float() * quantised.scales[:, None]
    assert (dequantised - layer.weight).abs().max() <= quantised.scales.max() / 2 + 1e-6   # round to nearest
    x = torch.randn(5, 3, shape[1], generator=generator)
    torch.testing.assert_close(quantised(x), x @ dequantised.T, rtol=1e-5, atol=1e-5)


def test_quantise_int8_replaces_every_bias_free_linear():
    module = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    assert quantise_int8(module) == 1
    assert type(module[0]) is Int8Linear and type(module[2]) is torch.nn.Linear


def test_an_int8_target_runs_the_fused_forward_and_speculation_is_exact(tiny_int8):
    assert tiny_int8.fused_forward and tiny_int8.capabilities.batched_extend
    prompt = [1, 3, 4, 5, 3, 4]
    plain = speculum.generate(tiny_int8, prompt, max_new_tokens=20, temperature=0, eos_token_id=None)
    fast = speculum.generate(tiny_int8, prompt, draft=PromptLookup(), gamma=3, max_new_tokens=20, temperature=0,
                             eos_token_id=None)
    assert fast.tokens == plain.tokens


def test_int8_batched_calls_and_packed_sessions_equal_each_sessions_own_rows(tiny_int8):
    prefixes = [[1, 3], [1, 3, 4], [5, 6, 7, 8]]
    rows = tiny_int8.next_logprobs(prefixes)
    for prefix, row in zip(prefixes, rows):
        np.testing.assert_allclose(row, tiny_int8.start(prefix).next_logprobs(), atol=1e-4)
    sessions = [tiny_int8.start([1, 3]), tiny_int8.start([4, 5, 6])]
    packed = tiny_int8.extend_sessions([Feed(sessions[0], [7, 8]), Feed(sessions[1], [9])])
    alone = [tiny_int8.start([1, 3]).extend([7, 8]), tiny_int8.start([4, 5, 6]).extend([9])]
    for a, b in zip(packed, alone):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_int8_is_its_own_target_close_to_float32(tmp_path):
    path = save_tiny_model(tmp_path / "model")
    exact, small = HFModel.from_pretrained(path), HFModel.from_pretrained(path, dtype="int8")
    row, other = exact.start([1, 3, 4]).next_logprobs(), small.start([1, 3, 4]).next_logprobs()
    assert not np.array_equal(row, other)                                  # another target ...
    assert float(np.sum(np.exp(row) * (row - other))) < 0.05               # ... close to float32's


def test_a_bad_dtype_is_a_clear_error(tmp_path):
    with pytest.raises(InputError, match="dtype must be one of float32, bfloat16, float16, int8"):
        parse_dtype("int4")
    with pytest.raises(InputError, match="dtype"):
        speculum.load_model("smollm2-135m", dtype="float64")


@pytest.mark.parametrize("dtype, flags, slow", [
    ("bfloat16", {"avx2"}, True), ("bfloat16", {"avx512_bf16"}, False), ("bfloat16", {"amx_bf16"}, False),
    ("float16", {"avx512f"}, True), ("float16", {"avx512_fp16"}, False), ("float32", {"avx2"}, False),
    ("int8", {"avx2"}, True), ("int8", {"amx_int8"}, True), ("bfloat16", set(), False),
])
def test_dtype_advice_follows_the_cpus_flags(dtype, flags, slow):
    assert (dtype_advice(dtype, frozenset(flags)) is not None) == slow


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory) -> HFModel:
    return HFModel.from_pretrained(save_tiny_model(tmp_path_factory.mktemp("tiny16") / "model"), dtype="bfloat16")


def test_a_bfloat16_target_runs_the_fused_forward_with_row_invariant_products(tiny_bf16):
    from speculum.models.hf.kernels.probe import gives_rows_alone

    assert tiny_bf16.fused_forward and tiny_bf16.dtype == torch.bfloat16
    rotary = tiny_bf16.module.model.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32          # angles are not rounded to bfloat16
    fused = tiny_bf16.fused
    block = fused.blocks[0]
    hidden = fused.embed.shape[1]
    intermediate = block.gate_up(torch.zeros(1, hidden)).shape[1] // 2
    for product, width in ((block.qkv, hidden), (block.gate_up, hidden), (block.down, intermediate),
                           (fused.head, hidden)):
        assert gives_rows_alone(product, width, torch.Generator().manual_seed(3))
    # Speculative sampling stays a valid draw of the target's tokens.
    out = speculum.generate(tiny_bf16, [1, 3, 4, 5, 3, 4], draft=PromptLookup(), gamma=3, max_new_tokens=12,
                            temperature=1.0, seed=0, eos_token_id=None)
    assert len(out.tokens) == 12 and all(0 <= t < tiny_bf16.vocab_size for t in out.tokens)


def test_bfloat16_batched_calls_and_packed_sessions_equal_each_sessions_own_rows(tiny_bf16):
    prefixes = [[1, 3], [1, 3, 4], [5, 6, 7, 8]]
    rows = tiny_bf16.next_logprobs(prefixes)
    # Batch shapes change bfloat16 products' blocking: rows agree to bfloat16 rounding of the products.
    for prefix, row in zip(prefixes, rows):
        np.testing.assert_allclose(row, tiny_bf16.start(prefix).next_logprobs(), atol=0.05)
    sessions = [tiny_bf16.start([1, 3]), tiny_bf16.start([4, 5, 6])]
    packed = tiny_bf16.extend_sessions([Feed(sessions[0], [7, 8]), Feed(sessions[1], [9])])
    alone = [tiny_bf16.start([1, 3]).extend([7, 8]), tiny_bf16.start([4, 5, 6]).extend([9])]
    for a, b in zip(packed, alone):
        np.testing.assert_allclose(a, b, atol=0.05)
    assert np.allclose(tiny_bf16.score_sequences([[7, 8]], [1, 3]),
                       rows[0][7] + tiny_bf16.start([1, 3, 7]).next_logprobs()[8], atol=0.05)


def test_bfloat16_fused_is_closer_to_float32_than_transformers_bfloat16(tmp_path):
    path = save_tiny_model(tmp_path / "model")
    exact = HFModel.from_pretrained(path)
    fused = HFModel.from_pretrained(path, dtype="bfloat16")
    plain = HFModel.from_pretrained(path, dtype="bfloat16", prepack=False)
    assert fused.fused_forward and not plain.fused_forward

    def divergence(model: HFModel) -> float:
        total = 0.0
        for prompt in ([1, 3, 4, 5, 6, 7, 8, 9], [2, 9, 9, 4, 1, 7], [5] * 12):
            row, other = exact.start(prompt).next_logprobs(), model.start(prompt).next_logprobs()
            total += float(np.sum(np.exp(row) * (row - other)))
        return total

    assert 0 < divergence(fused) < divergence(plain)


def test_a_large_bfloat16_module_is_probed_without_widening_it(tmp_path, monkeypatch):
    """Past the float32 budget the load-time probe compares with transformers' own bfloat16 forward
    (no float32 copy of the module at load): the fused forward is still taken, and the weights are
    untouched bfloat16."""
    from speculum.models.hf.forward import fused

    monkeypatch.setattr(fused, "_SELF_CHECK_FLOAT32_BYTES", 0)
    widened = []
    monkeypatch.setattr(fused, "cast_module", lambda *a: widened.append(a))
    model = HFModel.from_pretrained(save_tiny_model(tmp_path / "model"), dtype="bfloat16")
    assert model.fused_forward and not widened
    assert {p.dtype for p in model.module.parameters()} == {torch.bfloat16}
