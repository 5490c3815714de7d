"""The compatibility API: ``SpeculativeDecoder(gamma, temperature, seed).generate(draft, target, ...)``.

A thin adapter over :func:`speculum.decoding.speculative.generate`, which adapts ``.forward`` models
(``forward(ids[1, T]) -> logits[1, T, V]``) where they enter; protocol models pass through. Its output law
is exactly the target's, randomness comes from ``seed`` (never NumPy's global state), models run
incrementally, and ``temperature=0`` means greedy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from .plan import make_rngs
from .speculative import generate

__all__ = ["SpeculativeDecoder", "SpeculativeDecodingStats"]


@dataclass
class SpeculativeDecodingStats:
    """Statistics in the compatibility API's shape (its field names and properties)."""

    total_tokens_generated: int = 0
    total_draft_tokens_proposed: int = 0
    total_draft_tokens_accepted: int = 0
    num_target_forward_passes: int = 0

    @property
    def acceptance_rate(self) -> float:
        if self.total_draft_tokens_proposed == 0:
            return 0.0
        return self.total_draft_tokens_accepted / self.total_draft_tokens_proposed

    @property
    def tokens_per_step(self) -> float:
        if self.num_target_forward_passes == 0:
            return 0.0
        return self.total_tokens_generated / self.num_target_forward_passes


class SpeculativeDecoder:
    """The compatibility API's speculative decoder. Guarantee: exact (the target's output law; greedy at 0).

    Example:
        >>> import numpy as np
        >>> from speculum.models import MarkovModel
        >>> target, draft = MarkovModel.random(6, seed=0), MarkovModel.random(6, seed=1)
        >>> ids, stats = SpeculativeDecoder(gamma=3, seed=0).generate(draft, target, [2], max_new_tokens=10)
        >>> len(ids), stats.total_tokens_generated
        (11, 10)
    """

    def __init__(self, gamma: int = 4, temperature: float = 1.0, seed: Any = None) -> None:
        """Args: ``gamma`` draft tokens per target forward (int >= 1 or "auto"); ``temperature`` for both
        models (0 = greedy); ``seed`` for the decoder's random streams (None = fresh entropy)."""
        self.gamma = gamma
        self.temperature = temperature
        self.seed = seed
        # One generator per decoder: successive generate() calls differ, yet the whole sequence of calls
        # is reproducible from ``seed``.
        self._rng = make_rngs(seed)[0] if seed is None or not isinstance(seed, np.random.Generator) else seed

    def generate(
        self,
        draft_model: Any,
        target_model: Any,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 50,
        eos_token_id: Optional[int] = None,
    ) -> Tuple[List[int], SpeculativeDecodingStats]:
        """Run speculative decoding; returns ``(prompt + new token ids, stats)``.

        ``eos_token_id=None`` (the default) never stops early; :func:`speculum.generate` instead defaults
        to the target's eos. Token ids are integers only, as there."""
        result = generate(target_model, prompt_ids, draft=draft_model, max_new_tokens=max_new_tokens,
                          gamma=self.gamma, temperature=self.temperature, eos_token_id=eos_token_id,
                          seed=self._rng)
        stats = SpeculativeDecodingStats(
            total_tokens_generated=result.stats.emitted,
            total_draft_tokens_proposed=result.stats.proposed,
            total_draft_tokens_accepted=result.stats.accepted,
            num_target_forward_passes=result.stats.target_forwards,
        )
        return [int(t) for t in prompt_ids] + result.tokens, stats
