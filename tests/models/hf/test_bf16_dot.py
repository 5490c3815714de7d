"""bfloat16 products by AVX-512 BF16 dot products (speculum.models.hf.kernels.bf16_dot).

Invariants, where this CPU has AVX-512 BF16 and the kernel builds: each output is the float32 sum of the
bfloat16-rounded rows times the bfloat16 weights (to float32 rounding of the sum); every row is bitwise the
same alone, among 2, 7, 33 or 300 rows and at 1 or 2 threads; without AMX tiles a bfloat16 model's fused
forward multiplies on it, its rows are canonical and greedy speculative output is plain greedy output.
Everywhere: ``SPECULUM_KERNELS=off`` turns it off with that reason.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from support.bf16_products import check_bfloat16_product  # noqa: E402
from speculum.models.hf.kernels import bf16_dot  # noqa: E402
from speculum.models.hf.kernels.amx_tiles import tiles_unavailable  # noqa: E402
from speculum.models.hf.kernels.bf16_dot import DotProduct, dot_unavailable  # noqa: E402
from speculum.models.hf.kernels.probe import gives_rows_alone  # noqa: E402
from speculum.models.hf.kernels.products import build_product, product_paths  # noqa: E402

needs_dot = pytest.mark.skipif(dot_unavailable() is not None, reason=f"no bfloat16 dot kernel: {dot_unavailable()}")


@needs_dot
@given(st.integers(1, 70), st.integers(1, 100), st.integers(0, 40), st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_dot_products_are_float32_sums_of_the_rounded_rows_each_row_alone(out_features, in_features, rows, seed):
    check_bfloat16_product(DotProduct, out_features, in_features, rows, seed)


@needs_dot
def test_each_row_is_the_same_alone_among_others_and_at_any_thread_count():
    generator = torch.Generator().manual_seed(0)
    product = DotProduct(torch.randn(1000, 576, generator=generator).bfloat16())      # a last block of 8 lanes
    inputs = torch.randn(300, 576, generator=generator)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([product(row[None]) for row in inputs])
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (2, 7, 33, 300):
                for start in (0, 300 - rows):
                    assert torch.equal(product(inputs[start:start + rows]), alone[start:start + rows])
    finally:
        torch.set_num_threads(threads)
    assert gives_rows_alone(product, 576, torch.Generator().manual_seed(1))


@needs_dot
@pytest.mark.skipif(tiles_unavailable() is None, reason="the AMX tiles take the bfloat16 products")
def test_without_tiles_a_bfloat16_product_runs_on_the_dot_kernel():
    layers = [torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16) for _ in range(2)]
    product = build_product(layers)
    assert isinstance(product.run, DotProduct) and product.rows_alone
    rows = torch.randn(5, 64)
    assert torch.equal(product(rows), torch.cat([DotProduct(layer.weight)(rows) for layer in layers], dim=1))
    assert product_paths()["bf16_dot"] is not None
    with pytest.raises(ValueError, match="expected rows of 64"):
        product.run(torch.randn(2, 63))


@needs_dot
@pytest.mark.skipif(tiles_unavailable() is None, reason="the AMX tiles take the bfloat16 products")
def test_a_bfloat16_model_multiplies_on_it_and_speculative_greedy_is_plain_greedy(tmp_path):
    pytest.importorskip("transformers")
    import speculum
    from speculum.models import PromptLookup
    from speculum.models.hf import HFModel
    from support.hf_tiny import save_tiny_model

    model = HFModel.from_pretrained(save_tiny_model(tmp_path / "tiny"), dtype="bfloat16")
    block = model.fused.blocks[0]
    assert all(isinstance(product.run, DotProduct) for product in (block.qkv, block.out, block.gate_up, block.down))
    assert model.capabilities.canonical_rows
    prompt = [1, 5, 9, 4, 7, 5, 9, 4, 7, 2]
    plain = speculum.generate(model, prompt, max_new_tokens=24, temperature=0, eos_token_id=None)
    speculative = speculum.generate(model, prompt, draft=PromptLookup(), gamma=4, max_new_tokens=24, temperature=0,
                                    eos_token_id=None)
    assert speculative.tokens == plain.tokens


def test_the_switch_turns_it_off_with_its_reason(monkeypatch):
    monkeypatch.setenv("SPECULUM_KERNELS", "off")
    assert "SPECULUM_KERNELS=off" in dot_unavailable()
    with pytest.raises(RuntimeError, match="SPECULUM_KERNELS=off"):
        DotProduct(torch.zeros(16, 32, dtype=torch.bfloat16))
    assert product_paths()["bf16_dot"] is None


def test_without_avx512_bf16_the_reason_is_given(monkeypatch):
    monkeypatch.delenv("SPECULUM_KERNELS", raising=False)       # the CPU's reason, not the switch's
    monkeypatch.setattr(bf16_dot, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    bf16_dot.forget()
    try:
        assert dot_unavailable() == "this CPU has no AVX-512 BF16"
    finally:
        bf16_dot.forget()
