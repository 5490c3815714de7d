"""An OpenAI-compatible HTTP API over an :class:`~speculum.serving.engine.Engine` (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (both with ``stream: true`` as
server-sent events, ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(Prometheus text: requests, tokens, acceptance, throughput). Errors use OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``: 400 for a malformed body, a field of the wrong type or a
bad value (an empty prompt, a prompt longer than the context included), 404 for another model name, 413 for
a body over the limit, 429 (with ``Retry-After``) when the engine holds as many requests as it admits, 503
while shutting down. A client that disconnects cancels its job, streamed or not. ``logprobs`` (and chat's
``top_logprobs``) return the target's exact log-probs of every generated token and its likeliest
alternatives, from the rows its verification computed.

No request can stall the others: the body-size limit refuses a huge body before it is read, a prompt text
too long for the context window is refused before it is tokenized, and tokenizing runs on a worker thread,
never on the event loop that answers ``/health`` and streams the running requests.

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
# No `from __future__ import annotations`: FastAPI reads the handlers' request models from their annotations.
import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..models.base import check_token_ids
from ..validation import InputError
from .completions import answer_prompt, collect, render_choices
from .engine import Engine, EngineBusy, EngineClosed, Job
from .guards import BodyLimit, client_gone
from .lifecycle import serve_on_this_thread
from .render import ChatRenderer, CompletionRenderer
from .schema import (ChatBody, CompletionBody, DetokenizeBody, RequestError, ServerLimits, TextCodec, TokenizeBody,
                     check_batch_size, check_prompt_size, error_body, to_request)

__all__ = ["create_app", "serve_on_this_thread", "prometheus_text"]

DEFAULT_MAX_TOKENS = 256
SHUTTING_DOWN = "the server is shutting down"


def create_app(engine: Engine, model_name: str, *, encode_text: Callable[[str], list[int]],
               encode_chat: Callable[[list[dict]], list[int]] | None = None,
               default_max_tokens: int = DEFAULT_MAX_TOKENS, close_engine: bool = True,
               token_bytes: Sequence[bytes | None] | None = None, limits: ServerLimits | None = None,
               encode_lock: Any = None, decode_text: Callable[[Sequence[int]], str] | None = None,
               tokenize: Callable[[str, bool], list[int]] | None = None,
               tokenizer_info: dict | None = None) -> FastAPI:
    """The FastAPI application serving ``engine`` under ``model_name``.

    ``encode_text`` turns a completion prompt into token ids; ``encode_chat`` turns chat messages
    (``[{"role", "content"}]``) into the ids of a prompt that ends where the assistant's turn begins
    (None: chat completions answer 400). Both run on a worker thread, one call at a time under
    ``encode_lock`` (default: ``engine.tokenizer_lock``, which the engine's decoding holds too; encoders
    with a tokenizer of their own may take a lock of their own, so that encoding never waits for decoding).
    ``close_engine``: close the engine when the app shuts down. ``token_bytes``: each token id's bytes, the
    ``bytes`` of chat log-probs. ``limits``: what one request may ask (:class:`ServerLimits`).
    ``decode_text``: ids -> text for echoed prompts and ``/detokenize`` (default: the engine's decode),
    under ``encode_lock`` too; ``tokenize(text, add_special_tokens)`` answers ``/tokenize`` (default:
    ``encode_text``); ``tokenizer_info`` is what ``/tokenizer_info`` returns (``eos_token``,
    ``chat_template``, ...; None: those three routes answer 404).
    """
    lock = encode_lock if encode_lock is not None else engine.tokenizer_lock
    codec = TextCodec(encode=encode_text, decode=decode_text or engine.decode, encode_chat=encode_chat,
                      tokenize=tokenize or (lambda text, special: encode_text(text)), info=tokenizer_info,
                      lock=lock, token_bytes=token_bytes)
    api = _Api(engine, model_name, codec, default_max_tokens=default_max_tokens, limits=limits or ServerLimits())

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        if close_engine:
            await asyncio.to_thread(engine.close)

    app = FastAPI(title="speculum", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=api.limits.max_body_bytes)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(HTTPException, _http_error)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    app.get("/v1/models")(api.models)
    app.get("/health")(api.health)
    app.get("/metrics")(api.metrics)
    app.get("/tokenizer_info")(api.tokenizer_info)
    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)
    return app


def _error(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind=kind, param=param, code=code), status_code=status, headers=headers)


async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    problems = exc.errors()
    if problems and problems[0].get("type") == "json_invalid":      # its location is a byte offset, not a field
        where = problems[0].get("loc", ("body", "?"))[-1]
        return _error(400, f"the body is not valid JSON (at byte {where}): {problems[0].get('ctx', {}).get('error', '')}"
                           .rstrip(": "))
    first = problems[0] if problems else {}
    # The request field at fault, as every other refusal names it ("prompt", not "prompt.list[int].0").
    location = first.get("loc", ())
    field = str(location[1]) if len(location) > 1 else None
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
                        for e in problems[:3])
    return _error(400, message or "invalid request body", param=field)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    message = str(exc.detail)
    if exc.status_code == 400 and "parsing the body" in message:     # FastAPI: the body is not UTF-8 JSON
        message = "the body could not be read as JSON: it must be UTF-8 encoded JSON"
    return _error(exc.status_code, message, kind="invalid_request_error" if exc.status_code < 500 else "server_error",
                  headers=getattr(exc, "headers", None))


class _Api:
    """The endpoints' handlers over one engine."""

    def __init__(self, engine: Engine, model_name: str, codec: TextCodec, *, default_max_tokens: int,
                 limits: ServerLimits) -> None:
        self.engine, self.model_name, self.codec, self.limits = engine, model_name, codec, limits
        self.default_max_tokens = default_max_tokens

    async def completions(self, body: CompletionBody, request: Request) -> Any:
        if body.echo or body.batched:
            return await self._answer_each(body, request)
        prompt = body.prompt
        encode = (lambda: list(prompt)) if isinstance(prompt, list) else (lambda: self.codec.encode(prompt))
        return await self._answer(body, request, encode, CompletionRenderer(self.model_name, logprobs=body.logprobs))

    async def chat_completions(self, body: ChatBody, request: Request) -> Any:
        if self.codec.encode_chat is None:
            return _error(400, f"{self.model_name} has no chat template: use /v1/completions", param="messages")
        messages = [m.model_dump(include={"role", "content"}) for m in body.messages]
        renderer = ChatRenderer(self.model_name, logprobs=body.logprobs, token_bytes=self.codec.token_bytes)
        return await self._answer(body, request, lambda: self.codec.encode_chat(messages), renderer)

    async def tokenizer_info(self) -> Any:
        if self.codec.info is None:
            return _error(404, "this server has no tokenizer to describe")
        return self.codec.info

    async def tokenize(self, body: TokenizeBody) -> Any:
        if self.codec.info is None:
            return _error(404, "this server has no tokenizer")
        try:
            check_prompt_size(CompletionBody(prompt=body.prompt or " "), self.limits)
            tokens = await asyncio.to_thread(self._encode, lambda: self.codec.tokenize(body.prompt,
                                                                                      body.add_special_tokens))
        except RequestError as exc:
            return _error(exc.status, str(exc), param=exc.param)
        except InputError as exc:
            return _error(400, str(exc), param="prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.codec.info.get("model_max_length")}

    async def detokenize(self, body: DetokenizeBody) -> Any:
        if self.codec.info is None:
            return _error(404, "this server has no tokenizer")
        try:
            check_token_ids(body.tokens, self.engine.target.vocab_size, name="tokens")
        except InputError as exc:
            return _error(400, str(exc), param="tokens")
        return {"prompt": await asyncio.to_thread(self._encode, lambda: self.codec.decode(body.tokens))}

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "speculum"}]}

    async def health(self) -> dict:
        return {"status": "ok"}

    async def metrics(self) -> Any:
        return PlainTextResponse(prometheus_text(self.engine), media_type="text/plain; version=0.0.4")

    # -------------------------------------------------------------------------------------------------
    def _check_ids(self, ids: Sequence[int], param: str) -> None:
        """Refuse ids outside the vocabulary or more than the context window, naming the request field."""
        try:
            check_token_ids(ids, self.engine.target.vocab_size, name=param)
        except InputError as exc:
            raise RequestError(str(exc), param=param) from None
        max_context = getattr(self.engine.target, "max_context", None)
        if max_context is not None and len(ids) > max_context:
            raise RequestError(f"the prompt has {len(ids)} tokens, more than the target's max_context "
                               f"{max_context}", param=param)

    def _encode(self, encode: Callable[[], Any]) -> Any:
        with self.codec.lock:
            try:
                return encode()
            except InputError:
                raise
            except Exception as exc:   # e.g. a chat template that refuses this order of roles
                raise InputError(f"the prompt could not be encoded: {type(exc).__name__}: {exc}") from None

    async def _answer(self, body: Any, request: Request, encode: Callable[[], list[int]], renderer: Any) -> Any:
        try:
            check_prompt_size(body, self.limits)
            prompt_ids = await asyncio.to_thread(self._encode, encode)      # never on the event loop
            generation = to_request(body, prompt_ids, self.limits, model_name=self.model_name,
                                    default_max_tokens=self.default_max_tokens)
            self._check_ids(prompt_ids, "prompt" if isinstance(body, CompletionBody) else "messages")
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()
            job = self.engine.submit(generation, on_event=lambda event: loop.call_soon_threadsafe(events.put_nowait,
                                                                                                   event))
        except (InputError, EngineBusy, EngineClosed) as exc:
            return _refusal(exc)
        ident = uuid.uuid4().hex[:24]
        if body.stream:
            return StreamingResponse(_stream(job, events, renderer, ident), media_type="text/event-stream")
        return await _whole(job, events, renderer, ident, request.receive)


    async def _answer_each(self, body: CompletionBody, request: Request) -> Any:
        """``echo`` or several prompts: each prompt answered as if alone, in order (non-streamed)."""
        prompts = body.prompts()

        def encode() -> tuple[list[list[int]], list[str]]:
            ids = [list(p) if isinstance(p, list) else self.codec.encode(p) for p in prompts]
            return ids, [p if isinstance(p, str) else self.codec.decode(p) for p in prompts]

        try:
            check_batch_size(prompts, self.engine.capacity)
            check_prompt_size(body, self.limits)
            for prompt in prompts:          # token ids are checked before anything decodes them
                if isinstance(prompt, list):
                    self._check_ids(prompt, "prompt")
            ids, texts = await asyncio.to_thread(self._encode, encode)
            generations = [to_request(body, prompt_ids, self.limits, model_name=self.model_name,
                                      default_max_tokens=self.default_max_tokens) for prompt_ids in ids]
            for prompt_ids in ids:
                self._check_ids(prompt_ids, "prompt")
            # Room for every prompt or none: a batch refused with 429 runs no prompt of it.
            places = self.engine.reserve(len(generations))
        except (InputError, EngineBusy, EngineClosed) as exc:
            return _refusal(exc)
        answers = asyncio.gather(*(answer_prompt(self.engine, generation, echo=body.echo, prompt_text=text,
                                                 decode=self.codec.decode, reservation=place)
                                   for generation, text, place in zip(generations, texts, places)))
        gone = asyncio.ensure_future(client_gone(request.receive))
        try:
            await asyncio.wait({answers, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not answers.done():
                answers.cancel()
            for place in places:
                place.release()
        if not answers.done() or answers.cancelled():
            # The client left: the answers are being cancelled (a gather ends once its children have).
            answers.add_done_callback(lambda gathered: gathered.cancelled() or gathered.exception())
            return Response(status_code=499)
        try:
            results = answers.result()
        except (InputError, EngineBusy, EngineClosed) as exc:
            return _refusal(exc)
        failed = next((a for a in results if a.error), None)
        if failed is not None:
            return _error(503 if failed.error == SHUTTING_DOWN else 500, failed.error, kind="server_error")
        ident = uuid.uuid4().hex[:24]
        return await asyncio.to_thread(self._encode, lambda: render_choices(
            self.model_name, ident, int(time.time()), results, logprobs=body.logprobs, decode=self.codec.decode))


def _refusal(exc: Exception) -> JSONResponse:
    """The answer to a request refused before it runs."""
    if isinstance(exc, RequestError):
        return _error(exc.status, str(exc), kind=exc.kind, param=exc.param, code=exc.code)
    if isinstance(exc, EngineBusy):
        return _error(429, str(exc), kind="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
    if isinstance(exc, EngineClosed):
        return _error(503, str(exc), kind="server_error")
    return _error(400, str(exc))


async def _whole(job: Job, events: asyncio.Queue, renderer: Any, ident: str, receive: Callable) -> Any:
    """The non-streamed answer; a client that disconnects meanwhile cancels the job at the next step."""
    collecting, gone = asyncio.ensure_future(collect(events)), asyncio.ensure_future(client_gone(receive))
    answered = False
    try:
        done, _ = await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
        answered = collecting in done
    finally:
        gone.cancel()
        if not answered:
            job.cancel(disconnected=True)
            collecting.cancel()
    if not answered:
        return Response(status_code=499)          # nobody reads it (nginx's "client closed request")
    pieces, scored, last = collecting.result()
    if last.finish_reason == "error":
        closing = last.error == SHUTTING_DOWN
        return _error(503 if closing else 500, last.error or "generation failed", kind="server_error")
    return renderer.whole(ident, "".join(pieces), last, scored)


async def _stream(job: Job, events: asyncio.Queue, renderer: Any, ident: str) -> AsyncIterator[str]:
    """Server-sent events ending with ``[DONE]``; an error (a failed generation, a shutdown) is sent as a last
    error event before it."""
    ended = False
    try:
        first = True
        while (event := await events.get()) is not None:
            if event.finish_reason == "error":
                yield f"data: {json.dumps(error_body(event.error or 'generation failed', kind='server_error'))}\n\n"
                continue
            if event.text or event.logprobs or event.finish_reason or first:
                yield f"data: {json.dumps(renderer.chunk(ident, event, first))}\n\n"
                first = False
        ended = True
        yield "data: [DONE]\n\n"
    finally:
        if not ended:
            job.cancel(disconnected=True)     # the client went away: free the worker at the next step


def prometheus_text(engine: Engine) -> str:
    """The engine's counters in Prometheus' text exposition format."""
    m = engine.metrics
    rows = [
        ("requests_finished_total", "counter", "requests that completed", m.requests_finished),
        ("requests_cancelled_total", "counter", "requests ended before their finish (client gone, shutdown)",
         m.requests_cancelled),
        ("requests_rejected_total", "counter", "requests refused with 429 (running and waiting at the bound)",
         m.requests_rejected),
        ("requests_disconnected_total", "counter", "requests cancelled because their client went away",
         m.requests_disconnected),
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
        ("prompts_scored_total", "counter", "echo requests' prompts scored", m.prompts_scored),
        ("scored_tokens_forwarded_total", "counter", "tokens the scoring of echoed prompts fed to the target",
         m.scored_tokens_forwarded),
        ("scored_tokens_reused_total", "counter", "echoed prompt positions answered from a shared prefix",
         m.scored_tokens_reused),
        ("scoring_forwards_total", "counter", "forwards that scored echoed prompts (a packed forward counts once)",
         m.scoring_forwards),
        ("scoring_rounds_stopped_total", "counter", "scoring rounds stopped between two layers for an arriving "
         "generation (their tokens fed again)", m.scoring_rounds_stopped),
        ("prefix_cache_tokens", "gauge", "tokens of recently scored prompts kept for reuse", m.prefix_cache_tokens),
        ("prefix_cache_capacity_tokens", "gauge", "the cap on them (--prefix-cache-tokens)",
         m.prefix_cache_capacity),
    ]
    out = []
    for name, kind, text, value in rows:
        out += [f"# HELP speculum_{name} {text}", f"# TYPE speculum_{name} {kind}", f"speculum_{name} {value}"]
    return "\n".join(out) + "\n"
