"""An OpenAI-compatible HTTP API over an :class:`~speculum.serving.engine.Engine` (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (both with ``stream: true`` as
server-sent events, ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(Prometheus text: requests, tokens, acceptance, throughput). Errors use OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``: 400 for a malformed body, a field of the wrong type or a
bad value (a prompt longer than the context included), 404 for another model name, 429 when the queue is
full, 503 while shutting down. A streaming client that disconnects cancels its job. ``logprobs`` (and chat's
``top_logprobs``) return the target's exact log-probs of every generated token and its likeliest
alternatives, from the rows its verification computed.

Example:
    >>> from speculum.models import MarkovModel
    >>> from speculum.serving import Engine, create_app
    >>> engine = Engine(MarkovModel.random(6, seed=0), decode=lambda ids: "".join(map(str, ids)))
    >>> app = create_app(engine, "markov", encode_text=lambda text: [int(c) for c in text])
    >>> from fastapi.testclient import TestClient
    >>> with TestClient(app) as client:
    ...     reply = client.post("/v1/completions", json={"model": "markov", "prompt": "0", "max_tokens": 3,
    ...                                                  "temperature": 0}).json()
    >>> reply["usage"]["completion_tokens"]
    3
"""
# No `from __future__ import annotations`: FastAPI reads the request models of the handlers below from
# their annotations at run time, and those models are local to create_app.
import asyncio
import json
import signal
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Literal, Sequence

from ..validation import InputError
from .engine import Delta, Engine, EngineBusy, EngineClosed, GenerationRequest, TokenLogprob

__all__ = ["create_app", "serve_on_this_thread"]

DEFAULT_MAX_TOKENS = 256


class _UnknownModel(Exception):
    """The request names a model this server does not serve (HTTP 404)."""


