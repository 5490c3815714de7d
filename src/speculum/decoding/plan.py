"""The arguments of one generation, validated where they enter: :func:`plan_generation` -> :class:`Plan`.

Every check runs before any model work and fails with an ``InputError`` (a ``ValueError``) naming the
argument. Token ids are integers only (:func:`speculum.models.base.check_token_ids`): a string prompt, a
float or a bool is refused, never coerced into some other token. This is also where the models enter:
foreign objects are adapted once (:func:`speculum.models.as_model`) and what the draft declares is read
once, so the loop and the drafters never probe an object for what it offers.
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Any, Hashable, Protocol, Sequence, runtime_checkable

import numpy as np

from ..models.base import AutoregressiveModel, Proposer, as_model, check_prompt, check_token_id
from ..validation import InputError, check_int
from .warp import check_sampling_args

__all__ = ["Plan", "plan_generation", "make_rngs", "MODEL_EOS", "MatchingProposer", "PerGenerationProposer"]

# The default of ``eos_token_id``: stop at the target's own eos (its ``eos_token_id`` attribute), if it has one.
MODEL_EOS: Any = ...

# numpy >= 1.25 spawns independent child generators from a Generator; older versions get a SeedSequence
# drawn from it instead.
_GENERATOR_SPAWNS = np.lib.NumpyVersion(np.__version__) >= "1.25.0"


@runtime_checkable
class MatchingProposer(Protocol):
    """A :class:`~speculum.models.Proposer` that also says how good its proposal looks:
    ``propose_with_match(context, max_tokens) -> (tokens, evidence)``, the evidence an int match length
    (bucketed on a log scale) or any hashable key, independent of ``max_tokens``, and the first token the
    same for any ``max_tokens``. ``gamma="auto"`` then learns acceptance per situation and picks γ after
    seeing the evidence."""

    def propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
        ...

    def propose_with_match(self, context: Sequence[int], max_tokens: int) -> tuple[list[int], Hashable]:
        ...


@runtime_checkable
class PerGenerationProposer(Protocol):
    """A proposer whose state only follows the context it is given (an index of it), which makes an
    object of its own for each generation: ``per_generation()``. Generations sharing one such object would
    take turns at its state, each undoing the others' contexts (the proposals stay the same)."""

    def per_generation(self) -> Any:
        ...


@runtime_checkable
class _DeclaresEos(Protocol):
    """A model with an ``eos_token_id`` attribute (every :class:`~speculum.models.BaseModel`; a protocol
    model may leave it out: it then has no eos)."""

    eos_token_id: int | None


@runtime_checkable
class _DeclaresWindow(Protocol):
    """A model with a ``max_context`` attribute (None: unbounded; a protocol model may leave it out)."""

    max_context: int | None


def make_rngs(seed: Any) -> tuple[np.random.Generator, np.random.Generator, np.random.Generator]:
    """Three independent streams (drafting, acceptance, resampling) from one seed, via ``SeedSequence.spawn``.

    ``seed`` may be None (fresh entropy), a non-negative int, a ``SeedSequence`` or a ``Generator`` (its
    children are spawned, so the caller's stream advances but is never shared). Independent streams
    matter: sharing one between drafting and resampling biases the output (vLLM #54282).
    """
    if isinstance(seed, np.random.Generator):
        if _GENERATOR_SPAWNS:
            children = seed.spawn(3)
            return children[0], children[1], children[2]
        seed = np.random.SeedSequence(seed.integers(0, 2**63, size=4))
    if isinstance(seed, bool) or not (seed is None or isinstance(seed, (Integral, np.random.SeedSequence))):
        raise InputError(f"seed must be None, a non-negative int, a SeedSequence or a numpy Generator, got {seed!r}")
    if isinstance(seed, Integral) and seed < 0:
        raise InputError(f"seed must be non-negative, got {seed}")
    sequence = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
    drafting, acceptance, resampling = (np.random.default_rng(child) for child in sequence.spawn(3))
    return drafting, acceptance, resampling


def _check_gamma(gamma: Any) -> int | str:
    if gamma == "auto":
        return gamma
    try:
        return check_int(gamma, "gamma", minimum=1)
    except InputError:
        raise InputError(f'gamma must be an integer >= 1 or "auto", got {gamma!r}') from None


