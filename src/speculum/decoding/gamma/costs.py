"""What speculative blocks cost on the machine at hand, measured while decoding: :class:`CostModel`.

Why: ``gamma="auto"`` weighs the tokens a block may gain against its cost, and the cost is the machine's.
Verifying γ + 1 tokens costs about one decode step on a GPU, but on a CPU each row beyond the first adds
its multiply-adds, more or less steeply by CPU (a compiled kernel that reads quantised weights makes the
one-row step cheap and leaves the per-row cost as it is; matrix units make extra rows nearly free). So
the costs are measured on this machine, during decoding, never assumed from another.

Timings on a shared machine are noisy, and the noise is one-sided: another process, a garbage collection
or a page fault only ever adds time to a forward. The cost of feeding ``n`` tokens is therefore the
median of its last few timings, which bursts hitting fewer than half of them cannot move and which
follows a lasting change of speed within a window; a running mean would let one stall mislead many
blocks. Draft costs, measured on every block, keep a decayed mean.

None of this can affect exactness: costs only decide γ.

Example:
    >>> costs = CostModel()
    >>> for seconds in (0.010, 0.011, 0.050):         # one stall among three plain steps
    ...     costs.observe_target(1, seconds)
    >>> costs.step_seconds()
    0.011
    >>> costs.observe_target(5, 0.0143); round(costs.verify_cost(4), 2)
    1.3
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

__all__ = ["CostModel"]


@dataclass
class CostModel:
    """Measured costs of the target's forwards and of a draft, and the costs a block is judged by: v(γ)
    (verifying γ + 1 tokens, in plain decode steps) and c (drafting a token, in plain decode steps).
    Guarantee: heuristic (speed only)."""

    prior_draft_ratio: float = 0.1   # c before any draft timing is known
    prior_verify_slope: float = 0.3  # v(γ) ≈ 1 + slope·γ before verification timings are known: pessimistic,
                                     # since on CPUs each verified token can cost half a decode step
    decay: float = 0.9               # per-observation decay of the draft's costs
    window: int = 9                  # timings per block size whose median is its cost
    min_catch_up: int = 4            # shortest draft catch-up whose timing is used as a per-token reading cost
    timed: bool = True               # False: costs come from the prior model, not wall-clock timings
    _target: dict = field(default_factory=dict, init=False, repr=False)   # tokens fed -> recent seconds
    _draft_seconds_per_token: float | None = field(default=None, init=False, repr=False)
    _catch_up_seconds_per_token: float | None = field(default=None, init=False, repr=False)
    _shared: tuple[float, float, int] | None = field(default=None, init=False, repr=False)

    # ----------------------------------------------------------------------------------- observations
    def observe_target(self, n_tokens: int, seconds: float) -> None:
        """One target call fed ``n_tokens`` tokens in ``seconds``."""
        if not self.timed:
            seconds = 1.0 + self.prior_verify_slope * (n_tokens - 1)
        self._target.setdefault(n_tokens, deque(maxlen=self.window)).append(seconds)

    def observe_draft(self, n_tokens: int, seconds: float) -> None:
        """Drafting ``n_tokens`` proposals took ``seconds`` (catch-up included: it is a real cost)."""
        if n_tokens == 0:
            return
        if not self.timed:
            seconds = n_tokens * self.prior_draft_ratio
        self._draft_seconds_per_token = self._decayed(self._draft_seconds_per_token, seconds / n_tokens)

    def observe_catch_up(self, n_tokens: int, seconds: float) -> None:
        """A draft model consumed ``n_tokens`` accepted tokens it had not seen in ``seconds``. Catch-ups
        shorter than ``min_catch_up`` are ignored: their time is mostly one call's fixed cost (about a draft
        step, already in c), which would overstate the per-token cost of reading a long backlog."""
        if n_tokens < self.min_catch_up or not self.timed:
            return
        self._catch_up_seconds_per_token = self._decayed(self._catch_up_seconds_per_token, seconds / n_tokens)

    def _decayed(self, old: float | None, value: float) -> float:
        return value if old is None else self.decay * old + (1 - self.decay) * value

    def share_forward(self, fixed: float, per_token: float, blocks: int) -> None:
        """The next forwards are shared: one costs about ``fixed + per_token·tokens`` seconds (fitted over
        the shared forwards so far) and carries ``blocks`` generations' blocks. Until :meth:`forward_alone`, a
        plain step costs ``fixed / blocks + per_token`` and a block of ``n`` tokens ``fixed / blocks +
        per_token·n``: what the block adds to the batch's time at the batch's current size, where the medians
        of past timings would lag behind generations joining and leaving. Ignored when untimed."""
        if self.timed and blocks >= 1 and min(fixed, per_token) >= 0 and fixed / blocks + per_token > 0:
            self._shared = (fixed, per_token, blocks)

    def forward_alone(self) -> None:
        """Back to this generation's own timings (no shared forward's fit is known)."""
        self._shared = None

    def _shared_block_seconds(self, n_tokens: int) -> float:
        """What a block of ``n_tokens`` adds to the shared forward (:meth:`share_forward` was given)."""
        fixed, per_token, blocks = self._shared
        return fixed / blocks + per_token * n_tokens

    # --------------------------------------------------------------------------------------- estimates
    def sizes(self) -> list[int]:
        """The numbers of tokens fed that have been timed, ascending."""
        return sorted(self._target)

    def target_seconds(self, n_tokens: int) -> float | None:
        """Seconds of feeding ``n_tokens`` in one forward: the median of its recent timings (None: untimed)."""
        timings = self._target.get(n_tokens)
        return statistics.median(timings) if timings else None

    def step_seconds(self) -> float | None:
        """Seconds of one plain decode step (measured, or inferred from the smallest block timed; None
        before any timing), or its share of a shared forward (:meth:`share_forward`)."""
        if self._shared is not None:
            return self._shared_block_seconds(1)
        if 1 in self._target:
            return self.target_seconds(1)
        if not self._target:
            return None
        n = min(self._target)
        return self.target_seconds(n) / (1.0 + self.prior_verify_slope * (n - 1))

    def verify_cost(self, gamma: int, step_seconds: float | None = None) -> float:
        """v(γ): the cost of feeding γ + 1 tokens in one forward, in plain decode steps (measured, else
        interpolated or extrapolated from the sizes measured, else the prior)."""
        step = self.step_seconds() if step_seconds is None else step_seconds
        n = gamma + 1
        if step is None or step <= 0:
            return 1.0 + self.prior_verify_slope * gamma
        if self._shared is not None:
            return max(self._shared_block_seconds(n) / step, 1e-3)
        measured = self.target_seconds(n)
        if measured is not None:
            return max(measured / step, 1e-3)
        below = [k for k in self._target if k < n]
        above = [k for k in self._target if k > n]
        if below and above:
            lo, hi = max(below), min(above)
            low, high = self.target_seconds(lo), self.target_seconds(hi)
            seconds = low + (high - low) * (n - lo) / (hi - lo)
        elif below:
            # Extrapolate along the chord from the smallest to the largest multi-token size. The single-token
            # step is left out: on CPUs the curve jumps from 1 to 2 tokens, then flattens in steps, so that
            # slope, or one between two neighbouring sizes, would mislead.
            lo = max(below)
            slope = self.prior_verify_slope * step
            multi = [k for k in below if k >= 2]
            if len(multi) >= 2:
                smallest = min(multi)
                slope = max((self.target_seconds(lo) - self.target_seconds(smallest)) / (lo - smallest), 0.0)
            seconds = self.target_seconds(lo) + slope * (n - lo)
        else:
            seconds = step * (1.0 + self.prior_verify_slope * gamma)
        return max(seconds / step, 1e-3)

    def draft_ratio(self) -> float:
        """c: draft cost per proposed token relative to one plain target step."""
        step = self.step_seconds()
        if self._draft_seconds_per_token is None or not step:
            return self.prior_draft_ratio
        return self._draft_seconds_per_token / step

    def catch_up_ratio(self) -> float:
        """Cost of a draft model consuming one accepted token in a batch, in plain decode steps (0: unknown)."""
        step = self.step_seconds()
        if self._catch_up_seconds_per_token is None or not step:
            return 0.0
        return self._catch_up_seconds_per_token / step
