"""Prompt log-probs for evaluators: ``echo`` on ``/v1/completions``, the prefix-sharing scorer under it, and
the tokenizer routes.

Invariants: every echoed log-prob is the target's teacher-forced one (against ``score_sequences``); a
prompt's scores are bitwise the same whether scored alone or after any other prompts sharing prefixes with
it, and whatever the concurrency or the batch it came in; sharing forwards fewer tokens; the likeliest
alternative of a greedy token holds bitwise its own log-prob; bad input gets an OpenAI-shaped 400 naming
the field.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from speculum.models import MarkovModel, TinyTransformer  # noqa: E402
from speculum.serving import Engine, create_app  # noqa: E402
from speculum.models.prompt_scores import PromptScorer  # noqa: E402

from support.serving import NAME, Server, decode, encode, make_target, same  # noqa: E402

VOCAB = 9


def tiny() -> TinyTransformer:
    return TinyTransformer(VOCAB, d_model=16, n_layers=2, seed=4)


def solo(model, tokens, chunk, top=3):
    return PromptScorer(model, chunk=chunk).score(tokens, top=top)


# ---------------------------------------------------------------------------------------------- the scorer
@pytest.mark.parametrize("model", [make_target(), tiny()], ids=["markov", "transformer"])
@pytest.mark.parametrize("chunk", [1, 3, 32])
def test_scores_are_the_targets_teacher_forced_log_probs(model, chunk):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, min(model.vocab_size, 7), 11).tolist()
    scores = solo(model, tokens, chunk)
    assert scores.logprobs[0] is None and len(scores.logprobs) == len(tokens)
    total = model.score_sequences([tokens[1:]], prompt=tokens[:1])[0]
    assert np.isclose(sum(scores.logprobs[1:]), total, atol=1e-9)
    np.testing.assert_allclose(scores.next_logprobs, model.next_logprobs([tokens])[0], atol=1e-9)
    for i in range(1, len(tokens)):
        row = model.next_logprobs([tokens[:i]])[0]
        assert [t for t, _ in scores.top[i]] == list(np.argsort(-row, kind="stable")[:3])
        if scores.top[i][0][0] == tokens[i]:                 # the greedy token: its own log-prob, bitwise
            assert scores.top[i][0][1] == scores.logprobs[i]


@given(st.lists(st.tuples(st.integers(0, 4), st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=9)),
                min_size=2, max_size=7),
       st.integers(1, 5), st.integers(1, 4))
@settings(max_examples=40, deadline=None)
def test_scores_are_bitwise_those_of_the_prompt_alone_whatever_came_before(steps, chunk, slots):
    """Prompts built from earlier ones' prefixes (shared contexts, as an evaluator's choices), scored in
    sequence through one scorer, each equal bit for bit to a fresh scorer's answer."""
    model = tiny()
    scorer = PromptScorer(model, chunk=chunk, slots=slots, max_tokens=40)
    prompts: list[list[int]] = []
    for keep, tail in steps:
        base = prompts[keep % len(prompts)] if prompts else []
        prompt = (base[: len(base) * 2 // 3] + tail) or [1]
        prompts.append(prompt)
        assert same(scorer.score(prompt, top=3), solo(model, prompt, chunk))


def test_sharing_a_context_forwards_only_what_differs():
    model = tiny()
    scorer = PromptScorer(model, chunk=4)
    context = np.random.default_rng(1).integers(0, VOCAB, 40).tolist()
    first = scorer.score(context + [1, 2], top=1)
    second = scorer.score(context + [3, 4, 5], top=1)
    assert first.forwarded == 42 and second.forwarded <= 3 + 4     # at most a chunk of the context again
    assert scorer.forwarded_tokens == first.forwarded + second.forwarded
    assert scorer.reused_tokens == 43 - second.forwarded


def test_the_cache_holds_its_bound_and_evicts_the_least_recently_used():
    model = tiny()
    scorer = PromptScorer(model, chunk=2, max_tokens=20, slots=8)
    for start in range(6):
        scorer.score([start % VOCAB] + [1] * 7, top=0)
        assert scorer.resident_tokens <= 20
    assert scorer.score([5] + [1] * 7).forwarded < 8            # the most recent stays
    assert scorer.score([0] + [1] * 7).forwarded == 8           # the oldest went
    assert PromptScorer(model, max_tokens=0).score([1, 2]).forwarded == 2


# ---------------------------------------------------------------------------------------------- the server
@pytest.fixture
def client():
    engine = Engine(make_target(), decode=decode)
    info = {"eos_token": "h", "bos_token": None, "pad_token": None, "chat_template": None,
            "model_max_length": 64}
    app = create_app(engine, NAME, encode_text=encode, tokenizer_info=info,
                     tokenize=lambda text, special: encode(text))
    with TestClient(app) as test_client:
        yield test_client


def post(client, **body):
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.parametrize("max_tokens", [0, 1, 4])
def test_echo_returns_the_prompts_exact_log_probs_then_the_generation(client, max_tokens):
    target = make_target()
    reply = post(client, prompt="abcad", echo=True, max_tokens=max_tokens, logprobs=2, temperature=0)
    choice = reply["choices"][0]
    logprobs = choice["logprobs"]
    ids = encode("abcad")
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["tokens"][:5] == list("abcad")
    assert np.isclose(sum(logprobs["token_logprobs"][1:5]), target.score_sequences([ids[1:]], prompt=ids[:1])[0])
    assert choice["text"].startswith("abcad")
    greedy = decode(__import__("speculum").generate(target, ids, max_new_tokens=max_tokens, temperature=0).tokens)
    assert choice["text"] == "abcad" + greedy
    assert reply["usage"]["prompt_tokens"] == 5
    assert len(logprobs["tokens"]) == 5 + reply["usage"]["completion_tokens"]
    for value, top in zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]):
        if value == max(top.values()):
            assert value in top.values()
    if max_tokens == 1:                    # the generated token is greedy: its own log-prob is the top one
        assert logprobs["token_logprobs"][-1] == max(logprobs["top_logprobs"][-1].values())


