"""``/v1/completions`` with ``echo`` or several prompts: each prompt answered as if alone, in order, one
choice each.

With ``echo`` a prompt is scored by the engine's :class:`~speculum.models.prompt_scores.PromptScorer` (its
tokens' exact log-probs, the first ``null`` as OpenAI gives it, each with its likeliest alternatives from
the same row), then followed by the generated tokens: none for ``max_tokens: 0``; for ``max_tokens: 1`` the
token drawn from the scored row after the prompt (greedy: its argmax, lowest id on ties, as plain greedy
decoding), so an evaluator's request (``echo``, ``max_tokens: 1``, ``logprobs: 1``) costs only the tokens
its prompt does not share with recently scored ones; for more, an ordinary generation after the prompt.
The prompt's log-probs are bitwise the same whatever else the server does.

Example:
    >>> from speculum.models import MarkovModel
    >>> from speculum.serving import Engine, create_app
    >>> from fastapi.testclient import TestClient
    >>> engine = Engine(MarkovModel.random(6, seed=0), decode=lambda ids: "".join(map(str, ids)))
    >>> app = create_app(engine, "markov", encode_text=lambda text: [int(c) for c in text])
    >>> with TestClient(app) as client:
    ...     reply = client.post("/v1/completions", json={"prompt": ["012", "013"], "echo": True, "max_tokens": 0,
    ...                                                  "logprobs": 1}).json()
    >>> [choice["text"] for choice in reply["choices"]], reply["choices"][0]["logprobs"]["token_logprobs"][0]
    (['012', '013'], None)
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..decoding.text import StopMatcher
from ..decoding.warp import sample_from_logprobs, warp_logprobs
from ..models.prompt_scores import PromptScores, likeliest
from .engine import Delta, Engine, GenerationRequest, Job, Reservation, ScoreJob, TokenLogprob
from .render import by_text

__all__ = ["Answer", "collect", "answer_prompt", "render_choices"]


@dataclass
class Answer:
    """One prompt's choice: the text shown, its log-probs (echoed prompt tokens first) and counts."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    scored: list[TokenLogprob] = field(default_factory=list)
    echoed: PromptScores | None = None
    error: str | None = None


async def collect(events: asyncio.Queue) -> tuple[list[str], list, Delta]:
    """A generation job's text pieces, scored tokens and last event, until its end."""
    pieces, scored, last = [], [], Delta("")
    while (event := await events.get()) is not None:
        pieces.append(event.text)
        scored += event.logprobs
        last = event if event.finish_reason else last
    return pieces, scored, last


async def _scores(engine: Engine, ids: list[int], top: int, reservation: Reservation | None) -> PromptScores:
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def done(job: ScoreJob) -> None:
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(job))

    job = engine.score(ids, top=top, on_done=done, reservation=reservation)
    try:
        finished = await future
    except asyncio.CancelledError:
        job.cancel(disconnected=True)
        raise
    return finished.result()


async def _generate(engine: Engine, request: GenerationRequest,
                    reservation: Reservation | None) -> tuple[list[str], list, Delta]:
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job: Job = engine.submit(request, on_event=lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
                             reservation=reservation)
    try:
        return await collect(events)
    except asyncio.CancelledError:
        job.cancel(disconnected=True)
        raise


def _one_token(row: np.ndarray, request: GenerationRequest) -> int:
    """The token after a scored prompt: the argmax (greedy; lowest id on ties), else a draw from the warped
    row with the request's seed (exact: the law of plain sampling's first token)."""
    if request.temperature == 0.0:
        return int(np.argmax(row))
    warped = warp_logprobs(row[None, :], temperature=request.temperature, top_p=request.top_p)[0]
    return sample_from_logprobs(warped, float(np.random.default_rng(request.seed).random()))


async def answer_prompt(engine: Engine, request: GenerationRequest, *, echo: bool, prompt_text: str,
                        decode: Callable[[Sequence[int]], str], reservation: Reservation | None = None) -> Answer:
    """One choice: ``request``'s generation, after its prompt's scores when ``echo``; its jobs take the room
    of ``reservation`` (if given), which it gives back at its end."""
    try:
        return await _answer(engine, request, echo=echo, prompt_text=prompt_text, decode=decode,
                             reservation=reservation)
    finally:
        if reservation is not None:
            reservation.release()


async def _answer(engine: Engine, request: GenerationRequest, *, echo: bool, prompt_text: str,
                  decode: Callable[[Sequence[int]], str], reservation: Reservation | None) -> Answer:
    ids, top = list(request.prompt_ids), request.logprobs or 0
    echoed = await _scores(engine, ids, top, reservation) if echo else None
    shown = prompt_text if echo else ""
    if echo and request.max_tokens <= 1:
        answer = Answer(shown, "length", len(ids), 0, echoed=echoed)
        if request.max_tokens == 1:
            assert echoed is not None
            row = echoed.next_logprobs
            token = _one_token(row, request)
            text = decode([token])
            cut, hit = StopMatcher(request.stop).cut(text)
            eos = token == engine.eos_token_id
            answer.text += "" if eos else cut
            answer.finish_reason = "stop" if hit or eos else "length"
            answer.completion_tokens = 1
            if not hit:
                likeliest = [(t, lp) for t, lp in _top(row, top)]
                answer.scored = [TokenLogprob(token, text, float(row[token]), 0,
                                              tuple((t, decode([t]), lp) for t, lp in likeliest))]
        return answer
    pieces, scored, last = await _generate(engine, request, reservation)
    if last.finish_reason == "error":
        return Answer(shown, "error", len(ids), 0, echoed=echoed, error=last.error or "generation failed")
    return Answer(shown + "".join(pieces), last.finish_reason or "length", len(ids), last.completion_tokens,
                  list(scored), echoed)


def _top(row: np.ndarray, k: int) -> list[tuple[int, float]]:
    return [(int(t), float(row[t])) for t in likeliest(row, k)]


def render_choices(model_name: str, ident: str, created: int, answers: Sequence[Answer], *, logprobs: int | None,
                   decode: Callable[[Sequence[int]], str]) -> dict:
    """The whole ``text_completion`` response: a choice per answer, log-probs with the echoed prompt's first."""
    choices = []
    for index, answer in enumerate(answers):
        entry: dict[str, Any] = {"index": index, "text": answer.text, "logprobs": None,
                                 "finish_reason": answer.finish_reason}
        if logprobs is not None:
            tokens, values, tops = [], [], []
            if answer.echoed is not None:
                for token, value, top in zip(answer.echoed.tokens, answer.echoed.logprobs, answer.echoed.top):
                    tokens.append(decode([token]))
                    values.append(value)
                    tops.append(None if value is None else by_text([(t, decode([t]), lp) for t, lp in top]))
            for scored in answer.scored:
                tokens.append(scored.text)
                values.append(scored.logprob)
                tops.append(by_text(scored.top))
            offsets = np.concatenate([[0], np.cumsum([len(t) for t in tokens])[:-1]]).astype(int).tolist() \
                if tokens else []
            entry["logprobs"] = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                                 "text_offset": offsets}
        choices.append(entry)
    prompt_tokens = sum(a.prompt_tokens for a in answers)
    completion_tokens = sum(a.completion_tokens for a in answers)
    return {"id": f"cmpl-{ident}", "object": "text_completion", "created": created, "model": model_name,
            "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                          "total_tokens": prompt_tokens + completion_tokens}}
