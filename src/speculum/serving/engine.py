"""The serving engine: a bounded queue of generation jobs run by one worker thread.

The target runs one request at a time (a declared batch size of 1): each job is :func:`speculum.stream`
over its own prompt and its own seed, so a seeded request's output does not depend on what else is
queued, and a greedy request's output is identical to ``speculum.generate`` alone. A job yields
:class:`Delta` events (text that became final, then a last event with the finish reason and usage); a job
whose reader goes away is cancelled and frees the worker at its next verification step.

Example:
    >>> from speculum.models import MarkovModel
    >>> from speculum.serving.engine import Engine, GenerationRequest
    >>> engine = Engine(MarkovModel.random(6, seed=0), decode=lambda ids: "".join(map(str, ids)))
    >>> job = engine.submit(GenerationRequest(prompt_ids=[0], max_tokens=4, temperature=0.0))
    >>> [d.finish_reason for d in job][-1]
    'length'
    >>> engine.close()
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from ..decoding import stream
from ..decoding.text import StopMatcher, TextStream
from ..validation import check_int

__all__ = ["Engine", "EngineBusy", "EngineClosed", "GenerationRequest", "Delta", "Job", "EngineMetrics"]


class EngineBusy(RuntimeError):
    """The queue of waiting requests is full (HTTP 429)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no more requests (HTTP 503)."""


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


@dataclass(frozen=True)
class Delta:
    """Text that became final; the last delta of a job has ``finish_reason`` ("stop": eos or a stop
    string; "length": ``max_tokens`` or the context window; "error": ``error`` says why) and the counts."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class EngineMetrics:
    """Running totals since the engine started (``/metrics``)."""

    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_rejected: int = 0
    requests_running: int = 0
    requests_waiting: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0
    target_forwards: int = 0
    busy_seconds: float = 0.0
    started: float = field(default_factory=time.monotonic)

    @property
    def acceptance_rate(self) -> float:
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0

    @property
    def tokens_per_busy_second(self) -> float:
        return self.completion_tokens / self.busy_seconds if self.busy_seconds > 0 else 0.0


_DONE = object()


class Job:
    """One submitted request: iterate it for its :class:`Delta` events (blocking), or ``cancel()`` it."""

    def __init__(self, request: GenerationRequest, chunks: Iterator[Any],
                 on_event: Callable[[Delta | None], None] | None = None) -> None:
        self.request = request
        self.chunks = chunks
        self.events: queue.Queue = queue.Queue()
        self._on_event = on_event
        self._cancelled = threading.Event()

    def put(self, event: Delta | None) -> None:
        """Deliver an event (None: the job has ended) to ``on_event``, else to the blocking queue."""
        if self._on_event is not None:
            self._on_event(event)
        else:
            self.events.put(_DONE if event is None else event)

    def cancel(self) -> None:
        """Stop generating at the next verification step (the reader went away)."""
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


