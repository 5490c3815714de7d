"""How many tokens a scoring round can feed in the time it has (:class:`RoundCosts`), and how many the
engine's next round feeds (:func:`round_budget`).

Why: a forward's time is a fixed part (every weight read once, per-prompt bookkeeping) plus a part per
token fed. Sizing the next round from the last round's seconds *per token* charges the fixed part to
each token: a short round then looks expensive, the next round is made shorter still, and scoring
settles at the smallest round, paying the fixed part over and over (a round of 8 prompts fed one token
each). A line fitted to the last rounds keeps the two parts apart.

Exactness: none involved; this only decides where rounds are cut, and a row-canonical scorer gives
bitwise the same log-probs wherever its rounds are cut.

Example:
    >>> costs = RoundCosts()
    >>> costs.add(8, 0.020); costs.add(40, 0.036)
    >>> costs.tokens_within(0.06)
    88
    >>> costs.fixed_tokens()       # a round costs as much as feeding 32 tokens
    32
    >>> round_budget(costs, prompts=8, credit=None), round_budget(costs, prompts=8, credit=0.0)
    (128, 8)
"""
from __future__ import annotations

from collections import deque

import numpy as np

__all__ = ["RoundCosts", "round_budget", "next_idle_seconds", "IDLE_ROUND_SECONDS", "STOPPABLE_ROUND_SECONDS",
           "MIN_ROUND_TOKENS", "MIN_SHARE_TOKENS"]

# A scoring round's length while no generation runs: what a request arriving meanwhile waits at most for
# the worker. Long enough that a round's fixed costs (a read of every weight) stay small.
IDLE_ROUND_SECONDS = 0.06
# The same on a target whose forwards stop between two layers when a generation arrives
# (``Capabilities.interruptible_rows``): the generation then waits one layer, not one round, and a round
# reads the weights once for as many tokens as this allows (a stopped round is fed again later).
STOPPABLE_ROUND_SECONDS = 0.5
MIN_ROUND_TOKENS = 8    # the fewest tokens a time-sized round feeds (however short the time it has)
# With no generation waiting, the fewest tokens a round feeds each prompt being scored: a round's cost
# grows with its prompts as well as its tokens (each prompt attends on its own), so rounds of a few tokens
# a prompt pay that again and again for short prompts that one round would finish.
MIN_SHARE_TOKENS = 16


class RoundCosts:
    """Seconds a round takes for the tokens it feeds: ``fixed + per_token * tokens``, least squares over
    the last ``keep`` rounds (the fixed part at least 0, the per-token part positive)."""

    def __init__(self, keep: int = 16) -> None:
        self._rounds: deque[tuple[int, float]] = deque(maxlen=keep)

    def add(self, tokens: int, seconds: float) -> None:
        """Note a round that fed ``tokens`` (at least one) in ``seconds``."""
        if tokens > 0 and seconds >= 0:
            self._rounds.append((tokens, seconds))

    def line(self) -> tuple[float, float] | None:
        """``(fixed seconds, seconds per token)`` or None before any round. With rounds of one size only,
        the size tells nothing of the fixed part: it is taken as 0 (each token charged its share)."""
        if not self._rounds:
            return None
        tokens = np.array([t for t, _ in self._rounds], dtype=np.float64)
        seconds = np.array([s for _, s in self._rounds], dtype=np.float64)
        if np.ptp(tokens) > 0:
            per_token, fixed = np.polyfit(tokens, seconds, 1)
            if per_token > 0 and fixed >= 0:
                return float(fixed), float(per_token)
            if per_token > 0:               # a negative intercept: the rounds are all per-token cost
                return 0.0, float(np.sum(seconds) / np.sum(tokens))
        # One size (or no visible slope): the cheapest round's rate, which overestimates the per-token part
        # least.
        return 0.0, float(np.min(seconds / tokens))

    def fixed_tokens(self) -> int:
        """A round's fixed part in tokens (what one more round costs, 0 before any round)."""
        line = self.line()
        return 0 if line is None or line[1] <= 0 else round(line[0] / line[1])

    def tokens_within(self, seconds: float) -> int | None:
        """Tokens a round can feed in ``seconds`` (0 where the fixed part alone takes longer); None before
        any round has been noted."""
        line = self.line()
        if line is None:
            return None
        fixed, per_token = line
        if per_token <= 0:
            return None
        return max(0, int((seconds - fixed) / per_token))


def round_budget(costs: RoundCosts, *, prompts: int, credit: float | None,
                 idle_seconds: float = IDLE_ROUND_SECONDS) -> int | None:
    """Tokens the next scoring round of ``prompts`` prompts feeds (a row-canonical target; others feed a
    chunk a prompt): as many as fit the time it has on the last rounds' ``costs``: ``idle_seconds`` while no
    generation runs (``credit`` None; then at least :data:`MIN_SHARE_TOKENS` a prompt), and while
    generations run the ``credit`` (seconds scoring may still take before their next step), at most
    :data:`IDLE_ROUND_SECONDS`; never fewer than :data:`MIN_ROUND_TOKENS`. None before a first round has
    been timed."""
    seconds = idle_seconds if credit is None else min(IDLE_ROUND_SECONDS, credit)
    tokens = costs.tokens_within(seconds)
    if tokens is None:
        return None
    return max(MIN_ROUND_TOKENS, tokens, MIN_SHARE_TOKENS * prompts if credit is None else 0)


def next_idle_seconds(seconds: float, *, stopped: bool) -> float:
    """The length of the next round with no generation running on a target whose rounds stop for an
    arriving generation, after one of ``seconds``: :data:`IDLE_ROUND_SECONDS` when it was ``stopped``
    (generations are arriving, and a long round would be lost again), else twice as long, up to
    :data:`STOPPABLE_ROUND_SECONDS` (the way back to long rounds once they stop arriving).

    Example:
        >>> next_idle_seconds(0.5, stopped=True), next_idle_seconds(0.06, stopped=False)
        (0.06, 0.12)
    """
    return IDLE_ROUND_SECONDS if stopped else min(STOPPABLE_ROUND_SECONDS, 2 * seconds)
