"""Packed scoring: several prompts in one forward, each answered bitwise as if alone.

Invariants: ``extend_rows`` gives each session bitwise the rows it gets alone, whatever else is packed
(tiny Llama through the fused forward, and the real model); those rows are the model's to float32
rounding; a kernel whose rows depend on the batch is caught by the load check and the forward falls back
to one sequence at a time with the same answers; ``PromptScorer.score_many`` answers each prompt bitwise as
``score`` alone does, on packing and non-packing targets, and forwards each shared chunk once.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from support.hf_tiny import save_tiny_model  # noqa: E402
from speculum.models import TinyTransformer  # noqa: E402
from speculum.models.hf import HFModel  # noqa: E402
from speculum.models.hf.forward.packed import RowInvariantForward  # noqa: E402
from speculum.models.hf.kernels.probe import gives_rows_alone  # noqa: E402
from speculum.models.hf.kernels.products import RowProduct  # noqa: E402
from speculum.models.prompt_scores import PromptScorer  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")

tokens = st.lists(st.integers(min_value=3, max_value=22), min_size=1, max_size=14)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = HFModel.from_pretrained(save_tiny_model(tmp_path_factory.mktemp("rows") / "model", layers=2,
                                                    max_context=256))
    assert model.capabilities.invariant_extend and model.fused_forward
    return model


def same(first, second) -> bool:
    return (first.tokens == second.tokens and first.logprobs == second.logprobs and first.top == second.top
            and np.array_equal(first.next_logprobs, second.next_logprobs))


@settings(max_examples=25, deadline=None)
@given(prompts=st.lists(tokens, min_size=1, max_size=5), more=st.lists(tokens, min_size=5, max_size=5))
def test_packed_rows_are_bitwise_each_sessions_rows_alone(tiny, prompts, more):
    assert tiny.prepare_packing()
    packed = [tiny.start_deferred(p) for p in prompts]
    alone = [tiny.start_deferred(p) for p in prompts]
    for round_tokens in ([[]] * len(prompts), more[: len(prompts)]):
        together = tiny.extend_rows(packed, round_tokens)
        for session, extra, rows in zip(alone, round_tokens, together):
            assert np.array_equal(tiny.extend_rows([session], [extra])[0], rows)


def test_packed_rows_are_the_models_rows(tiny):
    reference = HFModel(tiny.module, prepack=False)
    prompt = [5, 9, 3, 12, 7, 7, 20]
    rows = tiny.extend_rows([tiny.start_deferred(prompt), tiny.start_deferred([4, 4])], [[], []])[0]
    want = np.vstack([reference.next_logprobs([prompt[: i + 1]]) for i in range(len(prompt))])
    assert rows.shape == want.shape and np.abs(rows - want).max() < 1e-4


def test_a_kernel_whose_rows_depend_on_the_batch_is_caught_and_not_packed(tiny):
    fused = tiny.fused
    head = fused.head
    def batch_dependent(rows):
        return head(rows) + rows.mean() * 1e-3

    object.__setattr__(fused, "head", RowProduct(batch_dependent,
                                                 gives_rows_alone(batch_dependent, fused.embed.shape[1])))
    try:
        forward = RowInvariantForward(fused)
        assert not fused.canonical_rows and not forward.packs
        caches = [tiny.new_cache(), tiny.new_cache()]
        together = forward([[3, 4, 5], [6, 7]], caches)
        alone = forward([[6, 7]], [tiny.new_cache()])
        assert torch.equal(together[1], alone[0])       # one forward per sequence: the rows alone
    finally:
        object.__setattr__(fused, "head", head)


@pytest.mark.parametrize("model", ["tiny-llama", "reference"])
@settings(max_examples=20, deadline=None)
@given(context=tokens, tails=st.lists(tokens, min_size=1, max_size=8), chunk=st.integers(1, 6),
       split=st.integers(1, 8))
def test_scoring_many_answers_each_prompt_as_alone(tiny, model, context, tails, chunk, split):
    """Prompts sharing a context (an evaluator's choices), scored in batches after a warm-up prompt,
    each bitwise equal to a fresh scorer's answer alone; packing shares the common chunks."""
    target = tiny if model == "tiny-llama" else TinyTransformer(23, d_model=16, n_layers=2, seed=1)
    prompts = [context + tail for tail in tails]
    scorer = PromptScorer(target, chunk=chunk)
    scorer.score(context[: len(context) // 2] or [3])
    tops = [i % 4 for i in range(len(prompts))]
    got = []
    for start in range(0, len(prompts), split):
        got += scorer.score_many(prompts[start: start + split], top=tops[start: start + split])
    for i, (prompt, scores) in enumerate(zip(prompts, got)):
        assert same(scores, PromptScorer(target, chunk=chunk).score(prompt, top=i % 4))
    if model == "tiny-llama":       # every chunk once: no more than the prompts' distinct chunk prefixes
        fresh = PromptScorer(target, chunk=chunk)
        fresh.score_many(prompts)
        distinct = {tuple(p[:min(len(p), end)]) for p in prompts for end in range(chunk, len(p) + chunk, chunk)}
        assert fresh.forwarded_tokens <= sum(len(key) - (len(key) - 1) // chunk * chunk for key in distinct)


def test_the_real_model_scores_a_batch_as_each_prompt_alone():
    """The embedded SmolLM2 (oneDNN kernels at full size): 8 prompts sharing a context, packed, equal
    bitwise to each alone, in fewer forwards."""
    import speculum

    model = speculum.load_model()
    rng = np.random.default_rng(0)
    context = rng.integers(0, model.vocab_size, 40).tolist()
    prompts = [context + rng.integers(0, model.vocab_size, int(n)).tolist() for n in rng.integers(1, 12, 8)]
    packed = PromptScorer(model, chunk=16)
    together = packed.score_many(prompts, top=2)
    assert model.prepare_packing()
    for prompt, scores in zip(prompts, together):
        assert same(scores, PromptScorer(model, chunk=16).score(prompt, top=2))
    assert packed.forwards < 8


def test_extend_rows_checks_its_arguments_like_extend_sessions(tiny):
    from speculum.validation import InputError

    session = tiny.start_deferred([5, 6])
    with pytest.raises(InputError, match="appears twice in one extend_rows call"):
        tiny.extend_rows([session, session], [[], []])
    with pytest.raises(InputError, match="extend_rows got 1 sessions and 2 token lists"):
        tiny.extend_rows([session], [[], []])
    with pytest.raises(InputError, match="token_lists\\[0\\]"):
        tiny.extend_rows([session], [[10_000]])
