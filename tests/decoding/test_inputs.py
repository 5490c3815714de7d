"""Strict inputs of the decoding API: integer token ids only, every positive temperature, the model's eos
by default, and a draft whose context window is too short for the context."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import speculum
from speculum import SpeculativeDecoder
from speculum.decoding import generate, stream
from speculum.decoding.warp import sample_from_logprobs, warp_logprobs
from speculum.enumeration import AutoregressiveEnumerable
from speculum.models import MarkovModel, TinyTransformer
from speculum.models.base import check_prompt, check_token_id, check_token_ids

from support.greedy import plain_greedy

V = 8
TARGET = MarkovModel.random(V, seed=0, order=2)
DRAFT = MarkovModel.random(V, seed=1, order=2)


# ------------------------------------------------------------------------------------------ token ids
@pytest.mark.parametrize("call", [
    lambda prompt: generate(TARGET, prompt, max_new_tokens=3, temperature=0),
    lambda prompt: next(stream(TARGET, prompt, max_new_tokens=3, temperature=0)),
    lambda prompt: SpeculativeDecoder(gamma=2, temperature=0).generate(DRAFT, TARGET, prompt, 3),
], ids=["generate", "stream", "compat"])
def test_a_text_prompt_is_refused_with_a_pointer_to_encode(call):
    with pytest.raises(ValueError, match=r"prompt_ids is text .*model\.encode"):
        call("2024")


BAD_IDS = [[1.7, 2.2], [2.0], [True, False], [np.float64(3.0)], [np.bool_(True)], ["1"], [[1, 2]], [None],
           np.array([1.0, 2.0]), np.array([True]), np.array([[1, 2]])]


@pytest.mark.parametrize("prompt", BAD_IDS, ids=[repr(p) for p in BAD_IDS])
def test_non_integer_prompts_are_refused_everywhere_ids_enter(prompt):
    with pytest.raises(ValueError, match="prompt_ids"):
        generate(TARGET, prompt, max_new_tokens=3, temperature=0)
    with pytest.raises(ValueError, match="prompt_ids"):
        SpeculativeDecoder(gamma=2, temperature=0).generate(DRAFT, TARGET, prompt, 3)
    with pytest.raises(ValueError, match="prompt"):
        AutoregressiveEnumerable(TARGET, max_len=2, prompt=prompt)


@pytest.mark.parametrize("eos", [2.5, 2.0, True, np.float32(1.0), "2", [2]])
def test_non_integer_eos_is_refused_in_both_apis(eos):
    with pytest.raises(ValueError, match="eos_token_id must be an integer"):
        generate(TARGET, [1], max_new_tokens=3, eos_token_id=eos)
    with pytest.raises(ValueError, match="eos_token_id must be an integer"):
        SpeculativeDecoder(gamma=2).generate(DRAFT, TARGET, [1], 3, eos_token_id=eos)


def test_numpy_integers_are_token_ids():
    expected = generate(TARGET, [3, 2, 5], max_new_tokens=6, temperature=0, eos_token_id=4).tokens
    for prompt in (np.array([3, 2, 5]), np.array([3, 2, 5], dtype=np.uint8), [np.int32(3), np.int64(2), 5]):
        got = generate(TARGET, prompt, max_new_tokens=6, temperature=0, eos_token_id=np.int16(4))
        assert got.tokens == expected
    ids, _ = SpeculativeDecoder(gamma=2, temperature=0).generate(DRAFT, TARGET, np.array([3, 2, 5]), 6,
                                                                 eos_token_id=np.int64(4))
    assert ids == [3, 2, 5] + expected


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=6))
def test_any_float_list_is_refused(values):
    # Integral floats too: 2.0 is not a token id any more than 2.5 is.
    with pytest.raises(ValueError, match="prompt_ids must contain integer token ids"):
        check_token_ids(values, V, name="prompt_ids")
    with pytest.raises(ValueError, match="eos_token_id must be an integer"):
        check_token_id(values[0], V, name="eos_token_id")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, V - 1), max_size=12),
       st.sampled_from([list, tuple, np.int64, np.int32, np.uint16]))
def test_any_integer_list_within_the_vocabulary_is_accepted_unchanged(ids, kind):
    given_ids = kind(ids) if kind in (list, tuple) else np.array(ids, dtype=kind)
    out = check_token_ids(given_ids, V, name="ids")
    assert out == ids and all(type(t) is int for t in out)
    if ids:
        assert check_prompt(TARGET, given_ids) == ids
        assert check_token_id(given_ids[0], V) == ids[0]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-3 * V, 3 * V), min_size=1, max_size=8))
def test_ids_outside_the_vocabulary_are_refused(ids):
    assume(any(not 0 <= t < V for t in ids))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        check_token_ids(ids, V, name="ids")


def test_enumeration_refuses_non_integer_sequences_and_eos():
    ar = AutoregressiveEnumerable(TARGET, max_len=2, prompt=[1])
    with pytest.raises(ValueError, match="sequence"):
        ar.rank([1.0, 2.0])
    with pytest.raises(ValueError, match="eos"):
        AutoregressiveEnumerable(TARGET, eos=2.5, max_len=2, prompt=[1])


# ---------------------------------------------------------------------------------------- temperature
TEMPERATURES = st.floats(min_value=5e-324, max_value=1e300, allow_subnormal=True)


@st.composite
def logprob_rows(draw):
    """Rows of log-probs or raw logits with some -inf entries, at least one finite entry per row."""
    vocab = draw(st.integers(1, 9))
    n_rows = draw(st.integers(1, 3))
    values = st.one_of(st.floats(-1e6, 1e6), st.just(-np.inf), st.sampled_from([0.0, -1e-320, 5e-324]))
    rows = np.array(draw(st.lists(st.lists(values, min_size=vocab, max_size=vocab), min_size=n_rows,
                                  max_size=n_rows)))
    for row in rows:
        if not np.isfinite(row).any():
            row[draw(st.integers(0, vocab - 1))] = 0.0
    return rows


@settings(max_examples=300, deadline=None)
@given(logprob_rows(), TEMPERATURES, st.one_of(st.none(), st.integers(1, 10)),
       st.one_of(st.none(), st.floats(5e-324, 1.0, allow_subnormal=True)), st.floats(0.0, 1.0, exclude_max=True))
def test_warp_is_a_distribution_for_every_positive_temperature(rows, temperature, top_k, top_p, uniform):
    warped = warp_logprobs(rows, temperature=temperature, top_k=top_k, top_p=top_p)
    assert warped.shape == rows.shape and not np.isnan(warped).any()
    np.testing.assert_allclose(np.exp(warped).sum(axis=-1), 1.0, rtol=1e-9)
    for row, out in zip(rows, warped):
        if top_k == 1:
            assert np.isfinite(out).sum() == 1
        assert (out[row == -np.inf] == -np.inf).all()      # a banned token stays banned
        token = sample_from_logprobs(out, uniform)
        assert out[token] > -np.inf


def test_a_vanishing_temperature_is_the_limit_law_uniform_over_the_tied_maxima():
    # A normalised row: its maximum is below 0, so dividing the unshifted row would overflow to -inf.
    row = np.array([np.log(0.4), np.log(0.2), np.log(0.4), -np.inf])
    for temperature in (1e-320, 5e-324, 1e-310):
        np.testing.assert_array_equal(np.exp(warp_logprobs(row, temperature=temperature)), [0.5, 0, 0.5, 0])
    # Not a coarse clamp to greedy: a gap the temperature's size still matters.
    gap = np.exp(warp_logprobs(np.array([0.0, -1e-320]), temperature=1e-320))
    np.testing.assert_allclose(gap, [1 / (1 + math.exp(-1)), math.exp(-1) / (1 + math.exp(-1))], rtol=1e-2)


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-308])
@pytest.mark.parametrize("draft", [None, DRAFT], ids=["plain", "draft"])
def test_decoding_at_a_subnormal_temperature_is_greedy_for_distinct_maxima(temperature, draft):
    expected = plain_greedy(TARGET, [1, 3], 20)
    got = generate(TARGET, [1, 3], draft=draft, gamma=3, max_new_tokens=20, temperature=temperature, seed=0)
    assert got.tokens == expected


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_rows_with_nothing_to_sample_are_a_value_error_not_an_index_error():
    with pytest.raises(ValueError, match="no finite entry"):
        warp_logprobs(np.full((2, 3), -np.inf), temperature=0.5)
    with pytest.raises(ValueError, match="NaN"):
        warp_logprobs(np.array([0.0, np.nan]), temperature=2.0, top_p=0.5)
    for row in (np.full(3, -np.inf), np.array([0.0, np.nan])):
        with pytest.raises(ValueError, match="cannot sample"):
            sample_from_logprobs(row, 0.5)


# ------------------------------------------------------------------------------------------------ eos
PROMPT = [1, 3]


def _eos_case():
    """A target with an eos that plain greedy emits at position 3 (and which does not occur before)."""
    tokens = plain_greedy(TARGET, PROMPT, 30)
    position = next(i for i in range(3, 30) if tokens[i] not in tokens[:i])
    model = MarkovModel(TARGET.transition_logprobs, TARGET.initial_logprobs, order=2,
                        eos_token_id=tokens[position])
    return model, tokens, position


def test_generation_stops_at_the_models_eos_by_default():
    model, tokens, position = _eos_case()
    for draft in (None, DRAFT):
        result = generate(model, PROMPT, draft=draft, max_new_tokens=30, temperature=0)
        assert result.tokens == tokens[: position + 1] and result.stop_reason == "eos"
        chunks = list(stream(model, PROMPT, draft=draft, max_new_tokens=30, temperature=0))
        assert [t for c in chunks for t in c.tokens] == tokens[: position + 1]
        assert chunks[-1].stop_reason == "eos"


def test_eos_none_disables_stopping_and_compat_keeps_none_as_no_eos():
    model, tokens, _ = _eos_case()
    result = generate(model, PROMPT, draft=DRAFT, max_new_tokens=30, temperature=0, eos_token_id=None)
    assert result.tokens == tokens and result.stop_reason == "max_new_tokens"
    ids, _ = SpeculativeDecoder(gamma=3, temperature=0).generate(DRAFT, model, PROMPT, 30)
    assert ids == PROMPT + tokens


def test_an_explicit_eos_overrides_the_models_and_a_model_without_eos_never_stops():
    model, tokens, position = _eos_case()
    other = tokens[0] if tokens[0] != model.eos_token_id else tokens[1]
    got = generate(model, PROMPT, max_new_tokens=30, temperature=0, eos_token_id=other).tokens
    assert got == tokens[: tokens.index(other) + 1]
    assert generate(TARGET, PROMPT, max_new_tokens=30, temperature=0).tokens == tokens


def test_an_invalid_model_eos_is_named():
    model = MarkovModel(TARGET.transition_logprobs, TARGET.initial_logprobs, order=2)
    model.eos_token_id = 2.5                # set after construction, past the model's own check
    with pytest.raises(ValueError, match="target's eos_token_id"):
        generate(model, PROMPT, max_new_tokens=3)


# ------------------------------------------------------------------------------ draft context window
BIG = TinyTransformer(16, d_model=16, n_layers=1, seed=0, max_len=64)
SHORT_DRAFT = TinyTransformer(16, d_model=16, n_layers=1, seed=1, max_len=6)   # a window of 6 tokens


@pytest.mark.parametrize("gamma", [1, 3, "auto"])
@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_draft_shorter_than_the_prompt_falls_back_to_plain_decoding(gamma, temperature):
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    plain = generate(BIG, prompt, max_new_tokens=12, temperature=temperature, seed=3)
    got = generate(BIG, prompt, draft=SHORT_DRAFT, gamma=gamma, max_new_tokens=12, temperature=temperature,
                   seed=3)
    assert got.tokens == plain.tokens                      # same random streams: identical, not just same law
    assert got.stats.draft_forwards == 0 and got.stats.proposed == 0
    assert "max_context 6" in got.stats.draft_skipped


@pytest.mark.parametrize("gamma", [2, 4])
def test_a_draft_stops_when_the_context_outgrows_its_window(gamma):
    prompt = [1, 2, 3]
    plain = generate(BIG, prompt, max_new_tokens=20, temperature=0)
    got = generate(BIG, prompt, draft=SHORT_DRAFT, gamma=gamma, max_new_tokens=20, temperature=0)
    assert got.tokens == plain.tokens
    assert got.stats.draft_forwards > 0                    # it drafted while the context fitted
    assert "drafting stopped" in got.stats.draft_skipped
    # Nothing was proposed after the context passed the window: the last blocks are plain steps.
    assert got.stats.gamma_history[-1] == 0


def test_top_level_api_exposes_the_defaults():
    import inspect

    for api in (speculum.generate, speculum.stream):
        assert inspect.signature(api).parameters["eos_token_id"].default is ...
    assert inspect.signature(SpeculativeDecoder.generate).parameters["eos_token_id"].default is None
