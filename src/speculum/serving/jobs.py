"""The jobs an engine runs and what it asks of them (:class:`EngineJob`): a generation (:class:`Job`: its
request, its events (:class:`Delta`), the log-probs of its tokens (:class:`TokenLogprob`)), a prompt to
score (:class:`ScoreJob`, OpenAI's ``echo``); the jobs of one kind running together (:class:`Pool`); the
place a request holds in the engine (:class:`Reservation`).

Why: the engine only orchestrates (admission, the alternation of generation steps and scoring rounds,
metrics, shutdown). What a job makes of its backend's output (a generation's text, stop strings,
log-probs and finish reason; a prompt's scores) and how it tells its reader that it failed, was aborted or
ended is the job's own, behind one protocol, so the engine never asks which kind a job is.

Exactness: none decided here; a generation shows the text of the tokens its plan emitted, cut at the
first stop string, and the target's own log-probs of them; a score job hands over its scorer's answer.

Example:
    >>> from speculum.serving.jobs import Delta
    >>> Delta("Hello", finish_reason="stop").finish_reason
    'stop'
    >>> job = ScoreJob([3, 1], top=0)
    >>> job.pool, job.done
    ('scoring', False)
    >>> job.abort("the server is shutting down"); job.done, type(job.error).__name__
    (True, 'EngineClosed')
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Hashable, Iterator, Protocol, Sequence

from ..decoding.plan import Plan
from ..decoding.text import StopMatcher, TextStream
from ..models.prompt_scores import PromptScores, likeliest

__all__ = ["EngineJob", "EngineBusy", "EngineClosed", "GenerationRequest", "TokenLogprob", "Delta", "Job",
           "ScoreJob", "Pool", "Reservation", "GENERATION", "SCORING"]

_DONE = object()        # the last item of a job's event queue
GENERATION = "generation"   # the pool of jobs the scheduler advances a block per step
SCORING = "scoring"         # the pool of prompts the scorer feeds a round at a time


class EngineBusy(RuntimeError):
    """The engine holds as many requests as it admits, running and waiting (HTTP 429)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no more requests (HTTP 503)."""


class EngineJob(Protocol):
    """What an engine asks of a job of any kind. The engine sets ``reservation`` (the room it takes; None:
    its own) and ``ended`` (False while the engine holds it); ``disconnected``: cancelled because its reader
    went away."""

    pool: ClassVar[str]     # the pool it joins: GENERATION or SCORING
    reservation: Any
    ended: bool
    disconnected: bool

    @property
    def cancelled(self) -> bool:
        """Cancelled: the engine drops it at its next step or round."""

    def cancel(self, *, disconnected: bool = False) -> None:
        """Stop at the next step or round (``disconnected``: because the reader went away)."""

    def start(self, backend: Any) -> Hashable:
        """Join ``backend`` (its pool's: the scheduler, the prompt scorer); returns the handle the backend
        knows it by. Raises what the backend raises (the job then fails alone)."""

    def advance(self, outcome: Any) -> bool:
        """Take what the backend computed for it (a generation's chunk of a step, a prompt's scores) and tell
        the reader; True once it is done (its last event delivered)."""

    def fail(self, error: BaseException) -> None:
        """Tell the reader that the model failed on it (``error``)."""

    def abort(self, reason: str) -> None:
        """Tell the reader that the engine ended it unfinished (``reason``: it is shutting down)."""

    def close(self) -> None:
        """The engine let go of it: the reader's last notice (after a result, a failure or a cancel)."""


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
    """One submitted generation: iterate it for its :class:`Delta` events (blocking), or ``cancel()`` it. It
    turns the chunks the scheduler emits for it into events (:meth:`advance`): their text once final, cut
    at the first stop string, with the log-probs of the tokens shown, and a last event with the finish
    reason and counts."""

    pool = GENERATION

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
        self.emitted = 0                                     # tokens emitted so far
        self._text = TextStream(decode)
        self._stops = StopMatcher(request.stop)
        self._decode = decode
        self._scored: list[tuple[int, float, tuple]] = []    # (token, log-prob, top) per emitted token
        self._released = 0                                   # tokens whose log-probs were delivered
        self._released_chars = 0                             # characters before the next such token
        self._shown_chars = 0                                # characters of text delivered

    def start(self, backend: Any) -> Hashable:
        """Join the scheduler (``backend``): its plan's prompt is fed there; returns its id there."""
        return backend.add_plan(self.plan)

    def advance(self, chunk: Any) -> bool:
        """Deliver what a step's ``chunk`` for it (its tokens, their rows, whether the plan finished) makes
        final; True once the job is done: a stop string appeared or the plan finished ("stop" at eos,
        "length" at ``max_tokens`` or the context's end)."""
        self.emitted = chunk.stats.emitted
        self._note(chunk.tokens, chunk.target_logprobs)
        shown, hit = self._stops.add(self._text.add(chunk.tokens))
        if chunk.finished and not hit:
            more, hit = self._stops.cut(self._text.flush())
            shown += more
        self._shown_chars += len(shown)
        scored = self._release(everything=chunk.finished and not hit)
        if shown or scored:
            self.put(Delta(shown, logprobs=scored))
        if not (hit or chunk.finished):
            return False
        reason = "stop" if hit or chunk.stop_reason == "eos" else "length"
        self.put(Delta("", reason, prompt_tokens=len(self.request.prompt_ids), completion_tokens=self.emitted))
        return True

    def fail(self, error: BaseException) -> None:
        self.put(Delta("", "error", error=f"{type(error).__name__}: {error}"))

    def abort(self, reason: str) -> None:
        self.put(Delta("", "error", error=reason))

    def close(self) -> None:
        self.put(None)

    def _note(self, tokens: Sequence[int], target_logprobs: Any) -> None:
        """Note the target's log-probs of ``tokens`` (rows ``target_logprobs``), if the request asks."""
        k = self.request.logprobs
        if k is None or target_logprobs is None:
            return
        for token, row in zip(tokens, target_logprobs):
            # The likeliest among the possible tokens: an impossible one (-inf) is no alternative.
            top = likeliest(row, k)
            self._scored.append((int(token), float(row[token]),
                                 tuple((int(t), self._decode([int(t)]), float(row[t])) for t in top)))

    def _release(self, everything: bool = False) -> tuple[TokenLogprob, ...]:
        """Log-probs of the scored tokens whose text is within what was shown (``everything``: all)."""
        out = []
        while self._released < len(self._scored):
            i = self._released
            end = len(self._decode(self._text.tokens[: i + 1]).rstrip("\ufffd"))
            if end > self._shown_chars and not everything:
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
    :class:`~speculum.models.prompt_scores.PromptScores`; ``on_done(job)`` (optional) is called from the
    worker once it is done."""

    pool = SCORING

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

    def start(self, backend: Any) -> Hashable:
        """Join the prompt scorer (``backend``); returns its work there."""
        return backend.start(self.tokens, top=self.top)

    def advance(self, scores: PromptScores) -> bool:
        """Hand over the prompt's ``scores`` (the scorer answers once, when the prompt is scored): done."""
        self._finish(scores)
        return True

    def fail(self, error: BaseException) -> None:
        self._finish(error=error)

    def abort(self, reason: str) -> None:
        self._finish(error=EngineClosed(reason))

    def close(self) -> None:
        if not self.done:
            self._finish(error=EngineClosed("the request was cancelled"))

    def _finish(self, scores: PromptScores | None = None, error: BaseException | None = None) -> None:
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


class Pool:
    """The jobs of one kind that an engine's worker runs together: ``backend`` (the scheduler, the prompt
    scorer) knows each by the handle :meth:`EngineJob.start` returned, ``size`` jobs at most;
    ``forget(handle)`` makes the backend drop one (``Scheduler.cancel``, ``PromptScorer.drop``). Jobs are
    kept in the order they joined."""

    def __init__(self, backend: Any, size: int, forget: Callable[[Hashable], None]) -> None:
        self.backend, self.size = backend, size
        self._forget = forget
        self.jobs: dict[Hashable, EngineJob] = {}

    def __len__(self) -> int:
        return len(self.jobs)

    def room(self) -> bool:
        """Whether one more job may join."""
        return len(self.jobs) < self.size

    def join(self, job: EngineJob) -> None:
        """Start ``job`` in the backend (raises what its start raises; it has not joined then)."""
        self.jobs[job.start(self.backend)] = job

    def leave(self, handle: Hashable) -> EngineJob:
        """Take the job known by ``handle`` out of the backend and the pool; returns it."""
        self._forget(handle)
        return self.jobs.pop(handle)


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
