"""Greedy verification without log-prob rows (``Capabilities.greedy_tokens``).

Invariants: ``greedy_tokens`` is bitwise the argmax (lowest id on ties) of ``logprob_rows``' rows for any
logits, near-ties that float64 rounding merges included, and refuses the rows ``logprob_rows`` refuses;
``extend_greedy`` and a ``Feed.greedy`` of ``extend_sessions`` give the argmax of the rows ``extend`` gives,
and leave the session where ``extend`` leaves it (its ``next_logprobs`` bitwise the same, rolled back or
not); greedy generations that skip the rows emit the tokens of those that compute them, alone, packed by
the scheduler and behind the engine, and a request asking for log-probs still gets them.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import speculum  # noqa: E402
from support.hf_tiny import save_tiny_model  # noqa: E402
from speculum.decoding.scheduler import Scheduler  # noqa: E402
from speculum.models import PromptLookup  # noqa: E402
from speculum.models.base import Feed  # noqa: E402
from speculum.models.hf import HFModel  # noqa: E402
from speculum.models.hf.logprobs import greedy_tokens, logprob_rows  # noqa: E402
from speculum.models.reference import MarkovModel  # noqa: E402
from speculum.serving.engine import Engine, GenerationRequest  # noqa: E402
from speculum.validation import InputError  # noqa: E402

tokens = st.lists(st.integers(min_value=3, max_value=22), min_size=1, max_size=8)


@st.composite
def near_tied_logits(draw):
    """``(rows, width)`` float32 logits whose largest entries sit a few float32 steps apart, at magnitudes
    where those steps are below float64's rounding of a log-prob (and at ones where they are not)."""
    rows, width = draw(st.integers(1, 6)), draw(st.integers(2, 40))
    generator = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1e-30, 1e-12, 1e-6, 1.0, 30.0]))
    logits = (generator.standard_normal((rows, width)) * scale).astype(np.float32)
    top = logits.max(axis=1, keepdims=True)
    steps = generator.integers(0, 4, size=(rows, width))          # 0 to 3 float32 steps below the top
    near = generator.random((rows, width)) < 0.3
    close = top.repeat(width, axis=1)
    for _ in range(3):
        close = np.where(steps > 0, np.nextafter(close, np.float32(-np.inf)), close)
        steps = steps - 1
    logits = np.where(near, close, logits)
    return torch.from_numpy(logits)


@given(near_tied_logits())
@settings(max_examples=200, deadline=None)
@example(torch.tensor([[0.0, 1e-20]]))            # both log-probs round to -ln 2: the lower id wins
@example(torch.tensor([[1e-20, 0.0, 1e-20]]))
def test_greedy_tokens_are_the_argmax_of_the_log_prob_rows(logits):
    want = logprob_rows(logits).argmax(axis=-1)
    assert np.array_equal(greedy_tokens(logits), want)
    assert np.array_equal(greedy_tokens(logits.double()), want)         # float64 logits float32 holds
    assert np.array_equal(greedy_tokens(logits.to(torch.bfloat16)), logprob_rows(logits.to(torch.bfloat16)).argmax(-1))


