"""OpenAI's response shapes: one renderer per endpoint, turning the engine's :class:`Delta` events into a
whole response or stream chunks.

Example:
    >>> from speculum.serving.engine import Delta
    >>> renderer = CompletionRenderer("m", logprobs=None)
    >>> renderer.whole("abc", "xyz", Delta("", "length", prompt_tokens=2, completion_tokens=3), [])["usage"]
    {'prompt_tokens': 2, 'completion_tokens': 3, 'total_tokens': 5}
"""
from __future__ import annotations

import time
from typing import Sequence

from .engine import Delta, TokenLogprob

__all__ = ["CompletionRenderer", "ChatRenderer", "by_text"]


def by_text(top: Sequence[tuple[int, str, float]]) -> dict[str, float]:
    """Alternatives keyed by their text, likeliest first; two tokens with one text keep the likelier's
    log-prob (so the likeliest token's entry is its own)."""
    out: dict[str, float] = {}
    for _, text, logprob in top:
        out.setdefault(text, logprob)
    return out


def _usage(event: Delta) -> dict:
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens}


class _Renderer:
    prefix = ""
    whole_object = ""
    chunk_object = ""

    def __init__(self, model_name: str, *, logprobs: int | bool | None) -> None:
        self.model_name = model_name
        self.wants_logprobs = logprobs is not None and logprobs is not False
        self.created = int(time.time())

    def _head(self, ident: str, kind: str) -> dict:
        return {"id": f"{self.prefix}-{ident}", "object": kind, "created": self.created, "model": self.model_name}

    def logprobs(self, scored: Sequence[TokenLogprob]) -> dict | None:
        raise NotImplementedError

    def whole(self, ident: str, text: str, last: Delta, scored: Sequence[TokenLogprob]) -> dict:
        """The whole (non-streamed) response: ``text``, the finish of ``last`` and ``scored`` log-probs."""
        return self._head(ident, self.whole_object) | {
            "choices": [self._choice(text, last.finish_reason, scored, first=True, whole=True)], "usage": _usage(last)}

    def chunk(self, ident: str, event: Delta, first: bool) -> dict:
        """One server-sent event's payload; the last one (a finish reason) carries ``usage``."""
        chunk = self._head(ident, self.chunk_object) | {
            "choices": [self._choice(event.text, event.finish_reason, event.logprobs, first=first, whole=False)]}
        if event.finish_reason:
            chunk["usage"] = _usage(event)
        return chunk

    def _choice(self, text: str, finish: str | None, scored: Sequence[TokenLogprob], *, first: bool,
                whole: bool) -> dict:
        raise NotImplementedError


class CompletionRenderer(_Renderer):
    """``/v1/completions``: ``text`` per choice; log-probs as parallel lists."""

    prefix, whole_object, chunk_object = "cmpl", "text_completion", "text_completion"

    def logprobs(self, scored: Sequence[TokenLogprob]) -> dict | None:
        if not self.wants_logprobs:
            return None
        return {"tokens": [t.text for t in scored], "token_logprobs": [t.logprob for t in scored],
                "top_logprobs": [by_text(t.top) for t in scored],
                "text_offset": [t.offset for t in scored]}

    def _choice(self, text, finish, scored, *, first, whole) -> dict:
        return {"index": 0, "text": text, "logprobs": self.logprobs(scored), "finish_reason": finish}


class ChatRenderer(_Renderer):
    """``/v1/chat/completions``: a ``message`` (whole) or ``delta`` (chunks); log-probs per token with its
    bytes (``token_bytes``: each id's bytes; without it, the UTF-8 of its text)."""

    prefix, whole_object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, model_name: str, *, logprobs: int | bool | None,
                 token_bytes: Sequence[bytes | None] | None = None) -> None:
        super().__init__(model_name, logprobs=logprobs or None)
        self.token_bytes = token_bytes

    def _entry(self, token_id: int, text: str, logprob: float) -> dict:
        raw = self.token_bytes[token_id] if self.token_bytes is not None and token_id < len(self.token_bytes) else None
        return {"token": text, "logprob": logprob,
                "bytes": list(raw) if raw is not None else list(text.encode("utf-8"))}

    def logprobs(self, scored: Sequence[TokenLogprob]) -> dict | None:
        if not self.wants_logprobs:
            return None
        return {"content": [self._entry(t.token_id, t.text, t.logprob)
                            | {"top_logprobs": [self._entry(*alternative) for alternative in t.top]} for t in scored]}

    def _choice(self, text, finish, scored, *, first, whole) -> dict:
        if whole:
            content = {"message": {"role": "assistant", "content": text}}
        else:
            content = {"delta": {"role": "assistant", "content": text} if first else (
                {"content": text} if text else {})}
        return {"index": 0} | content | {"logprobs": self.logprobs(scored), "finish_reason": finish}
