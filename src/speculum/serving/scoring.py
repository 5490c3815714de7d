"""Prompt log-probs for evaluators (OpenAI's ``echo``), with work shared across requests that share a
prefix and every answer bitwise identical to the request scored alone.

A prompt is teacher-forced in a canonical way that depends on its tokens only: its first token starts a
session, then the rest is fed in chunks of ``chunk`` tokens cut at fixed positions (1, 1 + chunk,
1 + 2 chunk, ...). The rows of a chunk are computed from the keys and values of the tokens before it and
the chunk's own tokens, so two prompts that share their first ``b`` tokens, ``b`` a cut position, compute
identical rows there. :class:`PromptScorer` keeps a few recent prompts resident (their session and each
position's log-prob and likeliest alternatives, least recently used evicted beyond ``max_tokens``); a new
prompt resumes the resident one it shares the longest prefix with, rolled back to the last cut inside that
prefix, and feeds only the rest. The cut makes reuse exact: what it returns is what scoring it alone
returns, bit for bit, whatever was scored before (tested), at a cost of at most ``chunk`` tokens of the
shared prefix fed again.

Example:
    >>> from speculum.models import MarkovModel
    >>> target = MarkovModel.random(5, seed=0)
    >>> scorer = PromptScorer(target, chunk=2)
    >>> first = scorer.score([0, 1, 2, 3, 4], top=2)
    >>> second = scorer.score([0, 1, 2, 3, 1], top=2)
    >>> second.forwarded < 5, second.logprobs[:4] == first.logprobs[:4]
    (True, True)
    >>> import numpy as np
    >>> bool(np.isclose(sum(second.logprobs[1:]), target.score_sequences([[1, 2, 3, 1]], prompt=[0])[0]))
    True
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..models.base import check_token_ids
from ..validation import InputError, check_int

__all__ = ["PromptScorer", "PromptScores", "ScoreJob", "likeliest", "DEFAULT_CHUNK", "DEFAULT_CACHE_TOKENS", "MAX_TOP"]

DEFAULT_CHUNK = 32
DEFAULT_CACHE_TOKENS = 8192
MAX_TOP = 20            # alternatives kept per position (OpenAI's cap on logprobs)


@dataclass(frozen=True)
class PromptScores:
    """A prompt's exact teacher-forced log-probs.

    ``logprobs[i]``: log p(tokens[i] | tokens[:i]) (None for the first token, which has no context);
    ``top[i]``: the ``top`` likeliest tokens at position i as ``(token id, log-prob)``, likeliest first
    (ties by id; possible tokens only), from the same row, so a token that is the likeliest has bitwise its
    own log-prob there; ``next_logprobs``: (vocab,) the law of the token after the prompt; ``forwarded``:
    tokens this request fed to the target (the rest came from a resident prompt)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]
    next_logprobs: np.ndarray
    forwarded: int


def likeliest(row: np.ndarray, k: int) -> np.ndarray:
    """The ids of the ``k`` largest entries of ``row`` (possible tokens only), largest first, ties by id."""
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    if k < len(row):
        kth = np.partition(row, len(row) - k)[len(row) - k]
        candidates = np.flatnonzero(row >= kth)
    else:
        candidates = np.arange(len(row))
    order = candidates[np.lexsort((candidates, -row[candidates]))][:k]
    return order[row[order] > -np.inf]


class _Resident:
    """A scored prompt kept for reuse: its session (positioned after all its tokens) and, per position, the
    log-prob of its token and the ``MAX_TOP`` likeliest ``(ids, log-probs)``."""

    def __init__(self, tokens: list[int], session: Any, logprobs: list, top_ids: list, top_values: list,
                 next_row: np.ndarray) -> None:
        self.tokens, self.session, self.next_row = tokens, session, next_row
        self.logprobs, self.top_ids, self.top_values = logprobs, top_ids, top_values


