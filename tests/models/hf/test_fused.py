"""The fused Llama forward: transformers' forward to float32 rounding on every path that uses it.

Invariants: every public HFModel call (sessions with rollback, batched trie rows, teacher-forced scores,
the layer-truncated draft) returns the same log-probs as the same model on transformers' own forward; it
is used only where it applies; the truncated draft shares the target's packed weights.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from support.hf_tiny import save_tiny_model  # noqa: E402
from speculum.models.hf.forward.fused import FusedForward, rms_norm, unsupported_reason  # noqa: E402
from speculum.models.hf import HFModel  # noqa: E402
from speculum.drafts.twins import bf16_twin, int8_twin, truncated_draft  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
TOLERANCE = 1e-4   # nats: float32 rounding of the tiny model's large random logits (differences seen: ~5e-6)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(fused, reference): the same tiny Llama with the fused forward and with transformers' forward."""
    path = save_tiny_model(tmp_path_factory.mktemp("fused") / "model", layers=3)
    fused, reference = HFModel.from_pretrained(path), HFModel.from_pretrained(path, prepack=False)
    assert fused.fused_forward and not reference.fused_forward
    return fused, reference


tokens_strategy = st.lists(st.integers(min_value=3, max_value=22), min_size=1, max_size=12)


@settings(max_examples=25, deadline=None)
@given(prompt=tokens_strategy, first=tokens_strategy, second=tokens_strategy, back=st.integers(0, 12))
def test_session_rows_match_after_extend_and_rollback(pair, prompt, first, second, back):
    fused, reference = pair
    back = min(back, len(first))
    rows = []
    for model in pair:
        session = model.start(prompt)
        session.extend(first)
        session.rollback(back)
        rows.append(np.vstack([session.extend(second), session.advance(first)[None, :]]))
    assert np.abs(rows[0] - rows[1]).max() < TOLERANCE
    assert fused.start(prompt).next_logprobs().argmax() == reference.start(prompt).next_logprobs().argmax()


@settings(max_examples=10, deadline=None)
@given(prefixes=st.lists(tokens_strategy, min_size=1, max_size=6), prompt=tokens_strategy)
def test_batched_rows_and_scores_match(pair, prefixes, prompt):
    """Batch > 1 through the trie (shared cache rows) and right-padded teacher forcing."""
    fused, reference = pair
    assert np.abs(fused.next_logprobs(prefixes) - reference.next_logprobs(prefixes)).max() < TOLERANCE
    got = fused.score_sequences(prefixes, prompt=prompt)
    want = reference.score_sequences(prefixes, prompt=prompt)
    assert np.abs(got - want).max() < TOLERANCE * 12


def test_truncated_draft_shares_packed_blocks_and_matches(pair):
    fused, reference = pair
    draft, reference_draft = truncated_draft(fused, 2), truncated_draft(reference, 2)
    assert draft.fused_forward and len(draft.fused.blocks) == 2
    assert all(a is b for a, b in zip(draft.fused.blocks, fused.fused.blocks))   # no second copy
    assert draft.fused.head is fused.fused.head
    prompt, tokens = [3, 4, 5, 6], [7, 8, 9]
    got = draft.start(prompt).extend(tokens)
    want = reference_draft.start(prompt).extend(tokens)
    assert np.abs(got - want).max() < TOLERANCE
    # Adopting the target's (fused-written) cache gives the draft's own rows.
    target_session, draft_session = fused.start(prompt + tokens), draft.start([3])
    assert draft_session.adopt_prefix_layers(target_session)
    assert np.abs(draft_session.next_logprobs() - got[-1]).max() < TOLERANCE