def test_a_near_tie_that_rounding_merges_goes_to_the_lower_id():
    """The float32 logits' argmax is id 1; their float64 log-probs are equal, so plain greedy takes id 0."""
    logits = torch.tensor([[0.0, 1e-20, -5.0]])
    assert logits.numpy().argmax() == 1
    assert logprob_rows(logits)[0, 0] == logprob_rows(logits)[0, 1]
    assert greedy_tokens(logits).tolist() == [0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_greedy_tokens_refuse_what_the_rows_refuse(bad):
    logits = torch.zeros(3, 8)
    logits[1, 5] = bad
    with pytest.raises(InputError, match="NaN or infinite"):
        logprob_rows(logits)
    with pytest.raises(InputError, match="NaN or infinite"):
        greedy_tokens(logits)
    with pytest.raises(InputError, match="NaN or infinite"):
        greedy_tokens(torch.full((1, 4), float("-inf")))


# ------------------------------------------------------------------------------------- sessions and feeds
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = HFModel.from_pretrained(save_tiny_model(tmp_path_factory.mktemp("greedy") / "model", max_context=256))
    assert model.capabilities.greedy_tokens
    return model


@settings(max_examples=25, deadline=None)
@given(prompt=tokens, block=tokens, back=st.integers(0, 8))
def test_extend_greedy_is_the_argmax_of_extend_and_leaves_the_session_as_extend_does(tiny, prompt, block, back):
    rows_session, greedy_session = tiny.start(prompt), tiny.start(prompt)
    rows = rows_session.extend(block)
    chosen = greedy_session.extend_greedy(block)
    assert chosen.dtype == np.int64 and np.array_equal(chosen, rows.argmax(axis=-1))
    back = min(back, len(block))
    for session in (rows_session, greedy_session):
        session.rollback(back)
    assert np.array_equal(greedy_session.next_logprobs(), rows_session.next_logprobs())
    assert np.array_equal(greedy_session.extend([4, 5]), rows_session.extend([4, 5]))


@settings(max_examples=15, deadline=None)
@given(prompts=st.lists(tokens, min_size=2, max_size=3), blocks=st.lists(tokens, min_size=3, max_size=3),
       greedy=st.lists(st.booleans(), min_size=3, max_size=3))
def test_greedy_feeds_of_a_packed_forward_get_the_argmax_of_their_rows(tiny, prompts, blocks, greedy):
    blocks, greedy = blocks[:len(prompts)], greedy[:len(prompts)]
    want = tiny.extend_sessions([Feed(tiny.start(p), b) for p, b in zip(prompts, blocks)])
    sessions = [tiny.start(p) for p in prompts]
    got = tiny.extend_sessions([Feed(s, b, greedy=g) for s, b, g in zip(sessions, blocks, greedy)])
    for result, rows, g in zip(got, want, greedy):
        assert np.array_equal(result, rows.argmax(axis=-1) if g else rows)
    for session, rows in zip(sessions, want):
        assert np.array_equal(session.next_logprobs(), rows[-1])


def test_a_greedy_feed_needs_a_model_that_offers_greedy_tokens():
    model = MarkovModel.random(5, seed=0)
    assert not model.capabilities.greedy_tokens
    with pytest.raises(InputError, match="greedy_tokens"):
        model.extend_sessions([Feed(model.start([1]), [2], greedy=True), Feed(model.start([2]), [3])])


# --------------------------------------------------------------------------------------- greedy decoding
def test_a_greedy_generation_without_rows_emits_the_tokens_of_one_with_rows(tiny):
    prompt = [4, 9, 5, 9, 4, 9]
    for draft in (None, PromptLookup(), speculum.models.MarkovModel.random(tiny.vocab_size, seed=3)):
        chunks = {rows: list(speculum.stream(tiny, prompt, draft=draft, max_new_tokens=24, gamma=3,
                                             temperature=0, eos_token_id=None, target_logprobs=rows))
                  for rows in (True, False)}
        assert [c.tokens for c in chunks[False]] == [c.tokens for c in chunks[True]]
        assert all(c.target_logprobs is None for c in chunks[False])
        assert all(c.target_logprobs is not None for c in chunks[True])
        assert speculum.generate(tiny, prompt, draft=draft, max_new_tokens=24, temperature=0,
                                 eos_token_id=None).tokens == sum((c.tokens for c in chunks[True]), [])


def test_packed_greedy_generations_without_rows_emit_the_tokens_of_those_with_rows(tiny):
    prompts = [[4, 5, 6, 4, 5], [9, 8, 9, 8], [7], [3, 3, 3, 3, 3, 3]]
    outputs = {}
    for rows in (True, False):
        scheduler = Scheduler(tiny)
        ids = [scheduler.add(p, draft=PromptLookup(), max_new_tokens=20, gamma="auto", temperature=0,
                             eos_token_id=None, target_logprobs=rows) for p in prompts]
        out = {i: [] for i in ids}
        while scheduler.active:
            for request, chunk in scheduler.step():
                out[request].extend(chunk.tokens)
                assert (chunk.target_logprobs is None) == (not rows) or not chunk.tokens
        outputs[rows] = [out[i] for i in ids]
    assert outputs[False] == outputs[True]
    assert outputs[True][0] == speculum.generate(tiny, prompts[0], max_new_tokens=20, temperature=0,
                                                 eos_token_id=None).tokens


def test_the_engine_gives_log_probs_to_a_greedy_request_that_asks_and_the_same_tokens_to_one_that_does_not(tiny):
    engine = Engine(tiny, draft=PromptLookup(), decode=lambda ids: "".join(f"<{i}>" for i in ids), eos_token_id=None)
    try:
        replies = {logprobs: list(engine.submit(GenerationRequest(prompt_ids=[4, 5, 6, 4, 5], max_tokens=12,
                                                                  temperature=0, logprobs=logprobs)))
                   for logprobs in (None, 2)}
    finally:
        engine.close()
    text = "".join(d.text for d in replies[None])
    assert text == "".join(d.text for d in replies[2]) and text.count("<") == 12
    assert sum(len(d.logprobs) for d in replies[2]) == 12
    assert all(not d.logprobs for d in replies[None])
