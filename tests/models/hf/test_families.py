"""The fused forward on every family it covers (Llama, Mistral, Qwen2, Qwen3, Gemma 3), on tiny random models
built from transformers configs (no downloads), with sliding windows shorter than the sequences.

Invariants, per family: the fused forward is taken and gives transformers' own log-probs to float32
rounding (sessions with rollback, batched rows, teacher forcing); rows are canonical (packed sequences equal
each alone, bitwise); greedy speculative output equals plain greedy; a draft equal to the target is always
accepted; enumeration equals brute-force sorted order; sampling draws the target's law. A family the table
does not cover, or a config it does not reproduce, keeps transformers' forward with a reason.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from support.hf_tiny import FAMILIES, save_tiny_model  # noqa: E402
from speculum.decoding.speculative import generate  # noqa: E402
from speculum.drafts.twins import truncated_draft  # noqa: E402
from speculum.enumeration.enumerable import AutoregressiveEnumerable  # noqa: E402
from speculum.models.hf import HFModel  # noqa: E402
from speculum.models.hf.forward.families import layer_windows  # noqa: E402
from speculum.models.hf.forward.fused import FusedForward, unsupported_reason  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
TOLERANCE = 1e-4   # nats: float32 rounding of the tiny models' large random logits


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(fused, reference): one tiny model of the family on the fused forward and on transformers' forward."""
    path = save_tiny_model(tmp_path_factory.mktemp(request.param) / "model", family=request.param)
    fused, reference = HFModel.from_pretrained(path), HFModel.from_pretrained(path, prepack=False)
    assert fused.fused_forward and not reference.fused_forward, unsupported_reason(fused.module)
    return fused, reference


tokens = st.lists(st.integers(min_value=3, max_value=22), min_size=1, max_size=10)


@settings(max_examples=8, deadline=None)
@given(prompt=tokens, first=tokens, second=tokens, back=st.integers(0, 10))
def test_session_rows_are_transformers_rows_past_the_window(pair, prompt, first, second, back):
    fused, reference = pair
    back = min(back, len(first))
    rows = []
    for model in pair:
        session = model.start(prompt)
        session.extend(first)
        session.rollback(back)
        rows.append(np.vstack([session.extend(second), session.advance(first)[None, :]]))
    assert np.abs(rows[0] - rows[1]).max() < TOLERANCE


def test_batched_rows_and_scores_are_transformers(pair):
    fused, reference = pair
    prefixes = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 12, 13], [5]]
    assert np.abs(fused.next_logprobs(prefixes) - reference.next_logprobs(prefixes)).max() < TOLERANCE
    got = fused.score_sequences(prefixes, prompt=[1, 14, 15])
    want = reference.score_sequences(prefixes, prompt=[1, 14, 15])
    assert np.abs(np.asarray(got) - np.asarray(want)).max() < TOLERANCE
    # Sessions hold every key (the window is a mask): the same rows as transformers' forward on its own
    # sliding-window cache, in one call.
    ids = [3, 4, 5, 6, 7, 8, 9, 12, 13, 14]
    with torch.inference_mode():
        own = torch.log_softmax(reference.module(input_ids=torch.tensor([ids])).logits[0].double(), -1).numpy()
    session = fused.start(ids[:1])
    rows = np.vstack([session.next_logprobs()[None], session.extend(ids[1:])[:-1]])
    assert np.abs(rows - own[:-1]).max() < TOLERANCE


def test_packed_sequences_equal_each_alone_bitwise(pair):
    """Guaranteed where every product keeps its rows apart (probed per machine: ``canonical_rows``)."""
    fused, _ = pair
    if not fused.capabilities.canonical_rows:
        pytest.skip("this machine's float32 products do not keep rows apart: rows are not canonical here")
    forward = fused.fused
    lists = [[3, 4, 5, 6, 7, 8], [9], [10, 11, 12]]
    alone = [forward(torch.tensor([ids]), fused.new_cache())[0] for ids in lists]
    packed = forward.forward_packed(lists, [fused.new_cache() for _ in lists])
    assert all(torch.equal(a, b) for a, b in zip(alone, packed))


def test_greedy_speculative_output_is_plain_greedy(pair):
    fused, _ = pair
    prompt = [1, 3, 4, 5]
    plain = generate(fused, prompt, max_new_tokens=14, temperature=0, eos_token_id=None)
    draft = truncated_draft(fused, 1)
    fast = generate(fused, prompt, draft=draft, max_new_tokens=14, gamma=3, temperature=0, eos_token_id=None)
    assert fast.tokens == plain.tokens
    same = generate(fused, prompt, draft=fused, max_new_tokens=14, gamma=3, temperature=0, eos_token_id=None)
    assert same.tokens == plain.tokens and same.stats.accepted == same.stats.proposed > 0


def test_enumeration_is_brute_force_sorted_order(pair):
    fused, _ = pair
    prompt = [1, 5, 6, 7]
    every = fused.vocab_size ** 2
    ranked = AutoregressiveEnumerable(fused, max_len=2, prompt=prompt).top_k(every)
    brute = list(itertools.product(range(fused.vocab_size), repeat=2))
    scores = np.asarray(fused.score_sequences([list(s) for s in brute], prompt))
    assert len(ranked) == every
    assert np.allclose(sorted(scores, reverse=True), [lp for _, lp in ranked], atol=1e-5, rtol=0)
    assert np.allclose([scores[brute.index(tuple(s))] for s, _ in ranked], [lp for _, lp in ranked],
                       atol=1e-5, rtol=0)


