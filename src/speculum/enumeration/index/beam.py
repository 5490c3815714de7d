"""A small beam search that finds real complete sequences early, to aim the exact index's first budget.

The exact index must expand every prefix at least as probable as the ``k``-th best sequence, but until it
has stored ``k`` complete sequences it does not know how deep that is (a fixed-length support has no leaf
before its last level). ``k`` distinct complete sequences found by any means prove ``threshold(k) >=`` the
``k``-th best of their log-probs, so a beam of width ``k`` (``k`` prefixes per batched call, one call per
step) gives a budget that certainly suffices, usually at or near the true threshold. It only aims budgets:
every answer still comes from the exact tree.

Example:
    >>> from speculum.models import MarkovModel
    >>> found, forwards = beam_logprobs(MarkovModel.random(5, seed=0), prompt=[0], width=3, support=Support(max_len=4))
    >>> len(found), bool(found[0] >= found[-1]), forwards
    (3, True, 10)
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .support import Support
from .tree import ForwardBudgetError

__all__ = ["beam_logprobs"]


def beam_logprobs(model: Any, *, prompt: Sequence[int], width: int, support: Support,
                  max_steps: int = 64, max_forwards: int | None = None) -> tuple[np.ndarray, int]:
    """Log-probs (descending) of up to ``width`` distinct complete sequences found by a width-``width`` beam,
    and the number of prefixes it forwarded.

    Complete means in ``support`` (within ``max_steps`` tokens when the support has no length cap). Each
    log-prob is the float sum of the model's steps in order, as the prefix tree computes it (a step above 0
    clipped to 0). Costs at most ``width`` forwards per step. Approximate search, exact scores of real
    sequences. ``max_forwards``: a step that would pass it raises ``ForwardBudgetError`` before it forwards.
    """
    horizon = support.horizon(max_steps)
    eos = support.eos
    prompt = [int(t) for t in prompt]
    constrained = support.constraint is not None
    live: list[tuple[list[int], float]] = [([], 0.0)]
    states = np.zeros(1, dtype=np.int32)          # constraint automaton state of each live sequence
    finished: list[float] = []
    forwards = 0
    for depth in range(horizon):
        if not live:
            break
        if max_forwards is not None and forwards + len(live) > max_forwards:
            raise ForwardBudgetError(max_forwards, forwards + len(live))
        rows = np.asarray(model.next_logprobs([prompt + seq for seq, _ in live]), dtype=np.float64)
        forwards += len(live)
        steps = support.allowed(np.minimum(rows, 0.0), states)
        last = depth + 1 == horizon
        if eos is not None:
            # eos ends a sequence (at the last position nothing else may); the others continue.
            for (seq, lp), step in zip(live, steps):
                if np.isfinite(step[eos]):
                    finished.append(lp + step[eos])
            steps[:, eos] = -np.inf
            if last:
                break
        totals = np.array([lp for _, lp in live])[:, None] + steps          # (beam, V)
        flat = totals.ravel()
        keep = min(width, int(np.isfinite(flat).sum()))
        if keep == 0:
            break
        # Top ``keep`` by log-prob, ties towards the lower (row, token): deterministic. Partition first: a
        # full sort of (beam x vocabulary) entries would cost more than the forward.
        cut = np.partition(flat, len(flat) - keep)[len(flat) - keep]
        candidates_at = np.flatnonzero(flat >= cut)
        best = candidates_at[np.lexsort((candidates_at, -flat[candidates_at]))][:keep]
        candidates = [(live[i // rows.shape[1]][0] + [int(i % rows.shape[1])], float(flat[i])) for i in best]
        if constrained:
            states = support.advance(states[best // rows.shape[1]], best % rows.shape[1])
            if eos is None:
                # A constrained sequence without eos is complete when the automaton accepts it.
                done = support.is_complete(depth + 1, best % rows.shape[1], states)
                finished.extend(lp for (_, lp), d in zip(candidates, done) if d)
                candidates = [c for c, d in zip(candidates, done) if not d]
                states = states[~done]
                live = candidates
                continue
        if eos is None and last:
            finished.extend(lp for _, lp in candidates)
            break
        live = candidates
    return np.sort(np.asarray(finished, dtype=np.float64))[::-1][:width], forwards
