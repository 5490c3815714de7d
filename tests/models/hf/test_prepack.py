"""CPU fast paths: pre-packed oneDNN Linear layers (same results as F.linear to float32 rounding, reversible,
copyable) and the fused Llama forward built on them."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import speculum  # noqa: E402
from support.hf_tiny import save_tiny_model  # noqa: E402
from speculum.models.hf.forward.fused import FusedForward  # noqa: E402
from speculum.models.hf import HFModel  # noqa: E402
from speculum.models.hf.kernels.onednn import is_prepacked, prepack_linears, unpack_linears, unpacked_copy  # noqa: E402
from speculum.drafts import make_draft  # noqa: E402
from speculum.drafts.twins import bf16_twin, int8_twin, truncated_draft  # noqa: E402

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [(1, 16), (5, 16), (2, 3, 16)])
def test_packed_linear_equals_f_linear(bias, rows):
    layer = torch.nn.Linear(16, 24, bias=bias)
    x = torch.randn(*rows)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert prepack_linears(layer) == 1 and is_prepacked(layer)
    assert prepack_linears(layer) == 0                       # idempotent
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    unpack_linears(layer)
    assert not is_prepacked(layer) and torch.equal(layer(x), expected)


@needs_onednn
def test_packed_linear_falls_back_where_it_cannot_apply():
    layer = torch.nn.Linear(8, 4)
    prepack_linears(layer)
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).sum().backward()                                # gradients: the default kernel, so they flow
    assert x.grad is not None and layer.weight.grad is not None
    half = torch.randn(3, 8, dtype=torch.bfloat16)
    assert layer.to(torch.bfloat16)(half).dtype == torch.bfloat16   # non-float32: F.linear on the weight


@needs_onednn
def test_unpacked_copy_is_plain_and_leaves_the_original_packed():
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    assert prepack_linears(module) == 2
    clone = unpacked_copy(module)
    assert all(is_prepacked(m) for m in module if isinstance(m, torch.nn.Linear))
    assert not any(is_prepacked(m) for m in clone if isinstance(m, torch.nn.Linear))
    x = torch.randn(4, 8)
    with torch.inference_mode():
        assert torch.allclose(module(x), clone(x), atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("path", ["fused", "prepacked"])
def test_hf_model_rows_match_default_kernels_and_drafts_still_build(tiny_path, monkeypatch, path):
    """Both CPU fast paths (the fused Llama forward; per-layer packing for other architectures, forced here
    by refusing the fused one) agree with transformers' default forward, and every draft still works."""
    if path == "prepacked":
        monkeypatch.setattr(FusedForward, "build", classmethod(lambda cls, module: None))
    packed = HFModel.from_pretrained(tiny_path)
    default = HFModel.from_pretrained(tiny_path, prepack=False)
    assert packed.fused_forward == (path == "fused") and not default.fused_forward
    assert (packed.prepacked_layers > 0) == (path == "prepacked") and default.prepacked_layers == 0
    prompt, tokens = [1, 3, 4, 5], [6, 7, 8, 9, 10]
    rows_packed = packed.start(prompt).extend(tokens)
    rows_default = default.start(prompt).extend(tokens)
    assert np.abs(rows_packed - rows_default).max() < 1e-4
    # Twins copy the target without its packed weights; the layer draft shares them.
    for draft in (int8_twin(packed), bf16_twin(packed), truncated_draft(packed, 1)):
        assert draft.start(prompt).next_logprobs().shape == (packed.vocab_size,)
    plain = speculum.generate(packed, prompt, max_new_tokens=12, temperature=0)
    for spec in ("int8", "layers:1", "lookup"):
        fast = speculum.generate(packed, prompt, draft=make_draft(spec, packed), max_new_tokens=12, temperature=0,
                                 gamma=3)
        assert fast.tokens == plain.tokens, spec
