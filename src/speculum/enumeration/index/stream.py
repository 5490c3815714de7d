"""The exact index's items as a stream, in memory bounded by ``max_items`` instead of the whole index.

:func:`ranked_stream` yields the support's sequences in the exact order of
:class:`~speculum.enumeration.AutoregressiveEnumerable` (log-prob descending, ties by token ids), with the
same log-probs, by *cursor passes*. The cursor is the last item emitted; each pass walks the prefix tree
depth first from the root (batches of ``batch_size`` prefixes, one model call each; ``window`` batches a
step, sent together through ``map_calls`` so that a pool of replicas computes them at once) and keeps the
best ``max_items`` complete sequences strictly after the cursor. A prefix is pruned when its log-prob is below
the pass's floor or, once ``max_items`` candidates are held, below the worst of them (equal: when its tokens
come after the worst's): a step's log-prob is clipped to ``<= 0``, so no completion is more probable than
its prefix. A pass that ends holding ``max_items`` candidates emits exactly the next ``max_items`` items;
one that holds fewer emits every item left above its floor, and the next pass lowers the floor. Nothing of
the tree is kept between passes, so each pass re-walks every prefix above its floor: forwards for memory.

Log-probs are computed as the prefix tree computes them (``parent + min(step, 0)``: the float sum of the
steps in order from the root, from the rows the tree reads: dense ``next_logprobs``, or
``next_logprobs_above`` where the tree uses it), so the stream equals the index bitwise whenever the model's
rows do not depend on which prefixes share a batch. A backend whose rows move in the last bits between
batch compositions (batched float matmuls) gives log-probs equal up to those bits, and can order two items
differently only when their log-probs are that close.

Example:
    >>> from speculum.models import MarkovModel
    >>> from speculum.enumeration.index.support import Support
    >>> stream = ranked_stream(MarkovModel.random(4, seed=0), support=Support(max_len=3), max_items=5)
    >>> len(list(stream))
    64
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from ...models.base import capabilities_of, map_calls
from ...validation import InputError, check_int, check_optional_int
from .support import Support
from .tree import MAX_UNBOUNDED_DEPTH, loose_step_floor, checked_dense_rows, checked_sparse_rows

__all__ = ["ranked_stream", "StreamProgress", "DEFAULT_STREAM_ITEMS", "DEFAULT_STREAM_WINDOW"]

DEFAULT_STREAM_ITEMS = 100_000
# Batches forwarded a step: enough to keep a pool of up to four replicas busy (two calls queued on each).
DEFAULT_STREAM_WINDOW = 8
_LN2 = math.log(2.0)
# A bounded support's floor past this many bits (p < 2^-2000, below any float's reach) becomes -inf, so
# that the last pass walks the rest of the support however improbable (a finite masking logit, -1e9).
_UNBOUNDED_FLOOR_BITS = 2000.0

Item = tuple[tuple[int, ...], float]


@dataclass(frozen=True)
class StreamProgress:
    """One finished pass, reported to the ``progress`` callback."""

    passes: int           # passes finished
    emitted: int          # items emitted so far (those skipped before ``start`` included)
    forwards: int         # prefixes sent to the model so far, all passes
    floor_bits: float     # floor of the next pass in bits (-log2 p; inf: none, or the stream ended)


# Token sequences are rows of int32 matrices padded with -1 after their end: comparing two padded rows
# lexicographically is Python's tuple order (a sequence before its own extensions), the index's tie order.
def _pad(rows: np.ndarray, width: int) -> np.ndarray:
    if rows.shape[1] >= width:
        return rows
    out = np.full((len(rows), width), -1, dtype=np.int32)
    out[:, : rows.shape[1]] = rows
    return out


def _compare(rows: np.ndarray, key: np.ndarray) -> np.ndarray:
    """(k,) -1 / 0 / +1: each padded row before / equal to / after the padded ``key`` in token order."""
    width = max(rows.shape[1], len(key))
    rows, key = _pad(rows, width), _pad(key[None, :], width)[0]
    differs = rows != key
    first = differs.argmax(axis=1)
    return np.sign(rows[np.arange(len(rows)), first].astype(np.int64) - key[first]) * differs.any(axis=1)


def _order(tokens: np.ndarray, lps: np.ndarray) -> np.ndarray:
    """Indices in the exact order: log-prob descending, then tokens ascending."""
    return np.lexsort([*tokens.T[::-1], -lps])


class _Best:
    """The best ``size`` items strictly after ``cursor`` (``(padded tokens, log_prob)`` or None) with
    log-prob ``>= floor``, among those offered: at most ``size + slack`` held, plus one batch's.

    ``bound``: no item or prefix with a lower log-prob can be kept (the floor, or once ``size`` items are
    held the worst of them, whose tokens are then ``worst``: an equal log-prob is kept only before it)."""

    def __init__(self, size: int, floor: float, cursor: tuple[np.ndarray, float] | None) -> None:
        self.size, self.cursor = size, cursor
        # Selecting sorts what is held: once every ``slack`` insertions keeps it O(log n) an item.
        self.slack = max(size // 2, 1024)
        self.bound, self.worst = floor, None
        self.tokens: list[np.ndarray] = []
        self.lps: list[np.ndarray] = []
        self.held = 0

    @property
    def full(self) -> bool:
        return self.worst is not None

    def prunes(self, tokens: np.ndarray, lp: np.ndarray) -> np.ndarray:
        """(k,) whether no completion of each prefix (padded rows, log-probs) can be kept."""
        out = lp < self.bound
        tied = lp == self.bound
        if self.worst is not None and tied.any():
            out[tied] = _compare(tokens[tied], self.worst) > 0
        return out

    def offer(self, tokens: np.ndarray, lp: np.ndarray) -> None:
        """Offer complete sequences (padded rows) with their log-probs."""
        keep = lp >= self.bound
        if self.cursor is not None:
            keep &= lp <= self.cursor[1]
            tied = keep & (lp == self.cursor[1])
            if tied.any():
                keep[tied] = _compare(tokens[tied], self.cursor[0]) > 0
        if self.worst is not None:
            tied = keep & (lp == self.bound)
            if tied.any():
                keep[tied] = _compare(tokens[tied], self.worst) < 0
        if not keep.any():
            return
        self.tokens.append(tokens[keep])
        self.lps.append(lp[keep])
        self.held += int(keep.sum())
        if self.held >= self.size + (self.slack if self.full else 0):
            tokens, lps = self._sorted()
            # Copies: views would keep the whole sorted buffer alive.
            self.tokens, self.lps, self.held = [tokens[: self.size].copy()], [lps[: self.size].copy()], self.size
            self.bound, self.worst = float(lps[self.size - 1]), tokens[self.size - 1].copy()

    def _sorted(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.lps:
            return np.zeros((0, 0), dtype=np.int32), np.zeros(0)
        width = max(t.shape[1] for t in self.tokens)
        tokens = np.concatenate([_pad(t, width) for t in self.tokens])
        lps = np.concatenate(self.lps)
        order = _order(tokens, lps)
        return tokens[order], lps[order]

    def ordered(self) -> tuple[np.ndarray, np.ndarray, bool]:
        """The best ``size`` held items in exact order (padded tokens, log-probs), and whether any item after
        the cursor above the floor was left out."""
        tokens, lps = self._sorted()
        return tokens[: self.size].copy(), lps[: self.size].copy(), self.full or len(lps) > self.size


class _Frame:
    """Children of one batch awaiting expansion (``parents``: the batch's padded prefixes), ascending in
    log-prob: popped from the end, most probable first; once one is below the bound, all before it are."""

    __slots__ = ("parents", "length", "parent", "token", "logprob", "state", "end")

    def __init__(self, parents, length, parent, token, logprob, state) -> None:
        order = np.argsort(logprob, kind="stable")
        self.parents, self.length = parents, length
        self.parent, self.token, self.logprob = parent[order], token[order], logprob[order]
        self.state = None if state is None else state[order]
        self.end = len(order)

    def rows(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Padded token rows and lengths of the children ``idx``."""
        length = self.length[self.parent[idx]]
        rows = _pad(self.parents[self.parent[idx]], int(length.max()) + 1)     # a copy: fancy indexing
        rows[np.arange(len(idx)), length] = self.token[idx]
        return rows, length + 1


class _Walker:
    """One model and support: expands batches of prefixes as the prefix tree does, counting forwards."""

    def __init__(self, model, support: Support, prompt: Sequence[int], branch_cap: int | None,
                 batch_size: int, window: int) -> None:
        self.model, self.support, self.prompt = model, support, list(prompt)
        self.vocab_size = int(model.vocab_size)
        self.branch_cap = branch_cap if branch_cap is not None and branch_cap < self.vocab_size else None
        self.constrained = support.constraint is not None
        # The tree's choice of rows: sparse where declared, except under a cap, a constraint or forced eos.
        self.sparse = capabilities_of(model).sparse_rows and self.branch_cap is None and not self.constrained
        self.batch_size, self.window = batch_size, window
        self.forwards = 0

    def walk(self, best: _Best) -> bool:
        """One pass: offer every complete sequence the bound lets through to ``best``. Returns whether a
        positive-probability child was dropped below the bound (False: the whole support was walked)."""
        cut = False
        frames: list[_Frame] = []
        root = np.zeros(1, dtype=np.int32) if self.constrained else None
        batches = [(np.zeros((1, 0), dtype=np.int32), np.zeros(1, dtype=np.int64), np.zeros(1), root)]
        while batches:
            cut |= self._step(batches, best, frames)
            # Up to ``window`` batches are popped before any of them is expanded, so that one step's model
            # calls can run at once. This changes only the order in which the tree is walked: ``best``
            # keeps the best items of all those offered whatever the order, and its bound only rises, so
            # a prefix popped under a lower bound than the one it is expanded under is expanded or pruned
            # soundly (its children are tested against the bound of their expansion), at worst a few
            # forwards more.
            batches = []
            while len(batches) < self.window:
                batch = self._pop(frames, best)
                if batch is None:
                    break
                batches.append(batch)
        return cut

    def _pop(self, frames: list[_Frame], best: _Best):
        """Up to ``batch_size`` prefixes from the top of the stack that ``best`` does not prune, or None."""
        parts = []
        taken = 0
        while frames and taken < self.batch_size:
            frame = frames[-1]
            begin = max(0, frame.end - (self.batch_size - taken))
            idx = np.arange(frame.end - 1, begin - 1, -1)
            live = frame.logprob[idx] >= best.bound
            frame.end = begin if live.all() else 0      # ascending: all before a pruned entry are pruned
            if frame.end == 0:
                frames.pop()
            idx = idx[live]
            if len(idx):
                rows, length = frame.rows(idx)
                keep = ~best.prunes(rows, frame.logprob[idx])
                state = None if frame.state is None else frame.state[idx][keep]
                parts.append((rows[keep], length[keep], frame.logprob[idx][keep], state))
                taken += int(keep.sum())
        if not taken:
            return None
        width = max(p[0].shape[1] for p in parts)
        state = None if not self.constrained else np.concatenate([p[3] for p in parts])
        return (np.concatenate([_pad(p[0], width) for p in parts]), np.concatenate([p[1] for p in parts]),
                np.concatenate([p[2] for p in parts]), state)

    def _step(self, batches: list, best: _Best, frames: list[_Frame]) -> bool:
        """Forward ``batches`` (one ``map_calls`` per kind of row, so that a model serving calls in parallel
        runs them at once), then expand them in pop order. Returns whether a child fell below the bound."""
        plans = [self._plan(tokens, length, parent_lp, best.bound) for tokens, length, parent_lp, _ in batches]
        sparse_calls = [([prefixes[i] for i in np.flatnonzero(sparse)], step_floor[sparse])
                        for prefixes, _, step_floor, sparse in plans if sparse.any()]
        dense_calls = [([prefixes[i] for i in np.flatnonzero(~sparse)],)
                       for prefixes, _, _, sparse in plans if not sparse.all()]
        sparse_out = iter(map_calls(self.model, "next_logprobs_above", sparse_calls) if sparse_calls else ())
        dense_out = iter(map_calls(self.model, "next_logprobs", dense_calls) if dense_calls else ())
        cut = False
        for batch, plan in zip(batches, plans):
            sparse = plan[3]
            sparse_rows = next(sparse_out) if sparse.any() else None
            dense_rows = next(dense_out) if not sparse.all() else None
            cut |= self._expand(*batch, plan, sparse_rows, dense_rows, best, frames)
        return cut

    def _plan(self, tokens: np.ndarray, length: np.ndarray, parent_lp: np.ndarray, bound: float):
        """``(prefixes, forces_eos, step_floor, sparse)`` of one batch: its prompted prefixes, the rows
        where only eos may follow, the step floor of the sparse call (loose for ``bound``: a superset of
        the children a higher bound keeps) and which rows are read sparse, as the tree reads them."""
        prefixes = [self.prompt + row[:n] for row, n in zip(tokens.tolist(), length.tolist())]
        forces_eos = np.array([self.support.forces_eos(d) for d in length.tolist()], dtype=bool)
        step_floor = loose_step_floor(parent_lp, bound)
        sparse = ~forces_eos if self.sparse else np.zeros(len(prefixes), dtype=bool)
        return prefixes, forces_eos, step_floor, sparse

    def _children(self, plan, sparse_rows, dense_rows, parent_lp: np.ndarray, states: np.ndarray | None):
        """``(r, tok, lp, finite)``: candidate children (row, token, exact log-prob; a superset of those with
        ``lp >= bound`` for the plan's bound) and each row's count of positive-probability children, read
        from the model's answers to the plan's calls as the tree reads them."""
        prefixes, forces_eos, step_floor, sparse = plan
        n = len(prefixes)
        parts = []
        finite = np.zeros(n, dtype=np.int64)
        if sparse.any():
            at = np.flatnonzero(sparse)
            r, tok, step, finite[at] = checked_sparse_rows(sparse_rows)
            parts.append((at[r], tok, np.minimum(step, 0.0)))
        if not sparse.all():
            at = np.flatnonzero(~sparse)
            rows = checked_dense_rows(dense_rows, len(at), self.vocab_size)
            if self.constrained:
                # Tokens the constraint forbids are not children: -inf, exactly as zero-probability tokens.
                rows = self.support.allowed_with_mass(rows, states[at])[0]
            if self.branch_cap is not None:
                # The tree's top-m: a stable sort breaks equal log-probs by the lower token id.
                top = np.argsort(-rows, axis=1, kind="stable")[:, : self.branch_cap]
                capped = np.full_like(rows, -np.inf)
                np.put_along_axis(capped, top, np.take_along_axis(rows, top, axis=1), axis=1)
                rows = capped
            last = forces_eos[at]
            if last.any():
                # Only eos may end the last allowed position.
                only_eos = np.full((int(last.sum()), self.vocab_size), -np.inf)
                only_eos[:, self.support.eos] = rows[last, self.support.eos]
                rows[last] = only_eos
            finite_rows = np.isfinite(rows)
            r, tok = np.nonzero(finite_rows & (rows >= step_floor[at][:, None]))
            parts.append((at[r], tok, rows[r, tok]))
            finite[at] = finite_rows.sum(axis=1)
        self.forwards += n
        r, tok, step = (np.concatenate(p) for p in zip(*parts))
        return r, tok, parent_lp[r] + step, finite

    def _expand(self, tokens: np.ndarray, length: np.ndarray, parent_lp: np.ndarray,
                states: np.ndarray | None, plan, sparse_rows, dense_rows, best: _Best,
                frames: list[_Frame]) -> bool:
        """Read one forwarded batch of prefixes (padded rows); offer its complete children to ``best`` and
        push the others. Returns whether a positive-probability child fell below the bound."""
        r, tok, lp, finite = self._children(plan, sparse_rows, dense_rows, parent_lp, states)
        keep = (lp >= best.bound) & np.isfinite(lp)
        cut = bool((finite > np.bincount(r[keep], minlength=len(tokens))).any())
        r, tok, lp = r[keep], tok[keep], lp[keep]
        depth = length[r] + 1
        child_states = self.support.advance(states[r], tok) if self.constrained else None
        leaf = np.zeros(len(r), dtype=bool)
        grows = np.zeros(len(r), dtype=bool)
        for d in np.unique(depth).tolist():
            at = depth == d
            leaf[at] = self.support.is_complete(d, tok[at], None if child_states is None else child_states[at])
            grows[at] = self.support.expandable(d)
        grows &= ~leaf
        if grows.any() and int(depth[grows].max()) > MAX_UNBOUNDED_DEPTH:
            raise InputError(f"the stream passed depth {MAX_UNBOUNDED_DEPTH} without terminating; "
                             "pass max_len to cap the length of a terminating model")
        if leaf.any():
            rows = _pad(tokens[r[leaf]], int(depth[leaf].max()))     # a copy: fancy indexing
            rows[np.arange(len(rows)), length[r[leaf]]] = tok[leaf]
            best.offer(rows, lp[leaf])
        if grows.any():
            frames.append(_Frame(tokens, length, r[grows], tok[grows].astype(np.int32), lp[grows],
                                 None if child_states is None else child_states[grows]))
        return cut


def ranked_stream(model, *, support: Support, prompt: Sequence[int] = (), start: int = 0,
                  max_items: int = DEFAULT_STREAM_ITEMS, batch_size: int = 512, branch_cap: int | None = None,
                  window: int = DEFAULT_STREAM_WINDOW,
                  progress: Callable[[StreamProgress], None] | None = None) -> Iterator[Item]:
    """Yield ``(tokens, log_prob)`` for ranks ``start, start + 1, ...`` of ``support``'s sequences after
    ``prompt``: the exact order and log-probs of the index over the same model (see the module doc).

    Memory: at most ``1.5 * max_items`` candidate items (or ``max_items + 1024``) as arrays, plus the
    depth-first stack (each stacked batch's children: at most ``batch_size * vocab_size`` entries a level,
    ``window`` batches a step) and one step's rows (``window * batch_size * vocab_size`` dense), never the
    tree. Forwards: each pass re-walks every prefix above its floor, and about ``n / max_items``
    passes stream ``n`` items; items before ``start`` are walked as any others, only not yielded (skipping
    costs their passes). The stream ends when a pass walks the whole positive-probability support above
    its floor without dropping a child; an infinite support (``eos`` without ``max_len``) streams without
    end, each pass deeper and costlier. ``branch_cap``: the index's capped sub-support (the same top tokens
    of each row). ``window``: batches forwarded a step, in one ``map_calls``: a model serving calls in
    parallel (a pool of ``N`` replicas: choose ``window >= 2 * N``) computes them at once; one step's rows
    grow with it, and batches formed before the bound rises may walk a few prefixes more. It does not
    depend on the model, so the batches, hence the rows, are the same on a pool as on the local model.
    ``progress``: a callable receiving a :class:`StreamProgress` after each pass. Arguments are checked
    here, the model is first called on the first ``next``.
    """
    start = check_int(start, "start", minimum=0)
    max_items = check_int(max_items, "max_items", minimum=1)
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    window = check_int(window, "window", minimum=1)
    branch_cap = check_optional_int(branch_cap, "branch_cap", minimum=1)
    if progress is not None and not callable(progress):
        raise InputError("progress must be a callable receiving StreamProgress events, or None")
    return _passes(_Walker(model, support, prompt, branch_cap, batch_size, window), start, max_items, progress)


def _passes(walker: _Walker, start: int, max_items: int, progress) -> Iterator[Item]:
    support = walker.support
    bounded = support.max_len is not None or (support.constraint is not None
                                              and support.constraint.longest_path() is not None)
    # At most 2^w sequences have log2 p >= -w (their probabilities sum to <= 1): a narrower first floor
    # could not hold ``max_items`` of them.
    width = math.log2(max_items) + 1.0
    points: list[tuple[float, int]] = []     # (bits, number of items at least that probable), ascending
    cursor: tuple[np.ndarray, float] | None = None
    emitted = passes = 0
    while True:
        floor = _floor(width, bounded)
        best = _Best(max_items, floor, cursor)
        cut = walker.walk(best)
        tokens, lps, truncated = best.ordered()
        del best
        passes += 1
        if len(lps):
            cursor = (tokens[-1].copy(), float(lps[-1]))
            points.append((-cursor[1] / _LN2, emitted + len(lps)))     # up to ties with the cursor
        # Converted while yielded, a block at a time: the pass's items are held as arrays only.
        for begin in range(max(0, start - emitted), len(lps), 1024):
            block = tokens[begin: begin + 1024].tolist()
            for row, lp in zip(block, lps[begin: begin + 1024].tolist()):
                yield tuple(t for t in row if t >= 0), lp
        emitted += len(lps)
        del tokens, lps
        finished = not truncated and not cut
        if not truncated and math.isfinite(floor):
            points.append((width, emitted))                 # every item above the floor is emitted
        if not finished and math.isfinite(floor):
            del points[:-4]                                 # the rate needs the last two distinct ones
            width = _next_width(points, emitted + 2 * max_items)
        if progress is not None:
            progress(StreamProgress(passes=passes, emitted=emitted, forwards=walker.forwards,
                                    floor_bits=math.inf if finished else -_floor(width, bounded) / _LN2))
        if finished:
            return


def _next_width(points: list[tuple[float, int]], target: int) -> float:
    """Bits of a floor expected to hold about ``target`` items, extrapolating the count's growth.

    The count of items within ``b`` bits grows about exponentially in ``b``, at a rate that changes with
    depth: the rate is measured over the last two points (from the origin, 1 item at 0 bits, with one).
    An undershoot costs a whole pass and an overshoot only the walk until ``max_items`` candidates are
    held, so the caller's target exceeds what the next pass emits. Each step goes at least a quarter bit
    and at most doubles the bits, and never below ``log2(target)`` (fewer bits cannot hold that many)."""
    bits, count = points[-1]
    rate = math.log2(max(count, 2)) / max(bits, 1e-9)
    for past_bits, past_count in reversed(points[:-1]):
        if past_bits < bits and 0 < past_count < count:
            rate = math.log2(count / past_count) / (bits - past_bits)
            break
    step = math.log2(target / max(count, 1)) / max(rate, 1e-9)
    return max(math.log2(target), bits + min(max(step, 0.25), max(bits, 4.0)))


def _floor(width: float, bounded: bool) -> float:
    """The floor (natural log) of a pass ``width`` bits deep."""
    return -math.inf if bounded and width >= _UNBOUNDED_FLOOR_BITS else -width * _LN2
