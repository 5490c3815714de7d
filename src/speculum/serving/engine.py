"""The serving engine: a bounded queue of jobs, run by one thread (its own, or the caller's): generations
through a :class:`~speculum.decoding.scheduler.Scheduler` (continuous batching: up to ``max_batch`` jobs advance
together, one block each per step; jobs join and leave between steps), prompts to score (``echo``) through a
:class:`~speculum.models.prompt_scores.PromptScorer`, a round at a time between the steps.

The engine orchestrates: admission, the alternation of steps and rounds, metrics, shutdown. Every job kind
answers one protocol (:class:`~speculum.serving.jobs.EngineJob`: the pool it joins, how it starts there,
what it makes of its backend's output, how it fails, is aborted or closed), so the engine never asks which
kind a job is.

Each job has its own session, drafter and seed, so a seeded request's output does not depend on what
else runs, and a greedy request's output is identical to ``speculum.generate`` alone. A job yields
:class:`Delta` events (text that became final, then a last event with the finish reason and usage); a job
whose reader goes away is cancelled at the next step.

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

import contextlib
import queue
import threading
import time
from operator import methodcaller
from typing import Any, Callable, Sequence

from ..decoding.plan import plan_generation
from ..decoding.scheduler import Scheduler
from ..models.memory.allocator import trim_heap
from ..models.base import capabilities_of, check_token_ids
from ..models.interruption import Interrupted
from ..models.prompt_scores import DEFAULT_CACHE_TOKENS, MAX_TOP, PromptScorer
from ..validation import InputError, check_int
from .jobs import (GENERATION, SCORING, Delta, EngineBusy, EngineClosed, EngineJob, GenerationRequest, Job, Pool,
                   Reservation, ScoreJob, TokenLogprob)
from .metrics import EngineMetrics
from .rounds import IDLE_ROUND_SECONDS, STOPPABLE_ROUND_SECONDS, RoundCosts, next_idle_seconds, round_budget

__all__ = ["Engine", "EngineBusy", "EngineClosed", "GenerationRequest", "Delta", "Job", "ScoreJob", "EngineMetrics",
           "TokenLogprob", "Reservation"]

MAX_TOP_LOGPROBS = MAX_TOP
_WAKE = object()        # wakes a worker waiting for jobs; not a job
_NOTHING = object()     # an empty queue's head
MAX_SCORE_BATCH = 16    # score jobs scored together (a round's chunks share one forward)
# While generations run, scoring rounds take at most this share of the time their steps take: a generation
# beside a long echo waits for the round in progress, then runs 1.5x slower at most.
SCORING_SHARE = 0.5


class Engine:
    """Runs generation jobs on one thread (its own, or the caller's: ``background``), up to ``max_batch`` at a
    time, admitted in arrival order.

    Args:
        target: the protocol model that verifies (and has the last word).
        draft: the draft model or proposer shared by every request (None: plain decoding).
        gamma: proposals per target forward, or ``"auto"``.
        decode: token ids -> text (default: ``target.decode``).
        eos_token_id: where generation stops (default: the target's).
        max_batch: jobs that advance together (each step verifies one block of each); 1 for a target whose
            sessions share one state (``Capabilities.independent_sessions`` False, the llama.cpp backend).
        max_waiting: requests that may wait beyond the running ones: the engine holds at most
            ``max_batch + max_waiting`` requests, running and waiting, at any moment, and refuses more
            (:class:`EngineBusy`).
        batch_invariant: verify each job in its own target call (no batched forward), so that its output is
            identical to its solo run; otherwise a target with ``batched_extend`` verifies a step's blocks
            in one forward (faster; rows equal up to float rounding). A target declaring
            ``canonical_rows`` gives solo rows bitwise in its packed forward, which it keeps either way.
        prompt_tokens_per_step: prompt tokens the worker feeds per step at most, inside the packed forward
            of the running jobs' blocks (a target with ``deferred_prefill``): a longer prompt is fed over
            several steps, so a long prompt joining delays the others' next tokens by one bounded step.
        prefix_cache_tokens: tokens of recently scored prompts kept for reuse by :meth:`score` (their KV
            caches; least recently used evicted beyond it; 0: none kept).
        background: run the jobs on a thread of the engine's own; False: the caller runs them by calling
            :meth:`run` (blocking until :meth:`close`). On CPU, PyTorch's OpenMP runtime throttles its
            spin-waiting as soon as a second thread runs parallel work, which makes every small operation
            wait for a wake-up (a decode step of a small model up to 2x slower): a server whose main thread
            loaded the model calls :meth:`run` from the main thread and serves HTTP from another.

    Guarantee: exact — every job's tokens have the law of plain sampling from the target, whatever else
    runs or waits; with ``batch_invariant=True``, or a target declaring ``Capabilities.canonical_rows`` (the
    PyTorch backend's fused forward), greedy tokens are those of ``speculum.generate`` alone.

    After :attr:`idle_trim_seconds` without work the worker gives the C heap's free memory back to the
    system (:func:`~speculum.models.memory.allocator.trim_heap`), once per idle spell.
    """

    idle_trim_seconds = 1.0

    def __init__(self, target: Any, *, draft: Any = None, gamma: int | str = "auto",
                 decode: Callable[[Sequence[int]], str] | None = None, eos_token_id: Any = ...,
                 max_batch: int = 8, max_waiting: int = 64, batch_invariant: bool = False,
                 prompt_tokens_per_step: int = 512, prefix_cache_tokens: int = DEFAULT_CACHE_TOKENS,
                 background: bool = True) -> None:
        self.target = target
        self.draft = draft
        self.gamma = gamma
        self.decode = decode if decode is not None else target.decode
        self.eos_token_id = getattr(target, "eos_token_id", None) if eos_token_id is ... else eos_token_id
        self.metrics = EngineMetrics()
        # Hugging Face's fast tokenizers refuse concurrent use from several threads ("Already borrowed"):
        # the HTTP handlers encode and the worker decodes under this one lock.
        self.tokenizer_lock = threading.Lock()
        self._scheduler = Scheduler(target, batch_invariant=batch_invariant,
                                    prompt_tokens_per_step=prompt_tokens_per_step)
        self.max_batch = min(check_int(max_batch, "max_batch", minimum=1), self._scheduler.capacity or max_batch)
        self.max_waiting = check_int(max_waiting, "max_waiting", minimum=0)
        self.scorer = PromptScorer(target, max_tokens=prefix_cache_tokens)
        self.metrics.prefix_cache_capacity = self.scorer.max_tokens
        self._waiting: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._admitted = 0                      # jobs submitted and not yet ended: running, admitting or waiting
        self._deadline: float | None = None     # drain(): when the jobs still running are ended
        # The worker's alone: the generations the scheduler advances, the prompts the scorer feeds a round at a time.
        self._generating = Pool(self._scheduler, self.max_batch, self._scheduler.cancel)
        self._scoring = Pool(self.scorer, MAX_SCORE_BATCH, self.scorer.drop)
        self._pools = {GENERATION: self._generating, SCORING: self._scoring}
        self._worked = False                    # ran a step or scored since the heap was last trimmed
        # Worker seconds scoring may still take before the next generation step, while generations run:
        # scoring gets at most SCORING_SHARE of the time the generations get, so it adds at most that share
        # to their latency (plus the round a generation arrives during).
        self._score_credit = 0.0
        self._round_costs = RoundCosts()         # seconds of the last scoring rounds (sizes the next ones)
        # Rounds while no generation runs stop between two layers when one arrives, where the target can; they
        # are then long, and short again for a while after one was stopped (next_idle_seconds).
        self._stoppable = capabilities_of(target).interruptible_rows and self.scorer.packs
        self._idle_seconds = STOPPABLE_ROUND_SECONDS if self._stoppable else IDLE_ROUND_SECONDS
        self._worker: threading.Thread | None = None
        if background:
            self._worker = threading.Thread(target=self.run, name="speculum-engine", daemon=True)
            self._worker.start()

    def submit(self, request: GenerationRequest, on_event: Callable[[Delta | None], None] | None = None, *,
               reservation: Reservation | None = None) -> Job:
        """Queue ``request``. Its arguments are checked here, before it waits (``InputError``); a full
        queue raises :class:`EngineBusy` (never with a ``reservation``, whose room it takes), a closed
        engine :class:`EngineClosed`. Events go to ``on_event`` (called from the worker thread; None marks
        the end) or, without it, to the job's blocking iterator."""
        if request.logprobs is not None and check_int(request.logprobs, "logprobs", minimum=0) > MAX_TOP_LOGPROBS:
            raise InputError(f"logprobs must be at most {MAX_TOP_LOGPROBS}, got {request.logprobs}")
        plan = plan_generation(self.target, list(request.prompt_ids), draft=self.draft,
                               max_new_tokens=request.max_tokens, gamma=self.gamma, temperature=request.temperature,
                               top_k=None, top_p=request.top_p, eos_token_id=self.eos_token_id, seed=request.seed,
                               target_logprobs=request.logprobs is not None)
        job = Job(request, plan, self._locked_decode, on_event)
        self._enqueue(job, reservation)
        return job

    def score(self, prompt_ids: Sequence[int], *, top: int = 0, on_done: Callable[[ScoreJob], None] | None = None,
              reservation: Reservation | None = None) -> ScoreJob:
        """Queue ``prompt_ids`` for scoring (OpenAI's ``echo``): the worker teacher-forces it a chunk per
        round (:class:`~speculum.models.prompt_scores.PromptScorer`, sharing prefixes with recently scored
        prompts), its rounds interleaved with the generations' steps (scoring takes at most half as much of
        the worker's time as the running generations), and the job's
        :meth:`~speculum.serving.jobs.ScoreJob.result` gives its exact log-probs and ``top`` likeliest
        tokens per position. A cancelled job stops at the next round. Counts toward the engine's bound like
        a generation.

        Guarantee: exact, and bitwise the same whatever else is scored or generated."""
        check_int(top, "logprobs", minimum=0)
        if top > MAX_TOP:
            raise InputError(f"logprobs must be at most {MAX_TOP}, got {top}")
        ids = check_token_ids(prompt_ids, self.target.vocab_size, name="prompt")
        if not ids:
            raise InputError("prompt is empty: echo needs at least one token")
        max_context = getattr(self.target, "max_context", None)
        if max_context is not None and len(ids) > max_context:
            raise InputError(f"the prompt has {len(ids)} tokens, more than the target's max_context {max_context}")
        job = ScoreJob(ids, top, on_done)
        self._enqueue(job, reservation)
        return job

    @property
    def capacity(self) -> int:
        """Requests the engine holds at most, running and waiting: ``max_batch + max_waiting``."""
        return self.max_batch + self.max_waiting

    def reserve(self, count: int) -> list[Reservation]:
        """A place for each of ``count`` requests, or none: :class:`EngineBusy` when the engine cannot hold
        them all now, ``InputError`` when it never can (more than :attr:`capacity`), :class:`EngineClosed`
        while shutting down. A batch of prompts submits its jobs with the reservation: either every prompt
        runs or none does."""
        check_int(count, "count", minimum=1)
        if count > self.capacity:
            raise InputError(f"{count} requests at once are more than the server ever holds ({self.capacity}: "
                             f"max_batch {self.max_batch} + max_waiting {self.max_waiting})")
        with self._lock:
            if self._closed or self._deadline is not None:
                raise EngineClosed("the server is shutting down")
            if self._admitted + count > self.capacity:
                self.metrics.requests_rejected += 1
                raise EngineBusy(f"the server holds {self._admitted} requests ({self.max_batch} running and "
                                 f"{self.max_waiting} waiting at most): no room for {count} more; retry later")
            self._admitted += count
        return [Reservation(self) for _ in range(count)]

    def resize_reservation(self, reservation: Reservation, *, release: bool = False, live: int = 0) -> None:
        """Change what ``reservation`` holds (see :class:`Reservation`): the engine's count follows."""
        with self._lock:
            self._resize_locked(reservation, release, live)

    def _resize_locked(self, reservation: Reservation, release: bool, live: int) -> None:
        before = reservation.held()
        reservation.released = reservation.released or release
        reservation.live += live
        self._admitted += reservation.held() - before

    def _enqueue(self, job: EngineJob, reservation: Reservation | None = None) -> None:
        with self._lock:
            if self._closed or self._deadline is not None:
                raise EngineClosed("the server is shutting down")
            job.reservation = reservation
            if reservation is not None:
                self._resize_locked(reservation, False, 1)
            else:
                # One count of every job not yet ended: free batch slots the worker has not filled yet do not
                # let a burst pile up in the queue.
                if self._admitted >= self.capacity:
                    self.metrics.requests_rejected += 1
                    raise EngineBusy(f"the server holds {self._admitted} requests ({self.max_batch} running and "
                                     f"{self.max_waiting} waiting at most); retry later")
                self._admitted += 1
            job.ended = False
            self._waiting.put(job)
            self.metrics.requests_waiting = self._waiting.qsize()

    @property
    def admitted(self) -> int:
        """Requests submitted and not yet ended (running and waiting); never more than ``max_batch +
        max_waiting``."""
        return self._admitted

    def drain(self, grace: float) -> None:
        """Start a graceful shutdown: refuse new requests (:class:`EngineClosed`), keep generating the
        admitted ones for up to ``grace`` seconds, then end those still unfinished with an error event
        ("the server is shutting down"), so every reader gets a last event. :meth:`close` then stops the
        worker."""
        with self._lock:
            if self._deadline is None:
                self._deadline = time.monotonic() + max(0.0, grace)
        self._waiting.put(_WAKE)        # a worker blocked on an empty queue looks at the deadline

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new requests, cancel the running and waiting ones, and stop the worker (waiting for it up to
        ``timeout`` seconds when it is the engine's own thread)."""
        with self._lock:
            self._closed = True
        self._waiting.put(None)
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join(timeout)

    def run(self) -> None:
        """Run the jobs in the calling thread until :meth:`close` (an engine built with ``background=False``;
        the engine's own thread runs this otherwise)."""
        if self._worker is not None and self._worker is not threading.current_thread():
            raise RuntimeError("this engine runs its jobs on its own thread (built with background=True)")
        try:
            while self._admit():
                self._step()
        finally:
            self._shut_down()

    def _locked_decode(self, ids: Sequence[int]) -> str:
        with self.tokenizer_lock:
            return self.decode(ids)

    # ------------------------------------------------------------------------------------ worker
    def _admit(self) -> bool:
        """Move waiting jobs into the scheduler or the scoring rounds (blocking while nothing runs); False
        once closed."""
        if self._deadline is not None and time.monotonic() >= self._deadline:
            self._end_all("the server is shutting down")
        while True:
            idle = not self._generating and not self._scoring
            if not idle and not self._room_for(self._head()):
                break
            try:
                if self._worked and idle:
                    job = self._waiting.get(timeout=self.idle_trim_seconds)
                else:
                    job = self._waiting.get(block=idle)
            except queue.Empty:
                if not idle:
                    break
                # Idle for a while: the forwards' freed buffers, which the C heap keeps for reuse, go back
                # to the system (not between back-to-back requests, which would fault them in again).
                self._worked = False
                trim_heap()
                continue
            if job is _WAKE:
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    self._end_all("the server is shutting down")
                continue
            if job is None or self._closed:
                if job is not None:
                    self._waiting.put(job)
                return False
            if job.cancelled:
                self._end(job, cancelled=True)
            else:
                self._join(job)
        with self._lock:
            self.metrics.requests_waiting = self._waiting.qsize()
            self.metrics.requests_running = len(self._generating)
        return True

    def _join(self, job: EngineJob) -> None:
        """Start ``job`` in its pool (a generation's prompt is fed there: its prefill)."""
        started = time.perf_counter()
        try:
            self._pools[job.pool].join(job)
        except Exception as exc:  # checked at submit; a model failing at prefill fails this job only
            job.fail(exc)
            self._end(job)
        finally:
            elapsed = time.perf_counter() - started
            self.metrics.prefill_seconds += elapsed
            self.metrics.busy_seconds += elapsed

    def _head(self, empty: Any = None) -> Any:
        """The job next in the queue, left there (only the worker takes jobs out: it stays the head); ``empty``
        where the queue is empty."""
        with self._waiting.mutex:
            return self._waiting.queue[0] if self._waiting.queue else empty

    def _room_for(self, job: Any) -> bool:
        return job is _WAKE or (job is not None and self._pools[job.pool].room())

    def _step(self) -> None:
        """A generation step of the running jobs, then a scoring round when scoring has time left."""
        if self._generating:
            took = self._generate()
            # Unused time does not pile up: scoring never runs for long between two generation steps.
            self._score_credit = min(self._score_credit + SCORING_SHARE * took, SCORING_SHARE * took)
        if self._scoring and (not self._generating or self._score_credit >= 0):
            took = self._score_round(self._round_budget())
            self._score_credit = self._score_credit - took if self._generating else 0.0

    def _generate(self) -> float:
        """One step of the running generations; returns its seconds."""
        started = time.perf_counter()
        self._worked = True
        self._drop_cancelled(self._generating)
        try:
            results = self._scheduler.step()
        except Exception as exc:  # a failing model fails the jobs of this step, not the server
            self._end_pool(self._generating, methodcaller("fail", exc), cancelled=False)
            return time.perf_counter() - started
        for ident, chunk in results:
            self._account(chunk)
            if self._generating.jobs[ident].advance(chunk):
                job = self._generating.leave(ident)
                self.metrics.prompt_tokens += len(job.request.prompt_ids)
                self._end(job, finished=True)
        took = time.perf_counter() - started
        self.metrics.busy_seconds += took
        return took

    def _round_budget(self) -> int | None:
        """Tokens the next scoring round feeds (:func:`~speculum.serving.rounds.round_budget`: what fits its
        time on the last rounds' costs; while generations run, their last step's time at most, the credit)."""
        return round_budget(self._round_costs, prompts=len(self._scoring),
                            credit=self._score_credit if self._generating else None,
                            idle_seconds=self._idle_seconds)

    def _scoring_should_stop(self) -> bool:
        """Whether a scoring round run while no generation runs stops between two layers (its work is lost
        and fed again later): a generation waits at the head of the queue with room to run, the engine is
        closing or draining, or every prompt of the round was cancelled."""
        head = self._head(_NOTHING)
        if head is None or head is _WAKE:
            return True
        if head is not _NOTHING and head.pool == GENERATION and self._generating.room():
            return True
        return all(job.cancelled for job in self._scoring.jobs.values())

    def _score_round(self, budget: int | None = None) -> float:
        """One round of the scorer (:meth:`PromptScorer.advance`: the next tokens of each prompt being
        scored, ``budget`` in all on a row-canonical target, in one packed forward where the target packs);
        a cancelled job is dropped first. Returns its seconds."""
        started = time.perf_counter()
        self._worked = True
        self._drop_cancelled(self._scoring)
        scorer, metrics = self.scorer, self.metrics
        fed, forwarding = scorer.forwarded_tokens, scorer.forward_seconds
        stoppable = self._stoppable and not self._generating
        finished, failed, stopped = [], [], False
        try:
            with self.target.interruptible(self._scoring_should_stop) if stoppable else contextlib.nullcontext():
                if self._scoring:
                    finished, failed = scorer.advance(budget, round_cost=self._round_costs.fixed_tokens())
        except Interrupted:
            stopped = True
            metrics.scoring_rounds_stopped += 1
        if stoppable:
            self._idle_seconds = next_idle_seconds(self._idle_seconds, stopped=stopped)
        fed, forwarding = scorer.forwarded_tokens - fed, scorer.forward_seconds - forwarding
        ended: dict[Any, BaseException | None] = {work: None for work in finished} | dict(failed)
        for work in [work for work in self._scoring.jobs if work in ended]:
            job, error = self._scoring.leave(work), ended[work]
            if error is not None:
                job.fail(error)
            else:
                scores = scorer.scores(work)
                metrics.prompts_scored += 1
                metrics.scored_tokens_forwarded += scores.forwarded
                metrics.scored_tokens_reused += len(scores.tokens) - scores.forwarded
                job.advance(scores)
            self._end(job, finished=True)
        metrics.prefix_cache_tokens = scorer.resident_tokens
        metrics.scoring_forwards = scorer.forwards
        took = time.perf_counter() - started
        metrics.busy_seconds += took
        # The forwards alone: a round's bookkeeping grows with the prompts it finishes, not the tokens it
        # feeds, and would make the next rounds look dearer a token than they are. A stopped round fed nothing.
        if not stopped:
            self._round_costs.add(fed, forwarding)
        return took

    def _account(self, chunk: Any) -> None:
        metrics = self.metrics
        metrics.completion_tokens += len(chunk.tokens)
        metrics.draft_proposed += chunk.proposed
        metrics.draft_accepted += chunk.accepted
        metrics.target_forwards += 1

    def _drop_cancelled(self, pool: Pool) -> None:
        for handle, job in list(pool.jobs.items()):
            if job.cancelled:
                pool.leave(handle)
                self._end(job, cancelled=True)

    def _end_pool(self, pool: Pool, notice: Callable[[EngineJob], None], *, cancelled: bool) -> None:
        """End every job of ``pool``, each told by ``notice`` first (its ``fail`` or ``abort``)."""
        for handle in list(pool.jobs):
            job = pool.leave(handle)
            notice(job)
            self._end(job, cancelled=cancelled)

    def _end(self, job: EngineJob, *, cancelled: bool = False, finished: bool = False) -> None:
        if cancelled:
            self.metrics.requests_cancelled += 1
            self.metrics.requests_disconnected += job.disconnected
        if finished:
            self.metrics.requests_finished += 1
        job.close()
        with self._lock:
            if not job.ended:
                job.ended = True
                if job.reservation is None:
                    self._admitted -= 1
                else:
                    self._resize_locked(job.reservation, False, -1)
            self.metrics.requests_running = len(self._generating)

    def _end_all(self, reason: str) -> None:
        """End every running and waiting job with an error event saying ``reason``."""
        for pool in (self._generating, self._scoring):
            self._end_pool(pool, methodcaller("abort", reason), cancelled=True)
        while True:
            try:
                job = self._waiting.get_nowait()
            except queue.Empty:
                break
            if job is not None and job is not _WAKE:
                job.abort(reason)
                self._end(job, cancelled=True)
        with self._lock:
            self.metrics.requests_waiting = self._waiting.qsize()

    def _shut_down(self) -> None:
        self._scheduler.close()
        self._end_all("the server is shutting down")
