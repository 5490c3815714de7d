"""Prompt log-probs for evaluators (OpenAI's ``echo``), with work shared across requests that share a
prefix and every answer bitwise identical to the request scored alone.

A prompt is teacher-forced in a canonical way that depends on its tokens only: in chunks of ``chunk``
tokens cut at fixed positions (0, chunk, 2 chunk, ...). The rows of a chunk are computed from the keys and
values of the tokens before it and the chunk's own tokens, so two prompts that share their first ``b``
tokens, ``b`` a cut position, compute identical rows there. :class:`PromptScorer` keeps a few recent
prompts resident (their session and each position's log-prob and likeliest alternatives, least recently
used evicted beyond ``max_tokens``); a new prompt resumes the resident one it shares the longest prefix
with, at the last cut inside that prefix, and feeds only the rest. The cut makes reuse exact: what it
returns is what scoring it alone returns, bit for bit, whatever was scored before (tested), at a cost of
at most ``chunk`` tokens of the shared prefix fed again.

:meth:`PromptScorer.score_many` scores several prompts together, as a tree: prompts that share a chunk
compute it once, and the chunks of one round (one per distinct prefix) go into one packed forward, where
the target offers forwards whose rows do not depend on what else they hold
(``Capabilities.invariant_extend``, :mod:`speculum.models.hf.forward.packed`); other targets score the
prompts one after another. Either way each prompt's answer is bitwise its answer alone.

Model work, beside the models it drives: the server's echo requests reach it through the engine's score
jobs (:class:`speculum.serving.jobs.ScoreJob`), whose rounds the engine interleaves with its generation
steps; evaluators and benchmarks call :meth:`PromptScorer.score` directly.

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
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..validation import InputError, check_int
from .base import capabilities_of, check_token_ids
from .interruption import Interrupted

__all__ = ["PromptScorer", "PromptScores", "likeliest", "likeliest_rows", "DEFAULT_CHUNK",
           "DEFAULT_CACHE_TOKENS", "MAX_TOP", "ROUND_TOKENS"]

DEFAULT_CHUNK = 32
DEFAULT_CACHE_TOKENS = 8192
MAX_TOP = 20            # alternatives kept per position (OpenAI's cap on logprobs)
ROUND_TOKENS = 512      # tokens a round of score() / score_many() feeds on a row-canonical target


@dataclass(frozen=True)
class PromptScores:
    """A prompt's exact teacher-forced log-probs.

    ``logprobs[i]``: log p(tokens[i] | tokens[:i]) (None for the first token, which has no context);
    ``top[i]``: the ``top`` likeliest tokens at position i as ``(token id, log-prob)``, likeliest first
    (ties by id; possible tokens only), from the same row, so a token that is the likeliest has bitwise its
    own log-prob there; ``next_logprobs``: (vocab,) the law of the token after the prompt; ``forwarded``:
    tokens fed to the target for this prompt alone (the rest came from a resident prompt, or from a forward
    shared with a prompt scored alongside)."""

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


def likeliest_rows(rows: np.ndarray, k: int) -> list[np.ndarray]:
    """:func:`likeliest` of each row of ``rows (n, width)`` float64, bitwise the same ids, found together.

    Why: one partition of a 49,152-wide row in NumPy costs more than the row's share of the forward's head;
    ``torch.topk`` over every row at once does not. Its ``k + 1`` largest values are exact: where the
    ``k``-th is above the next and finite, the set is unique and only its order (value, then id) is
    settled here; a row with a tie at the boundary or fewer than ``k`` possible tokens takes
    :func:`likeliest` itself."""
    n, width = rows.shape
    if n == 0 or k <= 0 or k >= width:
        return [likeliest(row, k) for row in rows]
    values, ids = torch.topk(torch.from_numpy(rows), k + 1, dim=1)              # largest first, ties anyhow
    clear = ((values[:, k - 1] > values[:, k]) & (values[:, k - 1] > -np.inf)).tolist()
    by_id = torch.argsort(ids[:, :k], dim=1)
    ids, values = ids[:, :k].gather(1, by_id), values[:, :k].gather(1, by_id)
    ids = ids.gather(1, torch.sort(values, dim=1, descending=True, stable=True).indices).numpy()
    return [ids[i] if clear[i] else likeliest(rows[i], k) for i in range(n)]


class _Resident:
    """A scored prompt kept for reuse: its session (positioned after all its tokens) and, per position, the
    log-prob of its token and the ``MAX_TOP`` likeliest ``(ids, log-probs)``."""

    def __init__(self, tokens: list[int], session: Any, logprobs: list, top_ids: list, top_values: list,
                 next_row: np.ndarray) -> None:
        self.tokens, self.session, self.next_row = tokens, session, next_row
        self.logprobs, self.top_ids, self.top_values = logprobs, top_ids, top_values


class _Work:
    """A prompt being scored: its session (None before its first forward), the tokens in it (``done``, a
    cut or the whole prompt), the row of the law of token ``done`` when not noted yet (``pending``) and the
    positions noted so far. ``top``: the alternatives its answer gives per position; ``resumed``: looked up
    among the residents (a work is resumed when it first takes part in a round); ``alone``: fed in forwards
    of its own."""

    def __init__(self, ids: list[int], top: int) -> None:
        self.ids, self.top = ids, top
        self.session: Any = None
        self.done = 0
        self.pending: np.ndarray | None = None
        self.logprobs: list = [None]
        self.top_ids: list = [np.zeros(0, np.int64)]
        self.top_values: list = [np.zeros(0)]
        self.forwarded = 0
        self.resumed = False
        self.alone = False

    def restart(self) -> None:
        """Back to its first token, to be fed in forwards of its own (after a packed round failed)."""
        self.__init__(self.ids, self.top)
        self.alone = True

    @property
    def finished(self) -> bool:
        return self.done == len(self.ids)


class PromptScorer:
    """Scores prompts for ``echo`` (see the module docstring), reusing the longest shared prefix of up to
    ``slots`` resident prompts holding at most ``max_tokens`` tokens in all.

    Two ways to use it: :meth:`score` / :meth:`score_many` score to the end in one call; :meth:`start`,
    :meth:`advance` and :meth:`drop` score in rounds of ``chunk`` tokens per prompt, or of a ``budget`` on a
    row-canonical target (an engine interleaves them with other work, sizes them by time, and stops a
    prompt nobody waits for between two rounds).

    Guarantee: exact and reuse-invariant — every log-prob is the target's teacher-forced one, computed
    in the canonical chunking, so a prompt's scores are bitwise those it gets scored alone, whatever was
    scored before or alongside, and however its rounds were interleaved. Thread-safe (one call at a time).
    """

    def __init__(self, target: Any, *, chunk: int = DEFAULT_CHUNK, max_tokens: int = DEFAULT_CACHE_TOKENS,
                 slots: int = 8) -> None:
        self.target = target
        self.chunk = check_int(chunk, "chunk", minimum=1)
        self.max_tokens = check_int(max_tokens, "max_tokens", minimum=0)
        self.slots = check_int(slots, "slots", minimum=1)
        # Packed rounds need forwards whose rows do not depend on the batch, and sessions that fork.
        self.packs = capabilities_of(target).invariant_extend
        # Rows that do not depend on how the tokens were fed: reuse and rounds need no fixed cuts.
        self.canonical = self.packs and capabilities_of(target).canonical_rows
        prepare = getattr(target, "prepare_packing", None)
        if self.packs and prepare is not None:
            prepare()                       # the packing check, before the first prompt rather than during it
        self._residents: OrderedDict[int, _Resident] = OrderedDict()    # least recently used first
        self._active: list[_Work] = []                                   # started, not finished nor dropped
        self._next_key = 0
        self._lock = threading.RLock()
        self.forwarded_tokens = 0        # tokens fed to the target, in all
        self.reused_tokens = 0           # positions answered from a resident or a shared forward, in all
        self.forwards = 0                # forwards (packed rounds count once)
        self.forward_seconds = 0.0       # seconds spent in the target's forwards, in all

    @property
    def resident_tokens(self) -> int:
        """Tokens held by the resident prompts (their sessions' caches)."""
        return sum(len(r.tokens) for r in self._residents.values())

    @property
    def busy(self) -> bool:
        """True while a started prompt is not scored to its end (nor dropped)."""
        return bool(self._active)

    def score(self, tokens: Sequence[int], *, top: int = 0) -> PromptScores:
        """The exact log-probs of ``tokens`` (at least one) and, per position, its ``top`` likeliest tokens
        (0..20)."""
        return self.score_many([tokens], top=[top])[0]

    def score_many(self, prompts: Sequence[Sequence[int]], *, top: Sequence[int] | int = 0) -> list[PromptScores]:
        """:meth:`score` of each of ``prompts`` (``top``: one count for all, or one per prompt), sharing the
        chunks they have in common and packing each round's chunks into one forward where the target allows
        (see the module docstring). Each answer is bitwise the prompt's :meth:`score` alone."""
        tops = [top] * len(prompts) if isinstance(top, int) else list(top)
        if len(tops) != len(prompts):
            raise InputError(f"{len(prompts)} prompts but {len(tops)} top counts")
        names = [f"prompts[{i}]" if len(prompts) > 1 else "prompt" for i in range(len(prompts))]
        works = [_checked(tokens, count, self.target.vocab_size, name)
                 for tokens, count, name in zip(prompts, tops, names)]
        with self._lock:
            self._active += works
            while not all(work.finished for work in works):
                _, failed = self.advance(ROUND_TOKENS * len(works) if self.canonical else None)
                if failed:
                    for work in works:
                        self.drop(work)
                    raise failed[0][1]
        return [self.scores(work) for work in works]

    def start(self, tokens: Sequence[int], *, top: int = 0) -> _Work:
        """Queue ``tokens`` for scoring by :meth:`advance` (checked here); its answer is :meth:`scores` once
        ``finished``."""
        work = _checked(tokens, top, self.target.vocab_size, "prompt")
        with self._lock:
            self._active.append(work)
        return work

    def drop(self, work: _Work) -> None:
        """Stop scoring ``work`` (its forwards so far are lost; nothing of it is kept)."""
        with self._lock:
            if work in self._active:
                self._active.remove(work)

    def advance(self, budget: int | None = None, *, round_cost: int = 0
                ) -> tuple[list[_Work], list[tuple[_Work, BaseException]]]:
        """One round: every started prompt (one at a time, in order, for a target that does not pack)
        fed its next chunk, in one packed forward where the target packs. On a row-canonical target a
        ``budget`` instead feeds the prompts ``budget`` tokens in all (an equal share each, a prompt
        needing less leaving the rest to the others; at least one each), stopping where prompts in the same
        state part when what they share then saves more tokens than ``round_cost`` (a round's fixed cost,
        in tokens: stopping costs one more round). Returns the prompts it finished and those it failed with
        the error: a failing packed round starts its prompts again, each in forwards of its own from then
        on, so that a prompt the model fails on fails alone. A round whose forward its caller stopped
        (:class:`~speculum.models.interruption.Interrupted`, under the target's ``interruptible``) raises
        it and changes nothing: a later round feeds the same tokens again."""
        if budget is not None:
            check_int(budget, "budget", minimum=1)
        check_int(round_cost, "round_cost", minimum=0)
        with self._lock:
            alone = next((work for work in self._active if work.alone), None)
            group = [alone] if alone is not None else self._active if self.packs else self._active[:1]
            group = list(group)
            failed: list[tuple[_Work, BaseException]] = []
            for work in group:
                if not work.resumed:
                    self._resume(work)
            try:
                if group:
                    self._round(group, budget, round_cost)
            except Interrupted:
                raise                 # the caller asked for it: the prompts are where the round found them
            except Exception as exc:  # noqa: BLE001  (the prompt's own failure goes to its client)
                if len(group) == 1:
                    failed.append((group[0], exc))
                for work in group if len(group) > 1 else ():
                    work.restart()
            lost = {id(work) for work, _ in failed}
            finished = [work for work in group if work.finished]
            self._active = [work for work in self._active if not work.finished and id(work) not in lost]
            return finished, failed

    @staticmethod
    def scores(work: _Work) -> PromptScores:
        """The answer of a finished ``work``, with its ``top`` alternatives per position."""
        count = work.top
        return PromptScores(tuple(work.ids), tuple(work.logprobs),
                            tuple(tuple((int(t), float(v)) for t, v in zip(i[:count], value[:count]))
                                  for i, value in zip(work.top_ids, work.top_values)),
                            np.asarray(work.pending), work.forwarded)

    # ------------------------------------------------------------------------------------------ internals
    def _cut(self, shared: int) -> int:
        """Where a prompt sharing ``shared`` tokens with a resident one resumes: the last chunk cut at or
        before position ``shared - 1`` (0: nothing reusable); on a row-canonical target ``shared - 1`` itself
        (the row after the shared tokens, which the resident does not keep whole, is computed again)."""
        if self.canonical:
            return max(0, shared - 1)
        return max(0, (shared - 1) // self.chunk * self.chunk)

    def _ends(self, active: list[_Work], budget: int | None, round_cost: int = 0) -> list[int]:
        """Where each of ``active`` stops this round: its next chunk cut; on a row-canonical target with a
        ``budget``, its share of it (:func:`_shares`), cut back to where it parts from prompts in the same
        state when feeding their common tokens once saves more than ``round_cost`` tokens."""
        if budget is None or not self.canonical:
            return [min(len(work.ids), (work.done // self.chunk + 1) * self.chunk) for work in active]
        ends = [work.done + share for work, share in zip(active, _shares([len(w.ids) - w.done for w in active],
                                                                          budget))]
        states: dict[tuple[int, ...], list[int]] = {}
        for i, work in enumerate(active):
            states.setdefault((work.done, *work.ids[:work.done]), []).append(i)
        for members in states.values():
            for i in members:
                done = active[i].done
                partners = [_common(active[i].ids, active[j].ids) for j in members if j != i]
                # The first parting whose common tokens, fed once for every member still along, save more
                # than the round that stopping there costs (with no cost: the first parting, each token once).
                for common in sorted({c for c in partners if c > done}):
                    sharing = sum(1 for c in partners if c >= common)
                    if sharing * (min(common, ends[i]) - done) > round_cost:
                        ends[i] = min(ends[i], common)
                        break
        return ends
    def _resume(self, work: _Work) -> None:
        """Start ``work`` at the longest cut it shares with a resident prompt (on a fork of its session when
        sessions fork, else on the session itself, taken out of the cache and rolled back)."""
        work.resumed = True
        best, best_cut = None, 0
        for key, resident in self._residents.items():
            cut = self._cut(_common(resident.tokens, work.ids))
            if cut > best_cut:
                best, best_cut = key, cut
        if best is None:
            return
        if self.packs:
            resident = self._residents[best]
            self._residents.move_to_end(best)
            session = resident.session.fork()
        else:
            resident = self._residents.pop(best)
            session = resident.session
        session.rollback(len(resident.tokens) - best_cut)
        work.session, work.done = session, best_cut
        work.logprobs = resident.logprobs[: best_cut + 1]
        work.top_ids, work.top_values = resident.top_ids[: best_cut + 1], resident.top_values[: best_cut + 1]

    def _round(self, active: list[_Work], budget: int | None, round_cost: int = 0) -> None:
        """Feed each of ``active`` its next tokens (:meth:`_ends`): one forward of every distinct segment
        (works at the same point whose prompts agree up to its end share it and its session)."""
        rounds: dict[tuple[int, ...], list[_Work]] = {}
        for work, end in zip(active, self._ends(active, budget, round_cost)):
            rounds.setdefault((work.done, *work.ids[:end]), []).append(work)
        taken: set[int] = set()
        feeds = []
        for key, members in rounds.items():
            lead = members[0]
            session = lead.session
            if session is not None and id(session) in taken:
                session = session.fork()         # another segment continues the same prefix this round
            taken.add(id(session))
            feeds.append((members, session, lead.done, len(key) - 1))
        for (members, _, done, end), (session, rows) in zip(feeds, self._forward(feeds)):
            self._advance(members, session, rows, done, end)
        for work in active:
            if work.finished:
                self._keep(work)

    def _forward(self, feeds: list) -> list[tuple[Any, np.ndarray]]:
        """``(session, rows)`` per ``(members, session, done, end)``: rows j = the law of token done + j + 1
        of the members' prompt, the session extended to ``end``; one packed forward when the target packs."""
        started = time.perf_counter()
        try:
            return self._forward_timed(feeds)
        finally:
            self.forward_seconds += time.perf_counter() - started

    def _forward_timed(self, feeds: list) -> list[tuple[Any, np.ndarray]]:
        self.forwards += 1 if self.packs else len(feeds)
        if self.packs:
            sessions, reads = [], []
            for members, session, done, end in feeds:
                ids = members[0].ids
                if session is None:
                    sessions.append(self.target.start_deferred(ids[:end]))
                    reads.append([])
                else:
                    sessions.append(session)
                    reads.append(ids[done:end])
            return list(zip(sessions, self.target.extend_rows(sessions, reads)))
        out = []
        for members, session, done, end in feeds:
            ids = members[0].ids
            if session is None:
                session = self.target.start(ids[:1])
                rows = np.vstack([np.asarray(session.next_logprobs())[None], *(
                    [np.asarray(session.extend(ids[1:end]))] if end > 1 else [])])
            else:
                rows = np.asarray(session.extend(ids[done:end]))
            out.append((session, rows))
        return out

    def _advance(self, members: list[_Work], session: Any, rows: np.ndarray, done: int, end: int) -> None:
        """Note the positions ``done..end - 1`` the round computed for ``members`` (the same tokens there)."""
        lead = members[0]
        logprobs, top_ids, top_values = _notes(rows[:end - done - 1], lead.ids[done + 1:end])
        lead.forwarded += end - done
        self.forwarded_tokens += end - done
        for work in members:
            if work.pending is not None:            # the law of token `done`, from the work's previous round
                noted = _notes(work.pending[None], work.ids[done:done + 1])
                work.logprobs, work.top_ids, work.top_values = (work.logprobs + noted[0], work.top_ids + noted[1],
                                                                work.top_values + noted[2])
            # A copy: the round's rows (up to chunk x vocab floats per prompt) need not outlive it.
            work.session, work.done, work.pending = session, end, np.array(rows[end - done - 1])
            work.logprobs = work.logprobs + logprobs
            work.top_ids, work.top_values = work.top_ids + top_ids, work.top_values + top_values

    def _keep(self, work: _Work) -> None:
        self.reused_tokens += len(work.ids) - work.forwarded
        if len(work.ids) > self.max_tokens:
            return                                    # larger than the whole cache: not kept
        session = work.session.fork() if self.packs else work.session   # others may extend the same session
        self._residents[self._next_key] = _Resident(work.ids, session, work.logprobs, work.top_ids,
                                                    work.top_values, work.pending)
        self._next_key += 1
        while len(self._residents) > self.slots or self.resident_tokens > self.max_tokens:
            self._residents.popitem(last=False)


def _checked(tokens: Sequence[int], top: int, vocab_size: int, name: str) -> _Work:
    """A work for ``tokens`` with ``top`` alternatives, both checked where they enter."""
    ids = check_token_ids(tokens, vocab_size, name=name)
    if not ids:
        raise InputError("prompt is empty: echo needs at least one token")
    check_int(top, "top", minimum=0)
    if top > MAX_TOP:
        raise InputError(f"top must be at most {MAX_TOP}, got {top}")
    return _Work(ids, top)


def _notes(rows: np.ndarray, tokens: Sequence[int]) -> tuple[list, list, list]:
    """Per row of ``rows (n, vocab)``: the log-prob of its token in ``tokens``, and the ``MAX_TOP``
    likeliest ids with their log-probs (the values of the same row, bitwise)."""
    if not len(tokens):
        return [], [], []
    tops = likeliest_rows(rows, MAX_TOP)
    values = rows[np.arange(len(tokens)), np.asarray(tokens)].tolist()
    return values, tops, [row[top] for row, top in zip(rows, tops)]


def _shares(needs: Sequence[int], budget: int) -> list[int]:
    """Tokens each prompt is fed from ``budget``: an equal share each, at most what it ``needs``, what one
    needs less going to the others (water-filling); at least one each."""
    shares = [0] * len(needs)
    left, open_ = budget, sorted(range(len(needs)), key=lambda i: needs[i])
    while open_:
        share = max(1, left // len(open_))
        i = open_[0]
        if needs[i] <= share:               # the smallest need fits a share: it takes it all
            shares[i] = needs[i]
            left -= needs[i]
            open_.pop(0)
            continue
        for i in open_:
            shares[i] = min(needs[i], share)
        break
    return shares


def _common(first: Sequence[int], second: Sequence[int]) -> int:
    n = min(len(first), len(second))
    a, b = np.asarray(first[:n]), np.asarray(second[:n])
    differ = np.flatnonzero(a != b)
    return int(differ[0]) if len(differ) else n
