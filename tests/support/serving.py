"""The serving tests' shared fixtures: a Markov target over eight letters, its codec, and a server on a
free localhost port (uvicorn in a thread, an OpenAI client on it)."""
from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import openai
import uvicorn

from speculum.models import MarkovModel
from speculum.serving import Engine, create_app

ALPHABET = "abcdefgh"
EOS = 7                      # "h" ends a generation
NAME = "markov-test"
PROMPTS = ["ab", "bca", "dd", "fea"]


def encode(text: str) -> list[int]:
    return [ALPHABET.index(c) for c in text]


def decode(ids) -> str:
    return "".join(ALPHABET[i] for i in ids if i != EOS)


def encode_chat(messages: list[dict]) -> list[int]:
    return encode("".join(m["content"] for m in messages) + "g")


def make_target(eos: int | None = EOS) -> MarkovModel:
    target = MarkovModel.random(len(ALPHABET), seed=3, scale=2.0, eos_token_id=eos)
    target.max_context = 64
    target.accepts_empty_prompt = False      # as a language model without a BOS token: a prompt is needed
    return target


class Server:
    """uvicorn on a free localhost port, in a thread."""

    def __init__(self, engine: Engine, app=None, **app_args) -> None:
        if app is None:
            app = create_app(engine, NAME, encode_text=encode, encode_chat=encode_chat, **app_args)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


def free_port() -> int:
    """A port nothing listens on (bound once, then released)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_healthy(process, url: str, seconds: float = 120) -> None:
    """Wait for a server subprocess to answer ``/health``; fail with its stderr if it exits first."""
    deadline = time.monotonic() + seconds
    while True:
        assert process.poll() is None, process.stderr.read().decode()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


def same(first, second) -> bool:
    """Two prompt scores bitwise equal: tokens, log-probs, alternatives and the next token's row."""
    return (first.tokens == second.tokens and first.logprobs == second.logprobs and first.top == second.top
            and np.array_equal(first.next_logprobs, second.next_logprobs))
