"""A generation request and the job that carries it through the engine: its events (:class:`Delta`), the
log-probs of its tokens (:class:`TokenLogprob`), cancellation; a prompt waiting to be scored
(:class:`ScoreJob`, OpenAI's ``echo``); the place a request holds in the engine (:class:`Reservation`).

Example:
    >>> from speculum.serving.jobs import Delta
    >>> Delta("Hello", finish_reason="stop").finish_reason
    'stop'
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from ..decoding.plan import Plan
from ..decoding.text import StopMatcher, TextStream
from ..models.prompt_scores import PromptScores, likeliest

__all__ = ["GenerationRequest", "TokenLogprob", "Delta", "Job", "ScoreJob", "Reservation"]

_DONE = object()        # the last item of a job's event queue


@dataclass(frozen=True)
class GenerationRequest:
    """One request's decoding arguments (OpenAI's names). ``stop``: strings that end the output (not
    included in it). ``temperature=0`` is greedy."""

    prompt_ids: Sequence[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None      # None: none; k >= 0: each token's log-prob and the k likeliest (<= 20)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token and the target's log-prob of it, with the ``top`` most probable tokens at its
    position as ``(token id, text, log-prob)``, most probable first (possible tokens only: fewer where
    fewer than asked have a log-prob above -inf). Exact: the target's own distribution
    there (before temperature / top-p), from the rows its verification computed. ``offset``: characters of
    the completion before this token's text."""

    token_id: int
    text: str
    logprob: float
    offset: int
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True)
class Delta:
    """Text that became final; the last delta of a job has ``finish_reason`` ("stop": eos or a stop
    string; "length": ``max_tokens`` or the context window; "error": ``error`` says why) and the counts.
    ``logprobs`` (a request with ``logprobs``): the tokens whose text is shown by now and was not before; a
    token cut off by a stop string never is."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()   # the tokens whose text is now shown (requests asking for them)


class Job:
    """One submitted request: iterate it for its :class:`Delta` events (blocking), or ``cancel()`` it."""

    def __init__(self, request: GenerationRequest, plan: Plan, decode: Callable[[Sequence[int]], str],
                 on_event: Callable[[Delta | None], None] | None = None) -> None:
        self.request = request
        self.plan = plan
        self.events: queue.Queue = queue.Queue()
        self._on_event = on_event
        self._cancelled = threading.Event()
        self.ended = True                                    # False while the engine holds it (set by the engine)
        self.disconnected = False                            # cancelled because its reader went away
        self.reservation: Any = None                         # the room it takes (set by the engine; None: its own)
        self.text = TextStream(decode)
        self.stops = StopMatcher(request.stop)
        self.emitted = 0
        self._decode = decode
        self._scored: list[tuple[int, float, tuple]] = []    # (token, log-prob, top) per emitted token
        self._released = 0                                   # tokens whose log-probs were delivered
        self._released_chars = 0                             # characters before the next such token
        self.shown_chars = 0                                 # characters of text delivered

    def score(self, tokens: Sequence[int], target_logprobs: Any) -> None:
        """Note the target's log-probs of ``tokens`` (rows ``target_logprobs``), if the request asks."""
        k = self.request.logprobs
        if k is None or target_logprobs is None:
            return
        for token, row in zip(tokens, target_logprobs):
            # The likeliest among the possible tokens: an impossible one (-inf) is no alternative.
            top = likeliest(row, k)
            self._scored.append((int(token), float(row[token]),
                                 tuple((int(t), self._decode([int(t)]), float(row[t])) for t in top)))

    def release(self, everything: bool = False) -> tuple[TokenLogprob, ...]:
        """Log-probs of the scored tokens whose text is within what was shown (``everything``: all)."""
        out = []
        while self._released < len(self._scored):
            i = self._released
            end = len(self._decode(self.text.tokens[: i + 1]).rstrip("\ufffd"))
            if end > self.shown_chars and not everything:
                break
            token, logprob, top = self._scored[i]
            out.append(TokenLogprob(token, self._decode([token]), logprob, self._released_chars, top))
            self._released, self._released_chars = i + 1, max(end, self._released_chars)
        return tuple(out)

    def put(self, event: Delta | None) -> None:
        """Deliver an event (None: the job has ended) to ``on_event``, else to the blocking queue."""
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:       # the reader's side is gone (e.g. its event loop closed at shutdown)
                self.cancel(disconnected=True)
        else:
            self.events.put(_DONE if event is None else event)

    def cancel(self, *, disconnected: bool = False) -> None:
        """Stop generating at the next step (``disconnected``: because the reader went away)."""
        self.disconnected = self.disconnected or (disconnected and not self._cancelled.is_set())
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def next_event(self, timeout: float | None = None) -> Delta | None:
        """The next delta, or None once the job has ended."""
        event = self.events.get(timeout=timeout)
        return None if event is _DONE else event

    def __iter__(self) -> Iterator[Delta]:
        while (event := self.next_event()) is not None:
            yield event


class ScoreJob:
    """A prompt waiting to be scored by an engine's worker (:meth:`Engine.score
    <speculum.serving.engine.Engine.score>`): :meth:`result` blocks for its
    :class:`~speculum.models.prompt_scores.PromptScores`;
    ``on_done(job)`` (optional) is called from the worker once it is done."""

    def __init__(self, tokens: Sequence[int], top: int, on_done: Callable[["ScoreJob"], None] | None = None) -> None:
        self.tokens, self.top = list(tokens), top
        self._on_done = on_done
        self._done = threading.Event()
        self._cancelled = threading.Event()
        self.scores: PromptScores | None = None
        self.error: BaseException | None = None
        self.ended = True             # False while the engine holds it (set by the engine)
        self.disconnected = False
        self.reservation: Any = None  # the room it takes in the engine (set by the engine; None: its own)
        self.work: Any = None         # its place in the engine's scorer, while scored

    def finish(self, scores: PromptScores | None = None, error: BaseException | None = None) -> None:
        self.scores, self.error = scores, error
        self._done.set()
        if self._on_done is not None:
            try:
                self._on_done(self)
            except Exception:         # the reader's side is gone (e.g. its event loop closed)
                self._cancelled.set()

    def cancel(self, *, disconnected: bool = False) -> None:
        self.disconnected = self.disconnected or (disconnected and not self._done.is_set())
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        """Scored, failed or refused: :meth:`result` returns at once."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> PromptScores:
        """The scores (blocking); the worker's exception if scoring failed."""
        if not self._done.wait(timeout):
            raise TimeoutError("the prompt was not scored in time")
        if self.error is not None:
            raise self.error
        assert self.scores is not None
        return self.scores


class Reservation:
    """A place held in an engine for one request (:meth:`Engine.reserve
    <speculum.serving.engine.Engine.reserve>` holds those of a batch at once):
    the jobs submitted with it, one after another, take no place of their own. The place is the engine's
    again once the request is done (:meth:`release`) and no job of it is held any more."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.released = False
        self.live = 0               # jobs of it the engine holds

    def held(self) -> int:
        return 0 if self.released and not self.live else 1

    def release(self) -> None:
        """The request is done (idempotent)."""
        self.engine.resize_reservation(self, release=True)
