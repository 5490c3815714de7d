"""The live prefix tree of a model's continuations, built level by level with batched forwards.

A prefix is *live* under a log-probability budget ``b`` when its exact log-probability is ``>= b``; since
every step's log-prob is ``<= 0``, every prefix of a sequence with ``log p >= b`` is live, so expanding the
live prefixes (one forward each) finds *every* sequence within the budget — the forward count is the number
of live prefixes, independent of any rank asked.

The tree is built breadth first, so that batching does the work: each level's prefixes go to
``model.next_logprobs`` in chunks of ``batch_size`` (a backend with a KV cache shares the prompt across the
batch), no Python recursion runs per token, and each expanded prefix keeps only the children it needs —
token ids and exact cumulative log-probs down to ``budget - reserve``, never a vocabulary row. A model that
declares ``Capabilities(sparse_rows=True)`` offers ``next_logprobs_above(prefixes, min_logprobs) -> (row,
token, logprob, finite)`` (every entry of ``next_logprobs`` at or above a per-prefix floor, with the same
values, and each row's count of finite entries; ``HFModel`` does): the tree then never materialises a
``(batch, vocab)`` float64 array. Without it, or under ``branch_cap`` / the last eos position, the dense
rows are used; both paths store the same children. Which sequences exist is the :class:`Support`'s to say.
Deepening (``extend``) continues the same tree: children already stored are reused, unexpanded prefixes
are forwarded once, and a prefix is forwarded again only if the new budget goes below the ``reserve`` it
stored children for (counted in ``reforwards``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ...models.base import capabilities_of, map_calls
from ...validation import InputError
from .support import Support

__all__ = ["BuildProgress", "Level", "PrefixTree", "IndexBudgetError", "ForwardBudgetError", "DEFAULT_MAX_NODES"]

# Default node budget of one index: ~60 bytes a node at the peak of a build, so about 1.2 GB.
DEFAULT_MAX_NODES = 20_000_000

_LN2 = math.log(2.0)
# Terminating models without ``max_len`` are bounded by the budget alone; a model that can loop with
# probability 1 (a step of log-prob exactly 0 forever) would never stop, so a generous depth guard remains.
MAX_UNBOUNDED_DEPTH = 100_000


class IndexBudgetError(MemoryError):
    """A build would store more prefix-tree nodes than its ``max_nodes`` budget allows."""


class ForwardBudgetError(InputError):
    """A build would forward more prefixes than its ``max_forwards`` allows; raised before any of them is
    forwarded. ``limit``: that budget; ``needed``: the forwards in all that going on would have reached."""

    def __init__(self, limit: int, needed: int) -> None:
        super().__init__(f"the enumeration index needs more than {limit:,} forwarded prefixes (at least "
                         f"{needed:,}), its max_forwards; raise max_forwards or ask for less")
        self.limit, self.needed = limit, needed


@dataclass(frozen=True)
class BuildProgress:
    """One expanded chunk of prefixes, reported to the ``progress`` callback."""

    level: int            # length of the prefixes just expanded (0 = the prompt itself)
    expanded: int         # prefixes expanded in this chunk
    pending: int          # prefixes still to expand at this level in this pass
    forwards: int         # total prefixes forwarded so far (all passes)
    budget_bits: float    # the budget being built to, in bits of information (-log2 p)


class Level:
    """Flat, append-only arrays of the prefixes of one length (index ``i`` = one prefix).

    The arrays live in buffers that grow geometrically, so appending a level's children chunk by chunk costs
    amortised constant time per child (re-concatenating on every chunk made large builds quadratic); the
    attributes are views of the first ``len(self)`` entries and can be assigned in place.
    """

    # name -> (dtype, fill of a new entry); the last three only for expandable levels.
    _FIELDS = {"parent": (np.int32, 0), "token": (np.int32, 0), "logprob": (np.float64, 0.0),
               "leaf": (bool, False), "state": (np.int32, 0), "floor": (np.float64, np.inf),
               "truncated": (bool, False), "capped_mass": (np.float64, 0.0), "child_mass": (np.float64, 0.0)}
    _EXPANSION = ("floor", "truncated", "capped_mass", "child_mass")
    _CONSTRAINED = ("state", "child_mass")

    def __init__(self, expandable: bool = True, constrained: bool = False) -> None:
        # A level of complete sequences only (the last level of fixed-length continuations) never expands:
        # it keeps no floor / truncated / capped_mass arrays (a third less memory per leaf).
        # parent: index into the previous level; token: last token; logprob: exact log p(prefix | prompt);
        # leaf: a complete sequence of the support. Children of prefix i are stored down to
        # floor[i] (+inf: not expanded yet); truncated[i]: some positive-probability child lies below that
        # floor and was not stored; capped_mass[i]: probability of children dropped by branch_cap.
        # Only under a constraint: state, the automaton's state after the prefix; child_mass, the probability
        # of all the children the constraint allows (stored or not) of an expanded prefix.
        self.expandable = expandable
        self._size = 0
        self._buffers = {name: np.zeros(0, dtype=dtype) for name, (dtype, _) in self._FIELDS.items()
                         if (expandable or name not in self._EXPANSION) and (constrained or name not in self._CONSTRAINED)}

    def __len__(self) -> int:
        return self._size

    def __getattr__(self, name: str) -> np.ndarray:
        buffers = self.__dict__.get("_buffers")
        if buffers is not None and name in buffers:
            return buffers[name][: self._size]
        if name in self._EXPANSION:
            return np.zeros(0, dtype=self._FIELDS[name][0])      # a leaf-only level has none
        raise AttributeError(name)

    def append(self, parent: np.ndarray, token: np.ndarray, logprob: np.ndarray, leaf: np.ndarray,
               state: np.ndarray | None = None) -> None:
        n = len(token)
        size = self._size + n
        capacity = len(self._buffers["token"])
        if size > capacity:
            capacity = max(size, 2 * capacity, 64)
            for name, buffer in self._buffers.items():
                grown = np.empty(capacity, dtype=buffer.dtype)
                grown[: self._size] = buffer[: self._size]
                self._buffers[name] = grown
        new = slice(self._size, size)
        values = {"parent": parent, "token": token, "logprob": logprob, "leaf": leaf, "state": state}
        for name, buffer in self._buffers.items():
            value = values.get(name)
            buffer[new] = value if value is not None else self._FIELDS[name][1]
        self._size = size

    def capped_mass_above(self, min_log_prob: float) -> float:
        """Probability dropped by branch_cap below prefixes of this level with log p >= min_log_prob."""
        if not self.expandable:
            return 0.0
        return float(self.capped_mass[self.logprob >= min_log_prob].sum())

    def compact(self) -> None:
        """Release the buffers' spare capacity (after a build step: the level may not grow for a while)."""
        if len(self._buffers["token"]) > self._size:
            self._buffers = {name: buffer[: self._size].copy() for name, buffer in self._buffers.items()}

    def nbytes(self) -> int:
        """Bytes held by this level's buffers (spare capacity included)."""
        return sum(buffer.nbytes for buffer in self._buffers.values())