def create_app(engine: Engine, model_name: str, *, encode_text: Callable[[str], list[int]],
               encode_chat: Callable[[list[dict]], list[int]] | None = None,
               default_max_tokens: int = DEFAULT_MAX_TOKENS, close_engine: bool = True,
               token_bytes: Sequence[bytes | None] | None = None) -> Any:
    """The FastAPI application serving ``engine`` under ``model_name``.

    ``encode_text`` turns a completion prompt into token ids; ``encode_chat`` turns chat messages
    (``[{"role", "content"}]``) into the ids of a prompt that ends where the assistant's turn begins
    (None: chat completions answer 400). ``close_engine``: close the engine when the app shuts down.
    ``token_bytes``: each token id's bytes (:func:`speculum.models.vocabulary.token_bytes`), the ``bytes`` of
    chat log-probs (without it, the UTF-8 of the token's text).
    """
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field

    class _Body(BaseModel):
        # Strict: "10" is not an integer. Unknown fields are allowed (clients send many).
        model_config = ConfigDict(extra="allow", strict=True)
        model: str | None = None
        max_tokens: int | None = Field(None, ge=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        temperature: float = Field(1.0, ge=0.0)
        top_p: float | None = Field(None, gt=0.0, le=1.0)
        seed: int | None = Field(None, ge=0)
        stop: str | list[str] | None = None
        stream: bool = False
        n: int = 1

    class CompletionBody(_Body):
        prompt: str | list[int]
        logprobs: int | None = None
        echo: bool = False

    class Message(BaseModel):
        model_config = ConfigDict(extra="allow", strict=True)
        role: Literal["system", "user", "assistant", "developer", "tool"]
        content: str

    class ChatBody(_Body):
        messages: list[Message] = Field(min_length=1)
        logprobs: bool | None = None
        top_logprobs: int | None = None

    def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
              code: str | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                            status_code=status)

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        if close_engine:
            await asyncio.to_thread(engine.close)

    app = FastAPI(title="speculum", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = exc.errors()
        first = problems[0] if problems else {}
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
                            for e in problems[:3])
        return error(400, message or "invalid request body", param=where)

    def request_from(body: _Body, prompt_ids: Sequence[int]) -> GenerationRequest:
        if body.model is not None and body.model != model_name:
            raise _UnknownModel(f"model {body.model!r} is not served here (this server serves {model_name!r})")
        if body.n != 1:
            raise InputError(f"n={body.n} is not supported: send one request per completion")
        if getattr(body, "echo", False):
            raise InputError("echo is not supported")
        if isinstance(body, ChatBody):
            if body.top_logprobs is not None and not body.logprobs:
                raise InputError("top_logprobs needs logprobs: true")
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            logprobs = body.logprobs
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
        return GenerationRequest(prompt_ids=list(prompt_ids), max_tokens=max_tokens, temperature=body.temperature,
                                 top_p=body.top_p, seed=body.seed, stop=stop, logprobs=logprobs)

    async def run(body: _Body, encode: Callable[[], list[int]], render: Callable[..., dict],
                  render_chunk: Callable[..., dict]) -> Any:
        try:
            try:
                with engine.tokenizer_lock:
                    prompt_ids = encode()
            except InputError:
                raise
            except Exception as exc:   # e.g. a chat template that refuses this order of roles
                raise InputError(f"the prompt could not be encoded: {type(exc).__name__}: {exc}") from None
            request = request_from(body, prompt_ids)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()
            job = engine.submit(request, on_event=lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        except _UnknownModel as exc:
            return error(404, str(exc), param="model", code="model_not_found")
        except InputError as exc:
            return error(400, str(exc))
        except EngineBusy as exc:
            return error(429, str(exc), kind="rate_limit_error", code="rate_limit_exceeded")
        except EngineClosed as exc:
            return error(503, str(exc), kind="server_error")
        ident, created = uuid.uuid4().hex[:24], int(time.time())

        if not body.stream:
            pieces, scored, last = [], [], Delta("")
            while (event := await events.get()) is not None:
                pieces.append(event.text)
                scored += event.logprobs
                last = event if event.finish_reason else last
            if last.finish_reason == "error":
                return error(500, last.error or "generation failed", kind="server_error")
            return render(ident, created, "".join(pieces), last, scored if request.logprobs is not None else None)

        async def sse() -> AsyncIterator[str]:
            try:
                first = True
                while (event := await events.get()) is not None:
                    if event.finish_reason == "error":
                        payload = {"error": {"message": event.error, "type": "server_error", "param": None,
                                             "code": None}}
                        yield f"data: {json.dumps(payload)}\n\n"
                        continue
                    if event.text or event.logprobs or event.finish_reason or first:
                        yield f"data: {json.dumps(render_chunk(ident, created, event, first))}\n\n"
                        first = False
                yield "data: [DONE]\n\n"
            finally:
                job.cancel()   # a no-op once finished; frees the worker when the client went away

        return StreamingResponse(sse(), media_type="text/event-stream")

    def usage(event: Delta) -> dict:
        return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
                "total_tokens": event.prompt_tokens + event.completion_tokens}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> Any:
        def encode() -> list[int]:
            return list(body.prompt) if isinstance(body.prompt, list) else encode_text(body.prompt)

        def logprobs(scored: Sequence[TokenLogprob] | None) -> dict | None:
            if scored is None or body.logprobs is None:
                return None
            return {"tokens": [t.text for t in scored], "token_logprobs": [t.logprob for t in scored],
                    "top_logprobs": [{text: lp for _, text, lp in t.top} for t in scored],
                    "text_offset": [t.offset for t in scored]}

        def render(ident: str, created: int, text: str, last: Delta, scored: list | None = None) -> dict:
            return {"id": f"cmpl-{ident}", "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": logprobs(scored),
                                 "finish_reason": last.finish_reason}],
                    "usage": usage(last)}

        def render_chunk(ident: str, created: int, event: Delta, first: bool) -> dict:
            chunk = {"id": f"cmpl-{ident}", "object": "text_completion", "created": created, "model": model_name,
                     "choices": [{"index": 0, "text": event.text, "logprobs": logprobs(event.logprobs),
                                  "finish_reason": event.finish_reason}]}
            if event.finish_reason:
                chunk["usage"] = usage(event)
            return chunk

        return await run(body, encode, render, render_chunk)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody) -> Any:
        if encode_chat is None:
            return error(400, f"{model_name} has no chat template: use /v1/completions")

        def encode() -> list[int]:
            return encode_chat([m.model_dump(include={"role", "content"}) for m in body.messages])

        def entry(token_id: int, text: str, logprob: float) -> dict:
            raw = token_bytes[token_id] if token_bytes is not None and token_id < len(token_bytes) else None
            return {"token": text, "logprob": logprob,
                    "bytes": list(raw) if raw is not None else list(text.encode("utf-8"))}

        def logprobs(scored: Sequence[TokenLogprob] | None) -> dict | None:
            if scored is None or not body.logprobs:
                return None
            return {"content": [entry(t.token_id, t.text, t.logprob)
                                | {"top_logprobs": [entry(*alternative) for alternative in t.top]} for t in scored]}

        def render(ident: str, created: int, text: str, last: Delta, scored: list | None = None) -> dict:
            return {"id": f"chatcmpl-{ident}", "object": "chat.completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": logprobs(scored), "finish_reason": last.finish_reason}],
                    "usage": usage(last)}

        def render_chunk(ident: str, created: int, event: Delta, first: bool) -> dict:
            delta: dict = {"role": "assistant", "content": event.text} if first else (
                {"content": event.text} if event.text else {})
            chunk = {"id": f"chatcmpl-{ident}", "object": "chat.completion.chunk", "created": created,
                     "model": model_name,
                     "choices": [{"index": 0, "delta": delta, "logprobs": logprobs(event.logprobs),
                                  "finish_reason": event.finish_reason}]}
            if event.finish_reason:
                chunk["usage"] = usage(event)
            return chunk

        return await run(body, encode, render, render_chunk)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "speculum"}]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(prometheus_text(engine), media_type="text/plain; version=0.0.4")

    return app


