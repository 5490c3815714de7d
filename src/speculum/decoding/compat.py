"""The seed API, unchanged: ``SpeculativeDecoder(gamma, temperature, seed).generate(draft, target, ...)``.

A thin adapter over :func:`speculum.decoding.speculative.stream`: seed-style models (``forward(ids[1, T])
-> logits[1, T, V]``) are wrapped with :func:`speculum.models.from_forward`; protocol models pass through.
Differences from the seed, all fixes: the output law is exactly the target's (the seed's residual and
NaN handling were not), randomness comes from ``seed`` instead of NumPy's global state, models are run
incrementally instead of re-fed from the start, and ``temperature=0`` means greedy (the seed clamped it
to 1e-5, which is greedy up to ties).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ..models.base import from_forward
from .plan import make_rngs
from .speculative import generate

__all__ = ["SpeculativeDecoder", "SpeculativeDecodingStats"]


@dataclass
class SpeculativeDecodingStats:
    """Statistics in the seed's shape (field names and properties as in the seed)."""

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


def _adapt(model: Any) -> Any:
    # Seed-style models only have forward(); protocol models and proposers pass through unchanged.
    if model is not None and not hasattr(model, "start") and callable(getattr(model, "forward", None)):
        return from_forward(model)
    return model


class SpeculativeDecoder:
    """Seed-compatible speculative decoder. Guarantee: exact (the target's output law; greedy at 0).

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
        # One generator per decoder: successive generate() calls differ (as the seed's global-state
        # sampling did) yet the whole sequence of calls is reproducible from ``seed``.
        self._rng = make_rngs(seed)[0] if seed is None or not isinstance(seed, np.random.Generator) else seed

    def generate(
        self,
        draft_model: Any,
        target_model: Any,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 50,
        eos_token_id: Optional[int] = None,
    ) -> Tuple[List[int], SpeculativeDecodingStats]:
        """Run speculative decoding; returns ``(prompt + new token ids, stats)`` as the seed did.

        ``eos_token_id=None`` (the default) never stops early, as in the seed; :func:`speculum.generate`
        instead defaults to the target's eos. Token ids are integers only, as there."""
        result = generate(_adapt(target_model), prompt_ids, draft=_adapt(draft_model),
                          max_new_tokens=max_new_tokens, gamma=self.gamma, temperature=self.temperature,
                          eos_token_id=eos_token_id, seed=self._rng)
        stats = SpeculativeDecodingStats(
            total_tokens_generated=result.stats.emitted,
            total_draft_tokens_proposed=result.stats.proposed,
            total_draft_tokens_accepted=result.stats.accepted,
            num_target_forward_passes=result.stats.target_forwards,
        )
        return [int(t) for t in prompt_ids] + result.tokens, stats
