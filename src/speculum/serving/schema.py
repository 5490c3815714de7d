"""The OpenAI request bodies the server reads, the limits it holds them to, and its error shape.

Bodies are strict (``"10"`` is not an integer) and allow unknown fields (clients send many). Every 4xx and
5xx answer has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` (:func:`error_body`);
``param`` names the offending field, or is None when no field is at fault (malformed JSON, a body too large).

Example:
    >>> body = CompletionBody.model_validate({"prompt": "Hi", "max_tokens": 3, "stop": ["\\n"]})
    >>> to_request(body, [1, 2], ServerLimits(), model_name="m", default_max_tokens=16).stop
    ('\\n',)
    >>> to_request(CompletionBody.model_validate({"prompt": "Hi", "stop": ["a"] * 5}), [1], ServerLimits(),
    ...            model_name="m", default_max_tokens=16)
    Traceback (most recent call last):
    ...
    speculum.serving.schema.RequestError: stop holds 5 strings, more than the limit of 4
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

from ..validation import InputError
from .engine import MAX_TOP_LOGPROBS, GenerationRequest

__all__ = ["CompletionBody", "ChatBody", "Message", "TokenizeBody", "DetokenizeBody", "TextCodec", "ServerLimits", "RequestError", "error_body", "to_request",
           "check_prompt_size", "check_batch_size", "default_body_limit"]

# OpenAI's own limit on stop sequences; a longer list costs the generating thread for every request.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
# A body's overhead beyond its prompt (JSON keys, sampling fields, chat roles).
BODY_OVERHEAD_BYTES = 64 * 1024


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of the server. ``max_body_bytes``: a larger body is refused (413) before it
    is read; ``max_prompt_bytes``: a prompt text of more UTF-8 bytes cannot fit the context window and is
    refused (400) without tokenizing it (None: no such check); ``max_stop`` strings of at most
    ``max_stop_chars`` characters each."""

    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_bytes: int | None = None
    max_stop: int = MAX_STOP_STRINGS
    max_stop_chars: int = MAX_STOP_CHARS


def default_body_limit(max_context: int | None, longest_token_bytes: int | None) -> ServerLimits:
    """Limits sized to the context window: a prompt of ``max_context`` tokens is at most ``max_context x
    longest_token_bytes`` bytes of UTF-8; twice that (normalisers may drop characters) bounds the prompt,
    and six times (JSON's ``\\uXXXX`` escapes) plus an overhead bounds the body. Unknown sizes: the
    defaults of :class:`ServerLimits`."""
    if not max_context or not longest_token_bytes:
        return ServerLimits()
    prompt_bytes = 2 * max_context * longest_token_bytes
    return ServerLimits(max_body_bytes=3 * prompt_bytes + BODY_OVERHEAD_BYTES, max_prompt_bytes=prompt_bytes)