def test_applies_only_where_it_reproduces_the_forward(pair):
    fused, _ = pair
    assert unsupported_reason(fused.module) is None
    assert bf16_twin(fused).fused_forward                   # bfloat16 weights, float32 activations
    half = HFModel(bf16_twin(fused).module.to(torch.float16), prepack=False)
    assert "neither float32 nor bfloat16" in unsupported_reason(half.module)
    config = fused.module.config
    for field, value, words in (("model_type", "gpt2", "not one the fused forward covers"), ("attention_bias", True, "biased"),
                                ("hidden_act", "gelu", "activation")):
        saved = getattr(config, field)
        setattr(config, field, value)
        try:
            assert words in unsupported_reason(fused.module)
            assert FusedForward.build(fused.module) is None
        finally:
            setattr(config, field, saved)


def test_products_list_every_product_with_its_input_width(pair):
    fused, _ = pair
    forward = FusedForward.build(fused.module)
    products = forward.products()
    config = fused.module.config
    assert len(products) == 4 * config.num_hidden_layers + 1 and products[-1][0] is forward.head
    for product, width in products:
        assert product(torch.zeros(2, width)).shape[0] == 2
    assert products[-1][0](torch.zeros(1, products[-1][1])).shape == (1, fused.vocab_size)


def test_load_time_probe_rejects_a_forward_that_differs(pair, monkeypatch):
    fused, _ = pair
    built = FusedForward.build(fused.module)
    assert built is not None and built.self_check(fused.module) is None
    # A fused forward whose math drifted from transformers' (here: a wrong attention scale) is refused at
    # build time, with a warning, and the model keeps transformers' forward.
    monkeypatch.setattr(FusedForward, "__init__", _scaled_init)
    with pytest.warns(RuntimeWarning, match="differs from transformers' forward"):
        assert FusedForward.build(fused.module) is None


_original_init = FusedForward.__init__


def _scaled_init(self, module):
    _original_init(self, module)
    self.scale *= 1.5


def test_int8_twin_runs_fused_and_equals_its_own_forward(pair):
    # The int8 twin's quantised products run their own quantized::linear_dynamic ops inside the fused loop:
    # the same numbers as transformers' forward of the twin, without its per-module overhead.
    fused, _ = pair
    twin = int8_twin(fused)
    assert twin.fused_forward and unsupported_reason(twin.module) is None
    reference = HFModel(twin.module, fused.tokenizer, prepack=False)
    assert not reference.fused_forward
    prompt, more = [3, 9, 4, 17, 5], [8, 11, 6]
    ours, theirs = twin.start(prompt), reference.start(prompt)
    np.testing.assert_allclose(ours.next_logprobs(), theirs.next_logprobs(), atol=TOLERANCE)
    np.testing.assert_allclose(ours.extend(more), theirs.extend(more), atol=TOLERANCE)
    ours.rollback(2), theirs.rollback(2)
    np.testing.assert_allclose(ours.extend([12]), theirs.extend([12]), atol=TOLERANCE)
    np.testing.assert_allclose(twin.next_logprobs([prompt, prompt[:2]]), reference.next_logprobs([prompt, prompt[:2]]),
                               atol=TOLERANCE)


def test_mixed_quantisation_is_refused(pair):
    fused, _ = pair
    twin = int8_twin(fused)
    twin.module.lm_head = fused.module.lm_head          # a float head on int8 blocks: not one scheme
    assert "neither all plain float" in unsupported_reason(twin.module)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 300), hidden=st.integers(1, 2048), magnitude=st.floats(1e-3, 1e3),
       eps=st.sampled_from([1e-5, 1e-6]), seed=st.integers(0, 2**31))
def test_rms_norm_is_transformers_llama_rms_norm_bitwise(rows, hidden, magnitude, eps, seed):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, rows, hidden, generator=generator) * magnitude
    norm = LlamaRMSNorm(hidden, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=generator))
        assert torch.equal(rms_norm(x, norm.weight, eps), norm(x))
        row = int(torch.randint(0, rows, (1,), generator=generator))       # and each row as it is alone
        assert torch.equal(rms_norm(x[:, row:row + 1], norm.weight, eps), norm(x)[:, row:row + 1])
