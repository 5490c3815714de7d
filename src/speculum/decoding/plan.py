"""The arguments of one generation, validated where they enter: :func:`plan_generation` -> :class:`Plan`.

Every check runs before any model work and fails with a ``ValueError`` naming the argument. Token ids are
integers only (:func:`speculum.models.base.check_token_ids`): a string prompt, a float or a bool is
refused, never coerced into some other token.
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Any, Sequence

import numpy as np

from ..models.base import check_prompt, check_token_id, from_forward
from .warp import check_sampling_args

__all__ = ["Plan", "plan_generation", "make_rngs", "MODEL_EOS"]

# The default of ``eos_token_id``: stop at the target's own eos (its ``eos_token_id`` attribute), if it has one.
MODEL_EOS: Any = ...


def make_rngs(seed: Any) -> tuple[np.random.Generator, np.random.Generator, np.random.Generator]:
    """Three independent streams (drafting, acceptance, resampling) from one seed, via ``SeedSequence.spawn``.

    ``seed`` may be None (fresh entropy), a non-negative int, a ``SeedSequence`` or a ``Generator`` (its
    children are spawned, so the caller's stream advances but is never shared). Independent streams
    matter: sharing one between drafting and resampling biases the output (vLLM #54282).
    """
    if isinstance(seed, np.random.Generator):
        if hasattr(seed, "spawn"):                      # numpy >= 1.25
            children = seed.spawn(3)
            return children[0], children[1], children[2]
        seed = np.random.SeedSequence(seed.integers(0, 2**63, size=4))
    if isinstance(seed, bool) or not (seed is None or isinstance(seed, (Integral, np.random.SeedSequence))):
        raise ValueError(f"seed must be None, a non-negative int, a SeedSequence or a numpy Generator, got {seed!r}")
    if isinstance(seed, Integral) and seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    sequence = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
    drafting, acceptance, resampling = (np.random.default_rng(child) for child in sequence.spawn(3))
    return drafting, acceptance, resampling


def _classify_draft(draft: Any, vocab_size: int) -> tuple[str, Any]:
    if draft is None:
        return "none", None
    if hasattr(draft, "start") and hasattr(draft, "vocab_size"):
        kind, model = "model", draft
    elif callable(getattr(draft, "propose", None)):
        return "proposer", draft
    elif callable(getattr(draft, "forward", None)):
        kind, model = "model", from_forward(draft)
    else:
        raise ValueError("draft must be a model (with start/vocab_size), a proposer (with propose), "
                         f"a seed-style model (with forward) or None, got {type(draft).__name__}")
    if int(model.vocab_size) != vocab_size:
        raise ValueError(f"draft vocab_size {model.vocab_size} differs from the target's {vocab_size}: "
                         "draft and target must share one vocabulary")
    return kind, model


@dataclass(frozen=True)
class Plan:
    """Validated arguments of one generation."""

    target: Any
    draft: Any
    draft_kind: str              # "model" | "proposer" | "none"
    prompt: list[int]
    budget: int                  # tokens that may be emitted (max_new_tokens, capped by max_context)
    budget_reason: str           # stop reason when the budget is reached
    gamma: int | str
    temperature: float
    top_k: int | None
    top_p: float | None
    eos_token_id: int | None
    rngs: tuple[np.random.Generator, np.random.Generator, np.random.Generator]
    seeded: bool = False         # a seed was given: the run must be reproducible
    draft_skipped: str | None = None   # why a draft model that was given is not used at all


def plan_generation(target: Any, prompt_ids: Sequence[int], *, draft: Any, max_new_tokens: int,
                    gamma: int | str, temperature: float, top_k: int | None, top_p: float | None,
                    eos_token_id: Any, seed: Any) -> Plan:
    """Validate everything before any model work; each failure is a ValueError naming the argument.

    ``eos_token_id`` is an integer id, None (never stop early) or :data:`MODEL_EOS` (the target's
    ``eos_token_id`` attribute, None when it has none). A draft model whose ``max_context`` cannot hold
    the prompt is dropped here (plain decoding, which is exact anyway) with the reason in ``draft_skipped``.
    """
    check_sampling_args(temperature, top_k, top_p)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if gamma != "auto" and (isinstance(gamma, bool) or not isinstance(gamma, Integral) or gamma < 1):
        raise ValueError(f'gamma must be an integer >= 1 or "auto", got {gamma!r}')
    if not (hasattr(target, "start") and hasattr(target, "vocab_size")):
        if not callable(getattr(target, "forward", None)):
            raise ValueError(f"target must be a model with start() and vocab_size, got {type(target).__name__}")
        target = from_forward(target)       # a seed-style model without vocab_size costs one probe forward
    vocab_size = int(target.vocab_size)
    if eos_token_id is MODEL_EOS:
        eos_token_id = getattr(target, "eos_token_id", None)
        if eos_token_id is not None:
            eos_token_id = check_token_id(eos_token_id, vocab_size, name="the target's eos_token_id")
    elif eos_token_id is not None:
        eos_token_id = check_token_id(eos_token_id, vocab_size, name="eos_token_id")
    prompt = check_prompt(target, prompt_ids, name="prompt_ids")
    draft_kind, draft = _classify_draft(draft, vocab_size)
    budget, budget_reason = int(max_new_tokens), "max_new_tokens"
    max_context = getattr(target, "max_context", None)
    if max_context is not None:
        if len(prompt) > max_context:
            raise ValueError(f"prompt_ids has {len(prompt)} tokens, more than the target's max_context {max_context}")
        if max_context - len(prompt) < budget:
            budget, budget_reason = max_context - len(prompt), "max_context"
    draft_skipped = None
    draft_context = getattr(draft, "max_context", None) if draft_kind == "model" else None
    # To propose one token the draft reads the whole context: a prompt longer than its window leaves
    # nothing it could do.
    if draft_context is not None and len(prompt) > draft_context:
        draft_skipped = (f"the prompt has {len(prompt)} tokens, more than the draft's max_context "
                         f"{draft_context}: plain decoding, the draft model was not used")
        draft_kind, draft = "none", None
    return Plan(target, draft, draft_kind, prompt, budget, budget_reason, gamma, float(temperature),
                None if top_k is None else int(top_k), None if top_p is None else float(top_p),
                eos_token_id, make_rngs(seed), seeded=seed is not None, draft_skipped=draft_skipped)