class RequestError(InputError):
    """A request the server refuses: ``status`` (400 unless said), ``param`` (the field at fault or None),
    ``kind`` and ``code`` as OpenAI names them."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Body(BaseModel):
    # NaN and infinities are refused as not finite (a NaN compares false with every bound).
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)          # 0: only with echo
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = 1


class CompletionBody(_Body):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a batch of either (a list of texts or of
    token-id lists: one choice each, in order)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the body, one per choice."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @property
    def batched(self) -> bool:
        return len(self.prompts()) > 1 or (isinstance(self.prompt, list) and bool(self.prompt)
                                            and not isinstance(self.prompt[0], int))


class Message(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str


class ChatBody(_Body):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None


class TokenizeBody(BaseModel):
    """``POST /tokenize``."""

    model_config = ConfigDict(extra="allow", strict=True)
    prompt: str
    add_special_tokens: bool = True


class DetokenizeBody(BaseModel):
    """``POST /detokenize``."""

    model_config = ConfigDict(extra="allow", strict=True)
    tokens: list[int]


@dataclass(frozen=True)
class TextCodec:
    """The HTTP side's text functions: ``encode`` (a completion prompt), ``decode``, ``encode_chat`` (None:
    no chat), ``tokenize(text, add_special_tokens)``, the ``/tokenizer_info`` answer ``info`` (None: no
    tokenizer routes), the ``lock`` every call holds (tokenizers refuse concurrent use), and ``token_bytes``
    (each id's bytes, for chat log-probs)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    encode_chat: Callable[[list[dict]], list[int]] | None
    tokenize: Callable[[str, bool], list[int]]
    info: dict | None
    lock: Any
    token_bytes: Sequence[bytes | None] | None = None


def check_prompt_size(body: _Body, limits: ServerLimits) -> None:
    """Refuse a prompt that is empty, or whose text cannot fit the context window, before any tokenizing."""
    if isinstance(body, CompletionBody):
        prompts = body.prompts()
        if not all(prompts):
            raise RequestError("prompt is empty: send at least one token or character", param="prompt")
        texts = [prompt for prompt in prompts if isinstance(prompt, str)]
    else:
        texts = [message.content for message in body.messages]
    size = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
    if limits.max_prompt_bytes is not None and size > limits.max_prompt_bytes:
        raise RequestError(f"the prompt has {size:,} bytes of text, more than the context window can hold "
                           f"({limits.max_prompt_bytes:,} bytes at most)",
                           param="prompt" if isinstance(body, CompletionBody) else "messages")


def check_batch_size(prompts: Sequence[Any], capacity: int) -> None:
    """Refuse a batch of more prompts than the server ever holds at once (``capacity``: ``--max-batch`` +
    ``--max-waiting``): it could never be admitted whole, however long the client waited."""
    if len(prompts) > capacity:
        raise RequestError(f"the prompt holds {len(prompts)} prompts, more than the server holds at once "
                           f"({capacity}: --max-batch + --max-waiting); send at most {capacity} per request",
                           param="prompt")


def _stops(stop: str | list[str] | None, limits: ServerLimits) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > limits.max_stop:
        raise RequestError(f"stop holds {len(stops)} strings, more than the limit of {limits.max_stop}",
                           param="stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_chars:
        raise RequestError(f"a stop string has {longest} characters, more than the limit of "
                           f"{limits.max_stop_chars}", param="stop")
    return stops


def to_request(body: _Body, prompt_ids: Sequence[int], limits: ServerLimits, *, model_name: str,
               default_max_tokens: int) -> GenerationRequest:
    """The engine's request for ``body`` whose prompt encodes to ``prompt_ids``; :class:`RequestError`
    naming the field otherwise."""
    if body.model is not None and body.model != model_name:
        raise RequestError(f"model {body.model!r} is not served here (this server serves {model_name!r})",
                           param="model", status=404, code="model_not_found")
    if body.n != 1:
        raise RequestError(f"n={body.n} is not supported: send one request per completion", param="n")
    if isinstance(body, CompletionBody):
        logprobs, field = body.logprobs, "logprobs"
        if body.stream and (body.echo or body.batched):
            raise RequestError("stream goes with one prompt and no echo: send one request per prompt, or "
                               "stream: false", param="stream")
    else:
        if (body.model_extra or {}).get("echo"):
            raise RequestError("echo is not supported on chat completions: use /v1/completions", param="echo")
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs, field = ((body.top_logprobs or 0) if body.logprobs else None), "top_logprobs"
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"{field} must be in 0..{MAX_TOP_LOGPROBS}, got {logprobs}", param=field)
    if not prompt_ids:
        raise RequestError("the prompt encodes to no token", param="prompt")
    max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None), default_max_tokens)
    if max_tokens == 0 and not getattr(body, "echo", False):
        raise RequestError("max_tokens must be at least 1 (0 only with echo: the prompt's log-probs alone)",
                           param="max_tokens")
    return GenerationRequest(prompt_ids=list(prompt_ids), max_tokens=max_tokens, temperature=body.temperature,
                             top_p=body.top_p, seed=body.seed, stop=_stops(body.stop, limits), logprobs=logprobs)
