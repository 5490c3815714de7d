"""The serving engine's running totals (``/metrics``).

Example:
    >>> EngineMetrics(draft_proposed=4, draft_accepted=3).acceptance_rate
    0.75
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineMetrics"]


@dataclass
class EngineMetrics:
    """Running totals since the engine started (``/metrics``)."""

    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_rejected: int = 0
    requests_disconnected: int = 0     # cancelled because their client went away (part of requests_cancelled)
    requests_running: int = 0
    requests_waiting: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0
    target_forwards: int = 0
    busy_seconds: float = 0.0
    prefill_seconds: float = 0.0       # admitting jobs: their prompts' own forwards, part of busy_seconds
    #                                    (a prompt packed into a step's forward counts in that step; an
    #                                    echo's admission, a lookup, adds microseconds)
    prompts_scored: int = 0            # echo requests' prompts scored
    scored_tokens_forwarded: int = 0   # tokens their scoring fed to the target
    scored_tokens_reused: int = 0      # positions answered from a resident prompt sharing the prefix
    scoring_forwards: int = 0          # forwards that scored them (a packed forward of several counts once)
    scoring_rounds_stopped: int = 0    # scoring rounds stopped between two layers for a generation (fed again)
    prefix_cache_tokens: int = 0       # tokens held by resident scored prompts (gauge)
    prefix_cache_capacity: int = 0     # the cap on them (``prefix_cache_tokens`` of the engine)

    @property
    def acceptance_rate(self) -> float:
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0

    @property
    def tokens_per_busy_second(self) -> float:
        return self.completion_tokens / self.busy_seconds if self.busy_seconds > 0 else 0.0
