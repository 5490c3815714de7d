"""Admission of a batch of prompts is all or nothing: a batch that can never fit the engine's bound gets a 400
naming the limit, a batch refused with 429 runs none of its prompts, and a batch admitted holds its room
until each of its prompts is answered.
"""
from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from speculum.models import MarkovModel  # noqa: E402
from speculum.serving import Engine, EngineBusy, GenerationRequest, create_app  # noqa: E402

from support.serving import EOS, NAME, decode, encode, make_target  # noqa: E402


class Held(MarkovModel):
    """A chain whose first prompt prefill waits for ``gate``, holding the engine's worker."""

    gate: threading.Event
    reached: threading.Event

    def start(self, *args, **kwargs):
        self.reached.set()
        self.gate.wait(10)
        return super().start(*args, **kwargs)


def held_target() -> Held:
    base = make_target()
    target = Held(base.transition_logprobs, base.initial_logprobs, eos_token_id=EOS)
    target.gate, target.reached = threading.Event(), threading.Event()
    return target


def wait_until(condition, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("echo", [False, True])
def test_a_batch_larger_than_the_bound_is_a_400_naming_it_and_runs_nothing(echo):
    engine = Engine(make_target(), decode=decode, max_batch=1, max_waiting=1)
    app = create_app(engine, NAME, encode_text=encode)
    with TestClient(app) as client:
        reply = client.post("/v1/completions", json={"prompt": ["ab", "bc", "cd"], "max_tokens": 2,
                                                     "echo": echo, "temperature": 0})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "prompt" and "--max-batch" in error["message"] and "2" in error["message"]
        assert engine.metrics.requests_finished == 0 and engine.admitted == 0
        assert engine.metrics.requests_rejected == 0           # a 400, not a 429
        fits = client.post("/v1/completions", json={"prompt": ["ab", "bc"], "max_tokens": 2, "echo": echo})
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 2


@pytest.mark.parametrize("echo", [False, True])
def test_a_batch_refused_with_429_runs_none_of_its_prompts(echo):
    target = held_target()
    engine = Engine(target, decode=decode, max_batch=1, max_waiting=1)
    app = create_app(engine, NAME, encode_text=encode)
    with TestClient(app) as client:
        blocker = engine.submit(GenerationRequest(encode("ab"), max_tokens=2, temperature=0.0))
        assert target.reached.wait(10)                         # one of the two places taken
        reply = client.post("/v1/completions", json={"prompt": ["ab", "bc"], "max_tokens": 2, "echo": echo})
        assert reply.status_code == 429 and reply.headers.get("retry-after") == "1"
        target.gate.set()
        assert [d.finish_reason for d in blocker][-1] in ("stop", "length")
        time.sleep(0.2)                                        # a prompt admitted would have run by now
        wait_until(lambda: engine.admitted == 0)
        assert engine.metrics.requests_finished == 1 and engine.metrics.prompts_scored == 0


def test_a_reservation_holds_each_place_until_its_request_and_its_jobs_are_done():
    engine = Engine(make_target(), decode=decode, max_batch=2, max_waiting=1, background=False)
    first, second = engine.reserve(2)
    assert engine.admitted == 2
    with pytest.raises(EngineBusy):
        engine.reserve(2)
    job = engine.submit(GenerationRequest(encode("ab"), max_tokens=2, temperature=0.0), reservation=first)
    assert engine.admitted == 2                                # its place was reserved, not taken again
    first.release()                                            # the request is done, its job still held
    assert engine.admitted == 2
    worker = threading.Thread(target=engine.run)
    worker.start()
    try:
        assert [d.finish_reason for d in job][-1] in ("stop", "length")
        wait_until(lambda: engine.admitted == 1)               # the job ended: the other place stays held
        second.release()
        second.release()
        assert engine.admitted == 0
    finally:
        engine.close()
        worker.join(10)