@pytest.mark.slow
def test_speculative_sampling_draws_the_targets_law(tmp_path):
    """Gemma 3 (the family furthest from Llama): the first two tokens of speculative sampling with a
    one-layer draft, against the exact law from the target's rows (chi-square, 3000 draws)."""
    from scipy import stats

    model = HFModel.from_pretrained(save_tiny_model(tmp_path / "gemma", family="gemma3_text"))
    draft, prompt = truncated_draft(model, 1), [1, 3, 4]
    first = model.next_logprobs([prompt])[0]
    law = {}
    for a in range(model.vocab_size):
        second = model.next_logprobs([prompt + [a]])[0]
        for b in range(model.vocab_size):
            law[a, b] = np.exp(first[a] + second[b])
    rng = np.random.default_rng(0)
    counts: dict = {}
    draws = 3000
    for _ in range(draws):
        pair_ = tuple(generate(model, prompt, draft=draft, max_new_tokens=2, gamma=2, eos_token_id=None,
                               seed=int(rng.integers(2 ** 32))).tokens)
        counts[pair_] = counts.get(pair_, 0) + 1
    likely = [k for k, p in law.items() if p * draws >= 5]
    observed = [counts.get(k, 0) for k in likely] + [draws - sum(counts.get(k, 0) for k in likely)]
    expected = [law[k] * draws for k in likely] + [draws * (1 - sum(law[k] for k in likely))]
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_configs_it_does_not_reproduce_keep_transformers_forward(pair):
    fused, _ = pair
    config = fused.module.config
    for fields, words in (({"model_type": "gpt2"}, "not one the fused forward covers"),
                          ({"final_logit_softcapping": 30.0}, "soft-capped"),
                          ({"hidden_act": "relu", "hidden_activation": "relu"}, "activation")):
        saved = {field: getattr(config, field, None) for field in fields}
        for field, value in fields.items():
            setattr(config, field, value)
        try:
            assert words in unsupported_reason(fused.module)
            assert FusedForward.build(fused.module) is None
        finally:
            for field, value in saved.items():
                setattr(config, field, value)


def test_layer_windows_read_layer_types_and_refuse_unknown_attention():
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig

    assert layer_windows(LlamaConfig(num_hidden_layers=2)) == [None, None]
    assert layer_windows(MistralConfig(num_hidden_layers=2, sliding_window=7)) == [7, 7]
    gemma = Gemma3TextConfig(num_hidden_layers=3, sliding_window=5,
                             layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert layer_windows(gemma) == [5, None, 5]
    gemma.layer_types = ["chunked_attention"] * 3
    assert "chunked_attention" in layer_windows(gemma)


@settings(max_examples=30, deadline=None)
@given(heads=st.integers(1, 8), kv_heads=st.integers(1, 4), head_dim=st.sampled_from([8, 64, 256]),
       rows=st.integers(1, 40), seed=st.integers(0, 2 ** 31))
def test_one_norm_of_every_head_then_its_weight_is_each_heads_norm_bitwise(heads, kv_heads, head_dim, rows, seed):
    """The fused forward normalises queries and keys in one call, then weights each head's row: bitwise
    what each head's own RMSNorm with its weight gives."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, rows, heads + kv_heads, head_dim, generator=generator) * 3
    query_weight, key_weight = torch.randn(2, head_dim, generator=generator)
    each = torch.cat([F.rms_norm(x[:, :, :heads], (head_dim,), query_weight, 1e-6),
                      F.rms_norm(x[:, :, heads:], (head_dim,), key_weight, 1e-6)], dim=2)
    weights = torch.cat([query_weight.expand(heads, -1), key_weight.expand(kv_heads, -1)])
    assert torch.equal(F.rms_norm(x, (head_dim,), None, 1e-6) * weights, each)


@settings(max_examples=20, deadline=None)
@given(positions=st.lists(st.integers(0, 600), min_size=1, max_size=20))
def test_rotary_rows_from_the_table_are_the_rotary_modules_rows_bitwise(pair, positions):
    """Any positions (packed sequences: runs in any order), and a run read as a view."""
    fused, _ = pair
    forward = fused.fused
    at = torch.tensor([positions])
    x = torch.zeros(1, len(positions), 32)
    run = torch.arange(len(positions))[None] + positions[0]
    for at, tabled in ((at, forward.rotary_tables(x, at)), (run, forward.rotary_tables(x, run, run=True))):
        for kind, rows in tabled.items():
            direct = forward.rotary(x, at) if kind is None else forward.rotary(x, at, kind)
            assert all(torch.equal(a, b.unsqueeze(1)) for a, b in zip(rows, direct))


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_long_sequences_on_sliding_layers_are_transformers_rows(tmp_path, family):
    """Past the first key blocks a sliding-window row reads only from its window's block on: fed whole,
    then one token at a time, and packed, the rows are transformers' own forward's."""
    model = HFModel.from_pretrained(save_tiny_model(tmp_path / family, family=family, max_context=256))
    assert model.fused_forward
    ids = [3 + (7 * i) % 20 for i in range(150)]
    with torch.inference_mode():
        logits = model.module(input_ids=torch.tensor([ids])).logits[0].double()
    own = torch.log_softmax(logits, -1).numpy()
    session = model.start(ids[:1])
    whole = np.vstack([session.next_logprobs()[None], session.extend(ids[1:140])])
    steps = np.vstack([session.advance([token])[None] for token in ids[140:149]])
    assert np.abs(whole - own[:140]).max() < TOLERANCE and np.abs(steps - own[140:149]).max() < TOLERANCE
    forward = model.fused
    packed = forward.forward_packed([ids[:100], ids[:149]], [model.new_cache(), model.new_cache()])
    alone = forward(torch.tensor([ids[:149]]), model.new_cache())[0]
    assert torch.equal(packed[1], alone) or not model.capabilities.canonical_rows