def test_prompts_as_batches_of_texts_or_ids_answer_as_each_alone(client):
    alone = [post(client, prompt=p, echo=True, max_tokens=1, logprobs=1, temperature=0)["choices"][0]
             for p in ("ab", "bca", "dd")]
    for prompt in (["ab", "bca", "dd"], [encode("ab"), encode("bca"), encode("dd")]):
        batch = post(client, prompt=prompt, echo=True, max_tokens=1, logprobs=1, temperature=0)["choices"]
        assert [c["index"] for c in batch] == [0, 1, 2]
        assert [c["logprobs"] for c in batch] == [c["logprobs"] for c in alone]
        assert [c["text"] for c in batch] == [c["text"] for c in alone]
    plain = post(client, prompt=["ab", "dd"], max_tokens=3, temperature=0)["choices"]
    assert [c["text"] for c in plain] == [post(client, prompt=p, max_tokens=3, temperature=0)["choices"][0]["text"]
                                           for p in ("ab", "dd")]


def test_echo_is_bitwise_the_same_at_concurrency_one_and_eight():
    engine = Engine(tiny(), decode=lambda ids: "".join(chr(97 + i) for i in ids), max_batch=4, max_waiting=64)
    server = Server(engine, app=create_app(engine, NAME, encode_text=lambda text: [ord(c) - 97 for c in text]))
    rng = np.random.default_rng(2)
    context = rng.integers(0, VOCAB, 100).tolist()
    prompts = [context + rng.integers(0, VOCAB, int(rng.integers(1, 6))).tolist() for _ in range(16)]

    def ask(prompt):
        return httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"prompt": prompt, "echo": True, "max_tokens": 1, "logprobs": 3,
                                "temperature": 0}).json()["choices"][0]["logprobs"]

    try:
        one = [ask(p) for p in prompts]
        with ThreadPoolExecutor(8) as pool:
            eight = list(pool.map(ask, prompts))
        # generations running alongside do not change the scores either
        with ThreadPoolExecutor(8) as pool:
            busy = [pool.submit(httpx.post, f"{server.url}/v1/completions", timeout=30,
                                json={"prompt": "abc", "max_tokens": 20}) for _ in range(4)]
            alongside = list(pool.map(ask, prompts))
            [b.result() for b in busy]
    finally:
        server.stop()
    assert one == eight == alongside
    assert engine.metrics.scored_tokens_reused > engine.metrics.scored_tokens_forwarded


def test_metrics_show_the_prefix_cache_and_its_cap(client):
    post(client, prompt="abcdefg" * 8 + "a", echo=True, max_tokens=0, logprobs=0)
    post(client, prompt="abcdefg" * 8 + "b", echo=True, max_tokens=0, logprobs=0)
    text = client.get("/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}
    assert values["speculum_prefix_cache_capacity_tokens"] > 0
    assert 0 < values["speculum_prefix_cache_tokens"] <= values["speculum_prefix_cache_capacity_tokens"]
    assert values["speculum_scored_tokens_reused_total"] > 0


def test_tokenizer_routes(client):
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "h"
    assert client.post("/tokenize", json={"prompt": "bad", "add_special_tokens": False}).json()["tokens"] == \
        encode("bad")
    assert client.post("/detokenize", json={"tokens": encode("bad")}).json() == {"prompt": "bad"}
    bad = client.post("/detokenize", json={"tokens": [0, 99]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_no_tokenizer_routes_without_a_tokenizer():
    engine = Engine(make_target(), decode=decode)
    with TestClient(create_app(engine, NAME, encode_text=encode)) as client:
        assert client.get("/tokenizer_info").status_code == 404
        assert client.post("/tokenize", json={"prompt": "ab"}).status_code == 404


@pytest.mark.parametrize("body, param", [
    ({"prompt": "ab", "echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt": [0, 99], "echo": True, "logprobs": 1}, None),               # outside the vocabulary
    ({"prompt": "a" * 100, "echo": True, "logprobs": 1}, None),             # longer than the context
    ({"prompt": ["ab", ""], "echo": True}, "prompt"),
])
def test_bad_echo_requests_are_openai_shaped_400s(client, body, param):
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"] and (param is None or error["param"] == param)


def test_echo_on_chat_is_a_400_naming_echo():
    engine = Engine(make_target(), decode=decode)
    app = create_app(engine, NAME, encode_text=encode, encode_chat=lambda messages: encode("ab"))
    with TestClient(app) as client:
        reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ab"}],
                                                           "echo": True})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "echo"


def test_a_markov_chain_scores_match_exactly():
    target = MarkovModel.random(5, seed=1)
    scorer = PromptScorer(target, chunk=2)
    for tokens in ([0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 1], [2]):
        scores = scorer.score(tokens, top=5)
        rows = [target.next_logprobs([tokens[:i]])[0] for i in range(1, len(tokens))]
        assert list(scores.logprobs[1:]) == [float(row[t]) for row, t in zip(rows, tokens[1:])]
