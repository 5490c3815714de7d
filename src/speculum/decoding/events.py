"""What the decoding loop reports: one :class:`Chunk` per verification, running :class:`DecodingStats`,
and the blocking call's :class:`GenerationResult`. Metrics are returned as data; only the CLI prints."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

__all__ = ["Chunk", "DecodingStats", "GenerationResult"]


@dataclass
class DecodingStats:
    """Counters and timings of one generation (running totals while streaming).

    ``target_forwards`` counts target calls after the prompt prefill (one per emitted chunk), so with
    draft == target it is exactly emitted / (γ + 1). ``draft_forwards`` counts draft-model calls (a
    proposer's lookups are not forwards). ``proposed`` / ``accepted`` count draft tokens submitted to and
    accepted by verification; ``emitted`` counts tokens returned. Seconds include the prompt prefill.
    """

    target_forwards: int = 0
    draft_forwards: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    total_seconds: float = 0.0
    proposed_per_position: list[int] = field(default_factory=list)   # [i]: blocks that proposed position i
    accepted_per_position: list[int] = field(default_factory=list)   # [i]: blocks that accepted position i
    gamma_history: list[int] = field(default_factory=list)           # proposals verified per target forward
    # Why the draft model was not used (gamma="auto" found it cannot pay; the prompt exceeds its max_context)
    # or stopped being used (the context outgrew its max_context). None: used throughout, or no draft model.
    draft_skipped: str | None = None

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0.0 when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        """Emitted tokens per target forward: 1.0 for plain decoding, up to γ + 1 with speculation."""
        return self.emitted / self.target_forwards if self.target_forwards else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Acceptance rate of the i-th proposal of a block, given it was proposed."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    @property
    def tokens_per_second(self) -> float:
        return self.emitted / self.total_seconds if self.total_seconds > 0 else 0.0

    def record_block(self, proposed: int, accepted: int) -> None:
        """Count one verification of ``proposed`` tokens of which a prefix of ``accepted`` was accepted."""
        self.proposed += proposed
        self.accepted += accepted
        self.gamma_history.append(proposed)
        if proposed > len(self.proposed_per_position):
            grow = proposed - len(self.proposed_per_position)
            self.proposed_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(proposed):
            self.proposed_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def as_dict(self) -> dict:
        """Fields and derived rates as a plain dict (for JSON output)."""
        out = asdict(self)
        out.update(acceptance_rate=self.acceptance_rate, tokens_per_target_forward=self.tokens_per_target_forward,
                   per_position_acceptance=self.per_position_acceptance, tokens_per_second=self.tokens_per_second)
        return out


@dataclass(frozen=True)
class Chunk:
    """Tokens emitted by one target forward.

    ``tokens``: the emitted tokens (the first ``min(accepted, len(tokens))`` came from the draft; the last
    one is ``recovered`` or ``bonus`` unless eos / the budget cut the chunk short). ``proposed``: how many
    draft tokens were verified. ``finished``: the last chunk; ``stop_reason`` is then "eos",
    "max_new_tokens" or "max_context". ``stats``: the running totals (the same object, updated in place).
    ``target_logprobs``: ``(len(tokens), vocab)``, row j the target's own log-probs at ``tokens[j]``'s
    position (the distribution it was drawn from, before temperature / top-k / top-p): exact, and free (the
    verification computed them); None where no rows were computed (a chunk that emits nothing, or a greedy
    generation whose caller asked for none: ``target_logprobs=False``).
    """

    tokens: list[int]
    proposed: int
    accepted: int
    recovered: int | None
    bonus: int | None
    finished: bool
    stop_reason: str | None
    stats: DecodingStats
    target_logprobs: np.ndarray | None = None


@dataclass(frozen=True)
class GenerationResult:
    """Result of :func:`speculum.generate`: the new tokens (prompt excluded) and the statistics."""

    tokens: list[int]
    stats: DecodingStats
    stop_reason: str | None = None