class Engine:
    """Runs :func:`speculum.stream` jobs one at a time, in submission order, on a worker thread.

    Args:
        target: the protocol model that verifies (and has the last word).
        draft: the draft model or proposer shared by every request (None: plain decoding).
        gamma: proposals per target forward, or ``"auto"``.
        decode: token ids -> text (default: ``target.decode``).
        eos_token_id: where generation stops (default: the target's).
        max_waiting: requests that may wait beyond the running one; more are refused (:class:`EngineBusy`).

    Guarantee: exact — every job's tokens have the law of plain sampling from the target (greedy: the
    same tokens as ``speculum.generate`` with the same arguments), whatever else is queued.
    """

    def __init__(self, target: Any, *, draft: Any = None, gamma: int | str = "auto",
                 decode: Callable[[Sequence[int]], str] | None = None, eos_token_id: Any = ...,
                 max_waiting: int = 64) -> None:
        self.target = target
        self.draft = draft
        self.gamma = gamma
        self.decode = decode if decode is not None else target.decode
        self.eos_token_id = getattr(target, "eos_token_id", None) if eos_token_id is ... else eos_token_id
        self.metrics = EngineMetrics()
        # Hugging Face's fast tokenizers refuse concurrent use from several threads ("Already borrowed"):
        # the HTTP handlers encode and the worker decodes under this one lock.
        self.tokenizer_lock = threading.Lock()
        self.max_waiting = check_int(max_waiting, "max_waiting", minimum=0)
        self._waiting: queue.Queue = queue.Queue()
        self._pending = 0                   # jobs submitted and not yet ended: waiting + running
        self._lock = threading.Lock()
        self._closed = False
        self._current: Job | None = None
        self._worker = threading.Thread(target=self._work, name="speculum-engine", daemon=True)
        self._worker.start()

    def submit(self, request: GenerationRequest, on_event: Callable[[Delta | None], None] | None = None) -> Job:
        """Queue ``request``. Its arguments are checked here, before it waits (``InputError``); a full
        queue raises :class:`EngineBusy`, a closed engine :class:`EngineClosed`. Events go to
        ``on_event`` (called from the worker thread; None marks the end) or, without it, to the job's
        blocking iterator."""
        chunks = stream(self.target, list(request.prompt_ids), draft=self.draft,
                        max_new_tokens=request.max_tokens, gamma=self.gamma, temperature=request.temperature,
                        top_p=request.top_p, eos_token_id=self.eos_token_id, seed=request.seed)
        job = Job(request, chunks, on_event)
        with self._lock:
            if self._closed:
                raise EngineClosed("the server is shutting down")
            if self._pending > self.max_waiting:
                self.metrics.requests_rejected += 1
                raise EngineBusy(f"too many requests waiting ({self.max_waiting}); retry later")
            self._pending += 1
            self._waiting.put(job)
            self.metrics.requests_waiting = self._waiting.qsize()
        return job

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new requests, cancel the running and waiting ones, and stop the worker."""
        with self._lock:
            self._closed = True
            current = self._current
        if current is not None:
            current.cancel()
        while True:
            try:
                job = self._waiting.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.put(Delta("", "error", error="the server is shutting down"))
                job.put(None)
        self._waiting.put(None)
        self._worker.join(timeout)

    # ------------------------------------------------------------------------------------ worker
    def _work(self) -> None:
        while True:
            job = self._waiting.get()
            if job is None:
                return
            with self._lock:
                self._current = job
                self.metrics.requests_waiting = self._waiting.qsize()
                self.metrics.requests_running = 1
            try:
                self._run(job)
            except Exception as exc:  # a failing request must not take the server down with it
                job.put(Delta("", "error", error=f"{type(exc).__name__}: {exc}"))
            finally:
                with self._lock:
                    self._current = None
                    self._pending -= 1
                    self.metrics.requests_running = 0
                job.put(None)

    def _run(self, job: Job) -> None:
        request, metrics = job.request, self.metrics

        def decode(ids: Sequence[int]) -> str:
            with self.tokenizer_lock:
                return self.decode(ids)

        text = TextStream(decode)
        stops = StopMatcher(request.stop)
        stats, stop_reason, started = None, None, time.perf_counter()
        if job.cancelled:
            metrics.requests_cancelled += 1
            return
        try:
            for chunk in job.chunks:
                stats, stop_reason = chunk.stats, chunk.stop_reason
                shown, hit = stops.add(text.add(chunk.tokens))
                if shown:
                    job.put(Delta(shown))
                if hit:
                    stop_reason = "stop"
                    break
                if job.cancelled:
                    metrics.requests_cancelled += 1
                    return
            else:
                shown, hit = stops.add(text.flush())
                rest = shown if hit else shown + stops.flush()
                if rest:
                    job.put(Delta(rest))
        finally:
            job.chunks.close()   # frees the target's session and the drafter's
            metrics.busy_seconds += time.perf_counter() - started
            if stats is not None:
                metrics.completion_tokens += stats.emitted
                metrics.draft_proposed += stats.proposed
                metrics.draft_accepted += stats.accepted
                metrics.target_forwards += stats.target_forwards
        emitted = stats.emitted if stats is not None else 0
        metrics.prompt_tokens += len(request.prompt_ids)
        metrics.requests_finished += 1
        reason = "stop" if stop_reason in ("eos", "stop") else "length"
        job.put(Delta("", reason, prompt_tokens=len(request.prompt_ids), completion_tokens=emitted))
