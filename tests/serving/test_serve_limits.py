"""The server's limits: one request never stalls the others, and the engine holds its bound.

Invariants: a body over the limit gets 413 before it is read; a prompt text too long for the context window
is refused without being tokenized; tokenizing never blocks ``/health``; the engine never holds more than
``max_batch + max_waiting`` requests (429 with ``Retry-After`` beyond); a non-streamed request whose client
disconnects is cancelled; stop strings are capped; an empty prompt is a 400; every 4xx has OpenAI's error
shape with a field name or null as ``param``; SIGTERM ends every open stream with an error event and
``[DONE]`` within the grace period and the process ends as stopped by the signal.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from speculum.models import MarkovModel  # noqa: E402
from speculum.serving import Engine, EngineBusy, GenerationRequest, create_app  # noqa: E402
from speculum.serving.schema import ServerLimits, default_body_limit  # noqa: E402

from support.serving import (NAME, Server, decode, encode, free_port, make_target,  # noqa: E402
                        wait_until_healthy)


def endless_target() -> MarkovModel:
    target = make_target(eos=None)
    target.max_context = None
    return target


def slow_decode(ids) -> str:
    time.sleep(0.002)
    return decode(ids)


# ------------------------------------------------------------------------------------------- body and prompt
def test_a_body_over_the_limit_gets_413_before_it_is_read():
    engine = Engine(make_target(), decode=decode)
    app = create_app(engine, NAME, encode_text=encode, limits=ServerLimits(max_body_bytes=2048))
    with TestClient(app) as client:
        big = json.dumps({"prompt": "a" * 5000}).encode()
        reply = client.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
        assert reply.status_code == 413
        assert reply.json()["error"]["code"] == "request_too_large" and "2,048" in reply.json()["error"]["message"]

        def chunks():          # no Content-Length: refused once the bytes read pass the limit
            for _ in range(10):
                yield b" " * 1000
        reply = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert reply.status_code == 413
        ok = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200


def test_a_prompt_too_long_for_the_context_is_refused_without_tokenizing():
    calls = []

    def counting_encode(text):
        calls.append(len(text))
        return encode(text)

    engine = Engine(make_target(), decode=decode)
    app = create_app(engine, NAME, encode_text=counting_encode, encode_chat=lambda m: encode("ab"),
                     limits=default_body_limit(max_context=64, longest_token_bytes=1))
    with TestClient(app) as client:
        reply = client.post("/v1/completions", json={"prompt": "a" * 200})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 200}]})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
        assert calls == []
        assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1}).status_code == 200


def test_tokenizing_a_prompt_never_blocks_health():
    started = threading.Event()

    def slow_encode(text):
        started.set()
        time.sleep(1.5)                 # a tokenizer at work on a long prompt, holding the GIL or not
        return encode(text)

    engine = Engine(make_target(), decode=decode)
    running = Server(engine, app=create_app(engine, NAME, encode_text=slow_encode))
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{running.url}/v1/completions", timeout=20,
                                  json={"prompt": "ab", "max_tokens": 2, "temperature": 0})
            assert started.wait(10)
            began = time.monotonic()
            assert httpx.get(f"{running.url}/health", timeout=10).status_code == 200
            assert time.monotonic() - began < 0.75
            assert pending.result().status_code == 200
    finally:
        running.stop()


@pytest.mark.parametrize("prompt", ["", []])
def test_an_empty_prompt_is_a_400_even_for_a_model_with_a_bos(prompt):
    target = make_target()
    target.bos_token_id = 0
    engine = Engine(target, decode=decode)
    with TestClient(create_app(engine, NAME, encode_text=encode)) as client:
        reply = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"


# ------------------------------------------------------------------------------------------------- the bound
def test_the_engine_never_holds_more_than_max_batch_plus_max_waiting():
    engine = Engine(make_target(), decode=decode, max_batch=3, max_waiting=2, background=False)
    accepted, refused = [], 0
    for _ in range(12):                 # a burst before the worker fills a single batch slot
        try:
            accepted.append(engine.submit(GenerationRequest(encode("ab"), max_tokens=3, temperature=0.0)))
        except EngineBusy:
            refused += 1
    assert (len(accepted), refused) == (5, 7) and engine.admitted == 5
    assert engine.metrics.requests_rejected == 7
    worker = threading.Thread(target=engine.run)
    worker.start()
    try:
        for job in accepted:
            assert [d.finish_reason for d in job][-1] in ("stop", "length")
        assert engine.admitted == 0                 # ended jobs free their places
        assert engine.submit(GenerationRequest(encode("ab"), max_tokens=1, temperature=0.0)) is not None
    finally:
        engine.close()
        worker.join(10)


def test_a_burst_over_http_gets_429_with_retry_after_and_every_answer_is_its_own():
    engine = Engine(make_target(), decode=slow_decode, max_batch=2, max_waiting=2)
    running = Server(engine)
    prompts = ["ab", "bca", "dd", "fea", "ce", "ga"] * 5

    def ask(prompt):
        return prompt, httpx.post(f"{running.url}/v1/completions", timeout=30,
                                  json={"prompt": prompt, "max_tokens": 12, "temperature": 0})

    try:
        with ThreadPoolExecutor(30) as pool:
            replies = list(pool.map(ask, prompts))
    finally:
        running.stop()
    refused = [r for _, r in replies if r.status_code == 429]
    answered = [(p, r) for p, r in replies if r.status_code == 200]
    assert refused and answered and len(refused) + len(answered) == len(prompts)
    assert all(r.headers.get("retry-after") == "1" and r.json()["error"]["type"] == "rate_limit_error"
               for r in refused)
    import speculum
    for prompt, reply in answered:
        solo = decode(speculum.generate(make_target(), encode(prompt), max_new_tokens=12, temperature=0.0).tokens)
        assert reply.json()["choices"][0]["text"] == solo


# -------------------------------------------------------------------------------------------- disconnects
def test_a_non_streamed_request_whose_client_disconnects_is_cancelled():
    import logging

    errors: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            errors.append(record.getMessage())

    collect = Collect(logging.ERROR)
    engine = Engine(endless_target(), decode=slow_decode)
    running = Server(engine)
    logging.getLogger("uvicorn.error").addHandler(collect)      # after uvicorn configured its logging
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{running.url}/v1/completions", timeout=0.5,
                       json={"prompt": "ab", "max_tokens": 100_000, "temperature": 0})
        deadline = time.monotonic() + 20
        while engine.metrics.requests_disconnected != 1 or engine.metrics.requests_running:
            assert time.monotonic() < deadline, "the abandoned job still runs"
            time.sleep(0.05)
        assert engine.metrics.completion_tokens < 100_000
        metrics = httpx.get(f"{running.url}/metrics").text
        assert "speculum_requests_disconnected_total 1" in metrics
        assert errors == []                     # the abandoned handler ends quietly
    finally:
        running.stop()
        logging.getLogger("uvicorn.error").removeHandler(collect)


# ------------------------------------------------------------------------------------------------ stop strings
def test_stop_strings_are_capped_in_number_and_length():
    engine = Engine(make_target(), decode=decode)
    with TestClient(create_app(engine, NAME, encode_text=encode,
                               limits=ServerLimits(max_stop=4, max_stop_chars=8))) as client:
        many = client.post("/v1/completions", json={"prompt": "ab", "stop": ["a", "b", "c", "d", "e"]})
        long = client.post("/v1/completions", json={"prompt": "ab", "stop": "x" * 9})
        fine = client.post("/v1/completions", json={"prompt": "ab", "stop": ["a", "b", "c", "x" * 8],
                                                      "max_tokens": 3})
    assert many.status_code == 400 and many.json()["error"]["param"] == "stop" and "5" in many.json()["error"]["message"]
    assert long.status_code == 400 and long.json()["error"]["param"] == "stop"
    assert fine.status_code == 200


# ---------------------------------------------------------------------------------------------- error shapes
def test_every_error_has_openais_shape_and_a_field_or_null_as_param():
    engine = Engine(make_target(), decode=decode)
    with TestClient(create_app(engine, NAME, encode_text=encode)) as client:
        cases = {
            "not utf-8": (client.post("/v1/completions", content=b'{"prompt": "\xff\xfe"}',
                                      headers={"Content-Type": "application/json"}), 400, None),
            "bad json": (client.post("/v1/completions", content=b'{"prompt": "ab",, }',
                                     headers={"Content-Type": "application/json"}), 400, None),
            "wrong type": (client.post("/v1/completions", json={"prompt": "ab", "max_tokens": "3"}), 400,
                           "max_tokens"),
            "no route": (client.post("/v1/nothing", json={}), 404, None),
            "wrong method": (client.get("/v1/completions"), 405, None),
        }
        for name, (reply, status, param) in cases.items():
            assert reply.status_code == status, name
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], name
            assert error["param"] == param, (name, error)
            assert "detail" not in reply.json()


# ------------------------------------------------------------------------------------------------- shutdown
SERVER_SCRIPT = textwrap.dedent("""
    import sys, time, uvicorn
    sys.path.insert(0, {tests!r})
    from support.serving import NAME, encode, decode
    from speculum.models import MarkovModel
    from speculum.serving import Engine, create_app, serve_on_this_thread

    def slow(ids):
        time.sleep(0.003)
        return decode(ids)

    target = MarkovModel.random(8, seed=3, scale=2.0)
    engine = Engine(target, decode=slow, background=False)
    app = create_app(engine, NAME, encode_text=encode)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port={port}, log_level="info",
                                           timeout_graceful_shutdown=4))
    serve_on_this_thread(server, engine, grace=1.0)