def _classify_draft(draft: Any, vocab_size: int) -> tuple[str, Any]:
    """``(kind, draft)``: "none", "proposer" (fixed tokens) or "model" (adapted by ``as_model``)."""
    if draft is None:
        return "none", None
    if isinstance(draft, Proposer) and not isinstance(draft, AutoregressiveModel):
        return "proposer", draft
    model = as_model(draft, name="draft")
    if int(model.vocab_size) != vocab_size:
        raise InputError(f"draft vocab_size {model.vocab_size} differs from the target's {vocab_size}: "
                         "draft and target must share one vocabulary")
    return "model", model


@dataclass(frozen=True)
class Plan:
    """Validated arguments of one generation, and what its models declare."""

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
    draft_max_context: int | None = None   # the draft model's window (None: unbounded)
    draft_reports_match: bool = False      # the proposer is a MatchingProposer
    target_logprobs: bool = True           # chunks carry the target's rows (Chunk.target_logprobs)


def plan_generation(target: Any, prompt_ids: Sequence[int], *, draft: Any, max_new_tokens: int,
                    gamma: int | str, temperature: float, top_k: int | None, top_p: float | None,
                    eos_token_id: Any, seed: Any, target_logprobs: bool = True) -> Plan:
    """Validate everything before any model work; each failure is an InputError naming the argument.

    ``eos_token_id`` is an integer id, None (never stop early) or :data:`MODEL_EOS` (the target's
    ``eos_token_id`` attribute, None when it has none). A draft model whose ``max_context`` cannot hold
    the prompt is dropped here (plain decoding, which is exact anyway) with the reason in ``draft_skipped``.
    ``target_logprobs=False``: the caller reads no ``Chunk.target_logprobs``, so a greedy generation on a
    target declaring ``greedy_tokens`` verifies on the target's greedy tokens without its rows (the same
    tokens; chunks then carry None).
    """
    check_sampling_args(temperature, top_k, top_p)
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", minimum=0)
    gamma = _check_gamma(gamma)
    target = as_model(target, name="target")    # a .forward model without vocab_size costs one probe forward
    vocab_size = int(target.vocab_size)
    if eos_token_id is MODEL_EOS:
        eos_token_id = target.eos_token_id if isinstance(target, _DeclaresEos) else None
        if eos_token_id is not None:
            eos_token_id = check_token_id(eos_token_id, vocab_size, name="the target's eos_token_id")
    elif eos_token_id is not None:
        eos_token_id = check_token_id(eos_token_id, vocab_size, name="eos_token_id")
    prompt = check_prompt(target, prompt_ids, name="prompt_ids")
    draft_kind, draft = _classify_draft(draft, vocab_size)
    if draft_kind == "proposer" and isinstance(draft, PerGenerationProposer):
        draft = draft.per_generation()
    budget, budget_reason = max_new_tokens, "max_new_tokens"
    max_context = target.max_context if isinstance(target, _DeclaresWindow) else None
    if max_context is not None:
        if len(prompt) > max_context:
            raise InputError(f"prompt_ids has {len(prompt)} tokens, more than the target's max_context {max_context}")
        if max_context - len(prompt) < budget:
            budget, budget_reason = max_context - len(prompt), "max_context"
    draft_skipped = None
    draft_context = draft.max_context if draft_kind == "model" and isinstance(draft, _DeclaresWindow) else None
    # To propose one token the draft reads the whole context: a prompt longer than its window leaves
    # nothing it could do.
    if draft_context is not None and len(prompt) > draft_context:
        draft_skipped = (f"the prompt has {len(prompt)} tokens, more than the draft's max_context "
                         f"{draft_context}: plain decoding, the draft model was not used")
        draft_kind, draft, draft_context = "none", None, None
    return Plan(target, draft, draft_kind, prompt, budget, budget_reason, gamma, float(temperature),
                None if top_k is None else int(top_k), None if top_p is None else float(top_p),
                eos_token_id, make_rngs(seed), seeded=seed is not None, draft_skipped=draft_skipped,
                draft_max_context=draft_context,
                draft_reports_match=draft_kind == "proposer" and isinstance(draft, MatchingProposer),
                target_logprobs=bool(target_logprobs))
