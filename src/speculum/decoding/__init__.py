"""Speculative decoding: a cheap draft proposes, the target verifies, the output law is the target's.

* :mod:`.warp` — temperature / top-k / top-p as one pure function on log-prob rows;
* :mod:`.verify` — the acceptance rules (distribution-aware, point-mass, greedy) as pure functions;
* :mod:`.controller` — the γ policy: a fixed γ, or ``gamma="auto"`` adapting it;
* :mod:`.plan` — the arguments of one generation, validated before any model work;
* :mod:`.drafter` — where proposals come from: a draft model, a proposer, or none;
* :mod:`.profile` — what ``gamma="auto"`` learns about a draft model, kept for the draft's life;
* :mod:`.generation` — one generation's draft → verify loop in steps, :class:`~.generation.Decoder`;
* :mod:`.speculative` — :func:`stream` (generator of :class:`Chunk`) and :func:`generate`: one decoder alone;
* :mod:`.scheduler` — many generations at once, one packed forward a step: :class:`Scheduler` and
  :func:`generate_batch`;
* :mod:`.text` — streamed tokens to streamed text, stop strings;
* :mod:`.compat` — the compatibility API, :class:`SpeculativeDecoder` / :class:`SpeculativeDecodingStats`.

Example:
    >>> import speculum
    >>> from speculum.models import MarkovModel
    >>> target, draft = MarkovModel.random(6, seed=0), MarkovModel.random(6, seed=1)
    >>> result = speculum.generate(target, [0], draft=draft, max_new_tokens=16, gamma=3, seed=0)
    >>> len(result.tokens), result.stats.emitted
    (16, 16)
"""
from __future__ import annotations

from .compat import SpeculativeDecoder, SpeculativeDecodingStats
from .gamma.controller import GammaController
from .events import Chunk, DecodingStats, GenerationResult
from .generation import Decoder
from .plan import make_rngs
from .scheduler import Scheduler, generate_batch
from .speculative import generate, stream
from .verify import (Verdict, residual_logprobs, verify_distribution, verify_greedy, verify_greedy_tokens,
                     verify_point_mass)
from .warp import check_sampling_args, sample_from_logprobs, warp_logprobs

__all__ = [
    "generate", "generate_batch", "stream", "Decoder", "Scheduler", "Chunk", "DecodingStats", "GenerationResult",
    "SpeculativeDecoder", "SpeculativeDecodingStats", "GammaController", "make_rngs",
    "Verdict", "verify_distribution", "verify_point_mass", "verify_greedy", "verify_greedy_tokens", "residual_logprobs",
    "warp_logprobs", "check_sampling_args", "sample_from_logprobs",
]