""")


def test_sigterm_ends_open_streams_with_an_error_event_and_done_then_exits_as_terminated():
    port = free_port()
    script = SERVER_SCRIPT.format(tests=os.path.dirname(os.path.dirname(__file__)), port=port)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url, 60)
        lines: dict[int, list[str]] = {0: [], 1: []}
        opened = threading.Barrier(3)

        def read(i: int) -> None:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                              json={"prompt": "ab", "max_tokens": 100_000, "stream": True}) as reply:
                stream = reply.iter_lines()
                lines[i].append(next(stream))
                opened.wait(10)
                lines[i].extend(line for line in stream if line)

        readers = [threading.Thread(target=read, args=(i,)) for i in (0, 1)]
        for reader in readers:
            reader.start()
        opened.wait(10)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # Arriving while the open streams drain: the documented 503, not a refused connection.
        late = httpx.post(f"{url}/v1/completions", timeout=10, json={"prompt": "ab", "max_tokens": 2})
        for reader in readers:
            reader.join(30)
        code = process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
    stderr = process.stderr.read().decode()
    assert code == -signal.SIGTERM, stderr
    assert "Event loop is closed" not in stderr and "Traceback" not in stderr, stderr
    assert late.status_code == 503 and late.json()["error"]["message"] == "the server is shutting down"
    for i in (0, 1):
        assert lines[i][-1] == "data: [DONE]", lines[i][-3:]
        last = json.loads(lines[i][-2][len("data: "):])
        assert last["error"]["message"] == "the server is shutting down"