class PrefixTree:
    """Live prefix tree of the continuations of ``prompt`` in ``support``.

    Guarantee (exact): after ``extend(b)``, every support sequence with ``log p >= b`` is a stored leaf with
    its exact log-probability (the float sum of its steps, in order), except below prefixes dropped by
    ``branch_cap`` (their total probability is in ``capped_mass``).
    """

    def __init__(self, model, *, prompt: Sequence[int], support: Support,
                 branch_cap: int | None, batch_size: int, reserve_bits: float,
                 max_nodes: int = DEFAULT_MAX_NODES,
                 progress: Callable[[BuildProgress], None] | None = None) -> None:
        self.model = model
        self.vocab_size = int(model.vocab_size)
        self.prompt = tuple(prompt)
        self.support = support
        self.sparse_rows = capabilities_of(model).sparse_rows     # next_logprobs_above is offered
        self.branch_cap = branch_cap
        self.batch_size = batch_size
        self.reserve = reserve_bits * _LN2          # in nats
        self.progress = progress
        self.max_nodes = max_nodes                  # refuse to store more nodes than this (IndexBudgetError)
        self.max_forwards: int | None = None        # refuse to forward more prefixes than this (ForwardBudgetError)
        self.forwards = 0                           # prefixes sent to next_logprobs, all passes
        self.reforwards = 0                         # of which: prefixes forwarded a second time
        self.length_truncated = False               # eos support: max_len cut a positive-probability prefix
        self.budget = math.inf                      # every sequence with log p >= budget is stored
        self.constrained = support.constraint is not None
        root = Level(constrained=self.constrained)
        root.append(np.array([-1]), np.array([-1]), np.array([0.0]), np.array([False]), np.array([0]))
        self.levels: list[Level] = [root]

    # ------------------------------------------------------------------------------------------ state
    @property
    def exhausted(self) -> bool:
        """True when no expandable prefix remains: the whole (capped) support is stored."""
        return not any(self._pending(d, -math.inf).any() for d in range(len(self.levels)))

    @property
    def capped_mass(self) -> float:
        """Total probability below prefixes dropped by ``branch_cap`` (an upper bound, rounding included)."""
        total = math.fsum(level.capped_mass_above(-math.inf) for level in self.levels)
        return total * (1.0 + 1e-12)

    def nbytes(self) -> int:
        return sum(level.nbytes() for level in self.levels)

    def unseen_mass(self) -> float:
        """An upper bound on the probability of the support sequences not stored as leaves (constrained
        trees only: they record each expanded prefix's allowed child mass). Certified: every such sequence
        passes through a stored prefix that is not expanded, or through an allowed child an expanded prefix
        did not store; both masses are counted, rounding made generous."""
        if not self.constrained:
            raise InputError("unseen_mass needs a constrained tree")
        total = 0.0
        for depth, level in enumerate(self.levels):
            if not level.expandable or not self.support.expandable(depth):
                continue
            open_ = ~level.leaf & np.isfinite(level.logprob)
            unexpanded = open_ & np.isposinf(level.floor)
            total += math.fsum(np.exp(level.logprob[unexpanded]).tolist())
            expanded = np.flatnonzero(open_ & ~np.isposinf(level.floor))
            if len(expanded) and depth + 1 < len(self.levels):
                children = self.levels[depth + 1]
                stored = np.bincount(children.parent, weights=np.exp(children.logprob), minlength=len(level))
                total += math.fsum(np.maximum(level.child_mass[expanded] * (1.0 + 1e-9) - stored[expanded], 0.0).tolist())
            elif len(expanded):
                total += math.fsum(level.child_mass[expanded].tolist())
        return total * (1.0 + 1e-9) + 1e-300

    def _pending(self, depth: int, budget: float) -> np.ndarray:
        """(n,) bool: prefixes of this length that need a forward to store every child with log p >= budget."""
        level = self.levels[depth]
        if not self.support.expandable(depth):
            return np.zeros(len(level), dtype=bool)
        needs = ~level.leaf & (level.logprob >= budget) & np.isfinite(level.logprob)
        return needs & (np.isposinf(level.floor) | (level.truncated & (level.floor > budget)))

    # ---------------------------------------------------------------------------------------- building
    def extend(self, budget: float, *, expected: float | None = None) -> None:
        """Store every support sequence with ``log p >= budget`` (natural log), reusing what is built.

        Deterministic in the model's rows; forwards only prefixes that are live and not yet expanded deep
        enough. ``budget=-inf`` builds the whole support (finite for fixed length or a length cap).
        ``expected`` (<= budget): a budget the caller expects to deepen to next; the prefixes forwarded now
        keep their children down to it, so that deepening forwards none of them again.
        """
        if budget >= self.budget:
            return
        # Keep children a little past the budget — half as far as this deepening went (later deepenings of
        # a query are smaller corrections), between ``reserve`` and twice it — so that the next deepening
        # rarely forwards a prefix again, while memory stays within a small factor of the certified set.
        step = self.budget - budget if math.isfinite(self.budget) and math.isfinite(budget) else 0.0
        floor = budget - min(max(self.reserve, 0.5 * step), 2.0 * self.reserve)
        if expected is not None and expected < floor:
            floor = expected
        depth = 0
        while depth < len(self.levels):
            if depth > MAX_UNBOUNDED_DEPTH:
                raise InputError(f"the prefix tree passed depth {MAX_UNBOUNDED_DEPTH} without terminating; "
                                 "pass max_len to cap the length of a terminating model")
            todo = np.flatnonzero(self._pending(depth, budget))
            # The whole level is checked before its first forward: the budget is never passed, not even by a batch.
            if self.max_forwards is not None and self.forwards + len(todo) > self.max_forwards:
                raise ForwardBudgetError(self.max_forwards, self.forwards + len(todo))
            chunks = [todo[start:start + self.batch_size] for start in range(0, len(todo), self.batch_size)]
            # A model serving several batched calls at once (a pool of replicas) gets a window of this level's
            # chunks together; children are still stored chunk by chunk in order, so the tree is the same.
            # Sparse entries are small, so a sparse level goes out whole (no wait between windows); dense rows
            # are (batch, vocab) float64 each, so at most ``parallel_calls`` of them are in flight.
            parallel = capabilities_of(self.model).parallel_calls
            window = max(1, len(chunks) if parallel > 1 and self._sparse_level(depth) else parallel)
            done = 0
            for first in range(0, len(chunks), window):
                group = chunks[first:first + window]
                for nodes, rows in zip(group, self._rows(depth, group, floor)):
                    self._expand(depth, nodes, floor, rows)
                    done += len(nodes)
                    if self.progress is not None:
                        self.progress(BuildProgress(level=depth, expanded=len(nodes), pending=len(todo) - done,
                                                    forwards=self.forwards, budget_bits=-budget / _LN2))
            depth += 1
        for level in self.levels:
            level.compact()
        self.budget = budget

    def _prefixes(self, depth: int, nodes: np.ndarray) -> list[list[int]]:
        """Full prefixes (prompt + continuation) of the given prefixes of length ``depth``."""
        columns = np.empty((len(nodes), depth), dtype=np.int64)
        idx = nodes
        for d in range(depth, 0, -1):
            level = self.levels[d]
            columns[:, d - 1] = level.token[idx]
            idx = level.parent[idx]
        prompt = list(self.prompt)
        return [prompt + row for row in columns.tolist()]

    def _sparse_level(self, depth: int) -> bool:
        """Whether this level is expanded through ``next_logprobs_above`` (no dense rows needed)."""
        capped = self.branch_cap is not None and self.branch_cap < self.vocab_size
        return self.sparse_rows and not capped and not self.support.forces_eos(depth) and not self.constrained

    def _rows(self, depth: int, chunks: list[np.ndarray], floor: float) -> list:
        """The model's rows for each chunk of prefixes of length ``depth``: dense ``next_logprobs`` rows, or
        ``next_logprobs_above``'s sparse entries down to the loose step floor (one batched call per chunk)."""
        prefixes = [self._prefixes(depth, nodes) for nodes in chunks]
        if self._sparse_level(depth):
            logprob = self.levels[depth].logprob
            calls = [(p, loose_step_floor(logprob[nodes], floor)) for p, nodes in zip(prefixes, chunks)]
            return map_calls(self.model, "next_logprobs_above", calls)
        return map_calls(self.model, "next_logprobs", [(p,) for p in prefixes])

    def _expand(self, depth: int, nodes: np.ndarray, floor: float, rows) -> None:
        """Store the new children of ``nodes`` (prefixes of length ``depth``) from their ``rows``."""
        level = self.levels[depth]
        parent_lp = level.logprob[nodes]                   # (c,)
        capped = self.branch_cap is not None and self.branch_cap < self.vocab_size
        last_eos = self.support.forces_eos(depth)
        if self._sparse_level(depth):
            self._expand_sparse(depth, nodes, floor, rows)
            return
        rows = checked_dense_rows(rows, len(nodes), self.vocab_size)
        if self.constrained:
            # Tokens the constraint forbids are not children: -inf, exactly as zero-probability tokens.
            rows, allowed_log_mass = self.support.allowed_with_mass(rows, level.state[nodes])
        self.forwards += len(nodes)
        first = np.isposinf(level.floor[nodes])
        self.reforwards += int((~first).sum())

        if capped:
            # Top-m tokens per row; stable sort breaks equal log-probs by the lower token id.
            allowed = np.argsort(-rows, axis=1, kind="stable")[:, : self.branch_cap]   # (c, m)
            dropped = np.exp(rows)
            np.put_along_axis(dropped, allowed, 0.0, axis=1)
            level.capped_mass[nodes[first]] = np.exp(parent_lp[first]) * dropped[first].sum(axis=1)
        else:
            allowed = None
        if last_eos:
            # Only eos may end the last allowed position: longer prefixes are outside the support.
            eos = self.support.eos
            only_eos = np.full((len(nodes), 1), eos, dtype=np.int64)
            if allowed is not None:
                cut = (allowed != eos) & np.isfinite(np.take_along_axis(rows, allowed, axis=1))
                keep_eos = (allowed == eos).any(axis=1, keepdims=True)
                self.length_truncated |= bool(cut.any())
                allowed = np.where(keep_eos, only_eos, -1)
            else:
                others = np.isfinite(rows).sum(axis=1) - np.isfinite(rows[:, eos])
                self.length_truncated |= bool((others > 0).any())
                allowed = only_eos

        if self.constrained:
            if allowed is None:
                level.child_mass[nodes] = np.exp(parent_lp + allowed_log_mass)
            else:
                kept = np.where(allowed >= 0, np.take_along_axis(rows, np.maximum(allowed, 0), axis=1), -np.inf)
                level.child_mass[nodes] = np.exp(parent_lp + _logsumexp_rows(kept)) + level.capped_mass[nodes]
        if allowed is None:
            # Pre-select loosely on the rows (no (c, V) temporaries), then apply the exact tests on candidates.
            finite_rows = np.isfinite(rows)
            r, tok = np.nonzero(finite_rows & (rows >= loose_step_floor(parent_lp, floor)[:, None]))
            self._store_children(depth, nodes, first, floor, r, tok, rows[r, tok], finite_rows.sum(axis=1))
            return
        valid = allowed >= 0
        step = np.where(valid, np.take_along_axis(rows, np.maximum(allowed, 0), axis=1), -np.inf)
        full_lp = parent_lp[:, None] + step                               # (c, m)
        finite = np.isfinite(full_lp)
        truncated = (finite & (full_lp < floor)).any(axis=1)
        r, c = np.nonzero(finite & (full_lp >= floor))
        tok, child_lp = allowed[r, c], full_lp[r, c]
        self._append_children(depth, nodes, first, floor, truncated, r, tok.astype(np.int64), child_lp)

    def _expand_sparse(self, depth: int, nodes: np.ndarray, floor: float, sparse) -> None:
        """``_expand`` from the model's ``next_logprobs_above`` entries: no ``(c, V)`` rows are built.

        The hook returns every entry of ``next_logprobs`` at or above the loose per-row step floor (with the
        same values) and each row's count of finite entries, so the exact tests below store the same
        children and the same ``truncated`` flags as the dense path."""
        level = self.levels[depth]
        r, tok, step, finite = checked_sparse_rows(sparse)
        self.forwards += len(nodes)
        first = np.isposinf(level.floor[nodes])
        self.reforwards += int((~first).sum())
        self._store_children(depth, nodes, first, floor, r, tok, step, finite)

    def _store_children(self, depth: int, nodes: np.ndarray, first: np.ndarray, floor: float, r: np.ndarray,
                        tok: np.ndarray, step: np.ndarray, finite: np.ndarray) -> None:
        """Exact tests on pre-selected candidates ``(r, tok, step)`` (row, token, step log-prob; ``finite``:
        (c,) finite entries per row), then store the children with ``log p >= floor``."""
        level = self.levels[depth]
        parent_lp = level.logprob[nodes]
        # A float32 backend can round a near-certain token to a tiny positive log-prob; a step must not raise
        # a prefix's probability (the budget pruning relies on it), so clip those to 0.
        child_lp = parent_lp[r] + np.minimum(step, 0.0)
        keep = child_lp >= floor
        truncated = finite - np.bincount(r[keep], minlength=len(nodes)) > 0
        self._append_children(depth, nodes, first, floor, truncated, r[keep], tok[keep], child_lp[keep])

    def _append_children(self, depth: int, nodes: np.ndarray, first: np.ndarray, floor: float,
                         truncated: np.ndarray, r: np.ndarray, tok: np.ndarray, child_lp: np.ndarray) -> None:
        """Record the expansion of ``nodes`` to ``floor`` (``truncated``: (c,) some child lies below it) and
        append their (new) children to the next level."""
        level = self.levels[depth]
        if not first.all() and depth + 1 < len(self.levels):
            # Forwarded again: keep only children not stored before (by key, not by comparing with the old
            # floor, so a backend whose rows move in the last bits between batches neither duplicates nor
            # loses a child near that floor).
            children = self.levels[depth + 1]
            stored = np.isin(children.parent, nodes[~first])
            old_keys = children.parent[stored].astype(np.int64) * self.vocab_size + children.token[stored]
            fresh = ~np.isin(nodes[r] * self.vocab_size + tok, old_keys)
            r, tok, child_lp = r[fresh], tok[fresh], child_lp[fresh]
        total = sum(len(lvl) for lvl in self.levels)
        if total + len(r) > self.max_nodes:
            # Checked before anything is recorded: these parents stay unexpanded and the tree consistent.
            raise IndexBudgetError(
                f"the enumeration index reached its budget of {self.max_nodes:,} nodes ({total:,} stored, "
                f"{len(r):,} more needed at length {depth + 1}); raise max_nodes (CLI: --max-nodes) or ask "
                "for fewer or shorter sequences")
        level.floor[nodes] = floor
        level.truncated[nodes] = truncated
        # Within each parent, children in descending log-prob (then token id): the order a tree walk expects.
        order = np.lexsort((tok, -child_lp, r))
        r, child_tokens, child_lp = r[order], tok[order], child_lp[order]
        if depth + 1 == len(self.levels):
            self.levels.append(Level(expandable=self.support.expandable(depth + 1), constrained=self.constrained))
        states = self.support.advance(level.state[nodes[r]], child_tokens) if self.constrained else None
        leaf = self.support.is_complete(depth + 1, child_tokens, states)
        self.levels[depth + 1].append(nodes[r], child_tokens, child_lp, leaf, states)