class PromptScorer:
    """Scores prompts for ``echo`` (see the module docstring), reusing the longest shared prefix of up to
    ``slots`` resident prompts holding at most ``max_tokens`` tokens in all.

    Guarantee: exact and reuse-invariant — every log-prob is the target's teacher-forced one, computed
    in the canonical chunking, so a prompt's scores are bitwise those it gets scored alone, whatever was
    scored before or alongside. Thread-safe (one prompt at a time).
    """

    def __init__(self, target: Any, *, chunk: int = DEFAULT_CHUNK, max_tokens: int = DEFAULT_CACHE_TOKENS,
                 slots: int = 8) -> None:
        self.target = target
        self.chunk = check_int(chunk, "chunk", minimum=1)
        self.max_tokens = check_int(max_tokens, "max_tokens", minimum=0)
        self.slots = check_int(slots, "slots", minimum=1)
        self._residents: OrderedDict[int, _Resident] = OrderedDict()    # least recently used first
        self._next_key = 0
        self._lock = threading.Lock()
        self.forwarded_tokens = 0        # tokens fed to the target, in all
        self.reused_tokens = 0           # positions answered from a resident prompt, in all

    @property
    def resident_tokens(self) -> int:
        """Tokens held by the resident prompts (their sessions' caches)."""
        return sum(len(r.tokens) for r in self._residents.values())

    def score(self, tokens: Sequence[int], *, top: int = 0) -> PromptScores:
        """The exact log-probs of ``tokens`` (at least one) and, per position, its ``top`` likeliest tokens
        (0..20)."""
        ids = check_token_ids(tokens, self.target.vocab_size, name="prompt")
        if not ids:
            raise InputError("prompt is empty: echo needs at least one token")
        check_int(top, "top", minimum=0)
        if top > MAX_TOP:
            raise InputError(f"top must be at most {MAX_TOP}, got {top}")
        with self._lock:
            resident, resume = self._best_resident(ids)
            if resident is None:
                session, forwarded, done = self.target.start(ids[:1]), 1, 1
                logprobs, top_ids, top_values = [None], [np.zeros(0, np.int64)], [np.zeros(0)]
                pending = session.next_logprobs()          # the law of token 1
            else:
                # Positions up to the cut `resume` are the resident's (their tokens are shared); its session
                # rolls back to the cut and feeds on from there.
                session, forwarded, done = resident.session, 0, resume
                session.rollback(len(resident.tokens) - resume)
                logprobs = resident.logprobs[: resume + 1]
                top_ids, top_values = resident.top_ids[: resume + 1], resident.top_values[: resume + 1]
                pending = None
            while True:
                if pending is not None:                    # the law of token `done`
                    if done == len(ids):
                        break
                    self._note(pending, ids[done], logprobs, top_ids, top_values)
                end = min(len(ids), done + self.chunk)     # cuts at 1, 1 + chunk, ...: canonical
                rows = session.extend(ids[done:end])       # row j: the law of token done + j + 1
                forwarded += end - done
                for j in range(end - done - 1):
                    self._note(rows[j], ids[done + j + 1], logprobs, top_ids, top_values)
                done, pending = end, rows[-1]
            next_row = np.asarray(pending)
            self.forwarded_tokens += forwarded
            self.reused_tokens += len(ids) - forwarded
            self._keep(_Resident(ids, session, logprobs, top_ids, top_values, next_row))
        return PromptScores(tuple(ids), tuple(logprobs),
                            tuple(tuple((int(t), float(v)) for t, v in zip(i[:top], value[:top]))
                                  for i, value in zip(top_ids, top_values)),
                            next_row, forwarded)

    # ------------------------------------------------------------------------------------------ internals
    def _cut(self, shared: int) -> int:
        """The last chunk cut at or before position ``shared - 1`` (0: nothing reusable)."""
        usable = shared - 1
        return 0 if usable < 1 else 1 + ((usable - 1) // self.chunk) * self.chunk

    def _best_resident(self, ids: list[int]) -> tuple[_Resident | None, int]:
        best, best_cut = None, 0
        for key, resident in self._residents.items():
            shared = _common(resident.tokens, ids)
            cut = self._cut(shared)
            if cut > best_cut:
                best, best_cut = key, cut
        if best is None:
            return None, 0
        return self._residents.pop(best), best_cut

    def _note(self, row: np.ndarray, token: int, logprobs: list, top_ids: list, top_values: list) -> None:
        top = likeliest(row, MAX_TOP)
        logprobs.append(float(row[token]))
        top_ids.append(top)
        top_values.append(row[top])

    def _keep(self, resident: _Resident) -> None:
        if len(resident.tokens) > self.max_tokens:
            return                                    # larger than the whole cache: not kept
        self._residents[self._next_key] = resident
        self._next_key += 1
        while len(self._residents) > self.slots or self.resident_tokens > self.max_tokens:
            self._residents.popitem(last=False)


class ScoreJob:
    """A prompt waiting to be scored by an engine's worker (:meth:`Engine.score
    <speculum.serving.engine.Engine.score>`): :meth:`result` blocks for its :class:`PromptScores`;
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


def _common(first: Sequence[int], second: Sequence[int]) -> int:
    n = min(len(first), len(second))
    a, b = np.asarray(first[:n]), np.asarray(second[:n])
    differ = np.flatnonzero(a != b)
    return int(differ[0]) if len(differ) else n