def prometheus_text(engine: Engine) -> str:
    """The engine's counters in Prometheus' text exposition format."""
    m = engine.metrics
    rows = [
        ("requests_finished_total", "counter", "requests that completed", m.requests_finished),
        ("requests_cancelled_total", "counter", "requests whose client went away", m.requests_cancelled),
        ("requests_rejected_total", "counter", "requests refused with 429 (queue full)", m.requests_rejected),
        ("requests_running", "gauge", "requests being generated", m.requests_running),
        ("requests_waiting", "gauge", "requests in the queue", m.requests_waiting),
        ("prompt_tokens_total", "counter", "prompt tokens of finished requests", m.prompt_tokens),
        ("generation_tokens_total", "counter", "tokens generated", m.completion_tokens),
        ("draft_tokens_proposed_total", "counter", "draft tokens verified by the target", m.draft_proposed),
        ("draft_tokens_accepted_total", "counter", "draft tokens the target accepted", m.draft_accepted),
        ("target_forwards_total", "counter", "target verification forwards", m.target_forwards),
        ("draft_acceptance_rate", "gauge", "accepted / proposed draft tokens", m.acceptance_rate),
        ("busy_seconds_total", "counter", "seconds the worker spent on prefills and steps", m.busy_seconds),
        ("prefill_seconds_total", "counter", "seconds spent admitting requests (prompts' own forwards)",
         m.prefill_seconds),
        ("generation_tokens_per_busy_second", "gauge", "tokens per second while generating",
         m.tokens_per_busy_second),
    ]
    out = []
    for name, kind, text, value in rows:
        out += [f"# HELP speculum_{name} {text}", f"# TYPE speculum_{name} {kind}", f"speculum_{name} {value}"]
    return "\n".join(out) + "\n"


def serve_on_this_thread(server: Any, engine: Engine) -> bool:
    """Run ``server`` (a ``uvicorn.Server`` over :func:`create_app`'s app) on a thread of its own and
    ``engine``'s jobs on the calling thread (an engine built with ``background=False``: see its docstring for
    why), until the server stops. From the main thread, SIGINT / SIGTERM stop the server as uvicorn does:
    it stops accepting, lets open responses finish (its graceful-shutdown timeout) while the engine still
    generates them, then the app's shutdown closes the engine, and the signal is raised again with its
    previous handler. Returns whether the server started (False: it could not listen; uvicorn has logged
    why).

    Example:
        >>> server = uvicorn.Server(uvicorn.Config(app, port=8000))          # doctest: +SKIP
        >>> serve_on_this_thread(server, engine)                             # doctest: +SKIP
    """

    def http() -> None:
        try:
            server.run()
        except SystemExit:               # uvicorn exits when it cannot listen, after logging why
            pass
        finally:
            engine.close(timeout=0)      # the server stopped (or never started): end engine.run()

    received: list[int] = []

    def on_signal(sig: int, frame: Any) -> None:
        received.append(sig)
        server.handle_exit(sig, frame)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="speculum-http", daemon=True)
    thread.start()
    try:
        engine.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.should_exit = True
        thread.join()
    # As uvicorn does: once shut down, the signal takes its usual course (exit status 130 / 143 in a shell).
    for sig in reversed(received):
        signal.raise_signal(sig)
    return bool(server.started)