def checked_dense_rows(rows, n: int, vocab_size: int) -> np.ndarray:
    """A model's ``next_logprobs`` answer for ``n`` prefixes as checked float64 rows, each entry ``<= 0``."""
    rows = np.asarray(rows, dtype=np.float64)
    if rows.shape != (n, vocab_size):
        raise InputError(f"next_logprobs returned shape {rows.shape}, expected ({n}, {vocab_size})")
    if np.isnan(rows).any() or (rows > 1e-6).any():
        raise InputError("next_logprobs returned NaN or positive log-probabilities")
    # float32 backends can round a near-certain token to a tiny positive log-prob; a step must not raise a
    # prefix's probability (the budget pruning relies on it), so clip those to 0.
    return np.minimum(rows, 0.0)


def checked_sparse_rows(sparse) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A model's ``next_logprobs_above`` answer ``(row, token, logprob, finite)`` as checked arrays (the
    log-probs not yet clipped: ``_store_children`` clips them as the dense rows are)."""
    r, tok, step, finite = sparse
    r, tok = np.asarray(r, dtype=np.int64), np.asarray(tok, dtype=np.int64)
    step, finite = np.asarray(step, dtype=np.float64), np.asarray(finite, dtype=np.int64)
    if np.isnan(step).any() or (step > 1e-6).any():
        raise InputError("next_logprobs_above returned NaN or positive log-probabilities")
    return r, tok, step, finite


def _logsumexp_rows(rows: np.ndarray) -> np.ndarray:
    """(c,) log of each row's total probability (-inf for an all -inf row)."""
    top = rows.max(axis=1) if rows.shape[1] else np.full(len(rows), -np.inf)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return safe + np.log(np.exp(rows - safe[:, None]).sum(axis=1))


def loose_step_floor(parent_lp: np.ndarray, floor: float) -> np.ndarray:
    """(c,) step log-prob below which no child of these parents can reach ``floor``, lowered by a relative
    slack: the exact test ``parent + step >= floor`` is applied afterwards, on the candidates only."""
    return (floor - parent_lp) - 1e-9 * (1.0 + np.abs(parent_lp))
