"""The acceptance rules of speculative decoding: pure functions on arrays, no model or cache code.

Vocabulary (vLLM's): the draft *proposes* γ tokens; a prefix of them is *accepted*; at the first rejection a
*recovered* token is sampled from the residual distribution; if all γ are accepted a *bonus* token is
sampled from the target's next row. The *emitted* tokens are accepted + (recovered or bonus): always
between 1 and γ + 1 tokens, so one target forward never yields nothing.

Three rules, each exact (the emitted tokens have the target's law — identical tokens for greedy):

* :func:`verify_distribution` — the draft reports the distribution it sampled from
  (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2).
* :func:`verify_point_mass` — the proposal is a fixed token with no honest distribution (prompt lookup,
  n-gram argmax): a point mass, i.e. a one-hot draft distribution.
* :func:`verify_greedy` — temperature 0: accept while the proposal equals the target's argmax
  (:func:`verify_greedy_tokens` on the argmax alone, where the target gives it without the rows).

Random numbers are drawn in a fixed way whatever happens: γ uniforms from ``acceptance_rng`` and one from
``resampling_rng`` per call, from independent streams (sharing them biases the output, vLLM #54282).

Log-prob rows passed in are the *warped* rows (:mod:`speculum.decoding.warp`), natural log, normalised.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..validation import InputError

from .warp import sample_from_logprobs

__all__ = ["Verdict", "verify_distribution", "verify_point_mass", "verify_greedy", "verify_greedy_tokens",
           "residual_logprobs"]

# If the residual distribution has less mass than this, treat it as empty. Its mass equals the probability
# of the rejection that led here, so any recovery distribution chosen below this mass moves the output law
# by at most this much in total variation — far below anything floating point represents in the rows.
_EMPTY_RESIDUAL_MASS = 1e-12


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one block of proposed tokens.

    ``accepted``: how many proposed tokens were accepted (a prefix). ``emitted``: the tokens to append,
    ``proposed[:accepted] + [recovered or bonus]``. ``recovered``: the token sampled at the first
    rejection, else None. ``bonus``: the token sampled after all proposals were accepted, else None.
    """

    accepted: int
    emitted: list[int]
    recovered: int | None
    bonus: int | None


def residual_logprobs(target_row: np.ndarray, draft_row: np.ndarray) -> np.ndarray | None:
    """``(V,)`` log of norm(max(p_target − p_draft, 0)), or None if that residual has (numerically) no mass.

    Computed stably in log space: where target > draft, log(p_t − p_d) = t + log(−expm1(d − t)), which
    keeps full relative precision even when p_t and p_d are nearly equal or both tiny.

    Args:
        target_row: ``(V,)`` target log-probs (warped).
        draft_row: ``(V,)`` draft log-probs (warped), the distribution the draft token was sampled from.
    """
    positive = target_row > draft_row                                           # (V,) bool
    residual = np.full(target_row.shape, -np.inf)                               # (V,)
    # d < t on these entries, so −expm1(d − t) lies in (0, 1]: the log is finite.
    residual[positive] = target_row[positive] + np.log(-np.expm1(draft_row[positive] - target_row[positive]))
    top = np.max(residual)
    if not np.isfinite(top):
        return None
    log_mass = top + np.log(np.sum(np.exp(residual - top)))
    if log_mass < np.log(_EMPTY_RESIDUAL_MASS):
        return None
    return residual - log_mass


def _draw(acceptance_rng: np.random.Generator, resampling_rng: np.random.Generator,
          gamma: int) -> tuple[np.ndarray, float]:
    # Fixed consumption: γ acceptance uniforms and one resampling uniform, whatever the outcome.
    return acceptance_rng.random(gamma), float(resampling_rng.random())


def _check_shapes(draft_tokens: Sequence[int], target_logprobs: np.ndarray) -> int:
    gamma = len(draft_tokens)
    if target_logprobs.ndim != 2 or target_logprobs.shape[0] != gamma + 1:
        raise InputError(f"target_logprobs must have shape ({gamma + 1}, vocab) for {gamma} draft tokens, "
                         f"got {target_logprobs.shape}")
    return gamma


def verify_distribution(
    draft_tokens: Sequence[int],          # (γ,) proposed token ids
    draft_logprobs: np.ndarray,           # (γ, V) warped draft log-probs each token was sampled from
    target_logprobs: np.ndarray,          # (γ+1, V) warped target log-probs; row i follows draft_tokens[:i]
    acceptance_rng: np.random.Generator,
    resampling_rng: np.random.Generator,
) -> Verdict:
    """Distribution-aware verification (speculative sampling). Guarantee: exact.

    Accept ``draft_tokens[i]`` with probability min(1, p_target/p_draft); at the first rejection emit a
    token from norm(max(p_target − p_draft, 0)); if all are accepted emit a bonus token from the last
    target row. Each emitted token then has exactly the target's (warped) law given its prefix.

    When the residual has no mass the draft and target rows are equal, and a rejection has probability
    (numerically) zero: the rejection probability is exactly the residual mass Σ max(p_d − p_t, 0) =
    Σ max(p_t − p_d, 0). Sampling the target row there is therefore exact (and harmless under rounding).

    Example:
        >>> row = np.log(np.full((2, 3), 1 / 3))
        >>> v = verify_distribution([1], row[:1], row, np.random.default_rng(0), np.random.default_rng(1))
        >>> v.accepted, len(v.emitted)                  # draft == target: always accepted, plus a bonus
        (1, 2)
    """
    gamma = _check_shapes(draft_tokens, target_logprobs)
    if draft_logprobs.shape != (gamma, target_logprobs.shape[1]):
        raise InputError(f"draft_logprobs must have shape ({gamma}, {target_logprobs.shape[1]}), "
                         f"got {draft_logprobs.shape}")
    uniforms, resample_uniform = _draw(acceptance_rng, resampling_rng, gamma)
    for i, token in enumerate(draft_tokens):
        draft_lp = draft_logprobs[i, token]
        if not draft_lp > -np.inf:
            raise InputError(f"draft token {token} at position {i} has zero probability under the draft "
                             "distribution it was reported to be sampled from")
        # u < p_t/p_d  <=>  log u < t - d  (u in [0, 1): a zero-probability target token is never accepted).
        if uniforms[i] < np.exp(min(0.0, target_logprobs[i, token] - draft_lp)):
            continue
        residual = residual_logprobs(target_logprobs[i], draft_logprobs[i])
        recover_row = target_logprobs[i] if residual is None else residual
        recovered = sample_from_logprobs(recover_row, resample_uniform)
        return Verdict(i, [int(t) for t in draft_tokens[:i]] + [recovered], recovered, None)
    bonus = sample_from_logprobs(target_logprobs[gamma], resample_uniform)
    return Verdict(gamma, [int(t) for t in draft_tokens] + [bonus], None, bonus)


def verify_point_mass(
    draft_tokens: Sequence[int],          # (γ,) proposed token ids, fixed (no distribution)
    target_logprobs: np.ndarray,          # (γ+1, V) warped target log-probs; row i follows draft_tokens[:i]
    acceptance_rng: np.random.Generator,
    resampling_rng: np.random.Generator,
) -> Verdict:
    """Point-mass verification, for proposals with no honest distribution. Guarantee: exact, any proposal.

    A fixed proposal x is a one-hot draft distribution, so this is :func:`verify_distribution` with
    p_draft = δ_x: accept x with probability p_target(x); on rejection sample from p_target with x
    removed and renormalised. Then P(emit y) = p(x)·[y = x] + (1 − p(x))·p(y)/(1 − p(x))·[y ≠ x] = p(y).
    A proposal with p_target(x) = 0 is always rejected; if x carries all the target's mass it is always
    accepted (the removed row would be empty, and that rejection has probability zero).

    Unlike exact-match acceptance (accept only if the target's own sample equals x), this accepts with
    probability p(x) rather than needing a coincidence, and it is what mlx-lm lacked (PR #1709).

    Example:
        >>> rows = np.log(np.array([[1e-300, 1.0, 1e-300], [0.2, 0.3, 0.5]]))
        >>> verify_point_mass([1], rows, np.random.default_rng(0), np.random.default_rng(1)).accepted
        1
    """
    gamma = _check_shapes(draft_tokens, target_logprobs)
    uniforms, resample_uniform = _draw(acceptance_rng, resampling_rng, gamma)
    for i, token in enumerate(draft_tokens):
        if uniforms[i] < np.exp(target_logprobs[i, token]):
            continue
        removed = target_logprobs[i].copy()                                     # (V,)
        removed[token] = -np.inf
        recover_row = removed if np.exp(removed).sum() >= _EMPTY_RESIDUAL_MASS else target_logprobs[i]
        recovered = sample_from_logprobs(recover_row, resample_uniform)
        return Verdict(i, [int(t) for t in draft_tokens[:i]] + [recovered], recovered, None)
    bonus = sample_from_logprobs(target_logprobs[gamma], resample_uniform)
    return Verdict(gamma, [int(t) for t in draft_tokens] + [bonus], None, bonus)


def verify_greedy(
    draft_tokens: Sequence[int],          # (γ,) proposed token ids
    target_logprobs: np.ndarray,          # (γ+1, V) target log-probs (any monotone warp: argmax is the same)
) -> Verdict:
    """Greedy verification (temperature 0). Guarantee: identical tokens to plain greedy decoding.

    Accept while the proposal equals the target's argmax (lowest token id on ties, as ``np.argmax`` and
    plain greedy decoding do); emit the target's argmax at the first mismatch, or as bonus after the last.

    Example:
        >>> rows = np.log(np.array([[0.1, 0.9], [0.6, 0.4]]))
        >>> verify_greedy([1], rows).emitted
        [1, 0]
    """
    _check_shapes(draft_tokens, target_logprobs)
    return verify_greedy_tokens(draft_tokens, np.argmax(target_logprobs, axis=-1))


def verify_greedy_tokens(
    draft_tokens: Sequence[int],          # (γ,) proposed token ids
    target_tokens: np.ndarray,            # (γ+1,) the target's greedy token after draft_tokens[:i]
) -> Verdict:
    """Greedy verification on the target's greedy tokens alone (what :func:`verify_greedy` reads of its
    rows). Guarantee: identical tokens to plain greedy decoding, given the argmax of each target row.

    Example:
        >>> verify_greedy_tokens([1, 1], np.array([1, 0, 1])).emitted
        [1, 0]
    """
    gamma = len(draft_tokens)
    if np.ndim(target_tokens) != 1 or len(target_tokens) != gamma + 1:
        raise InputError(f"target_tokens must have shape ({gamma + 1},) for {gamma} draft tokens, "
                         f"got {np.shape(target_tokens)}")
    for i, token in enumerate(draft_tokens):
        if int(token) != int(target_tokens[i]):
            recovered = int(target_tokens[i])
            return Verdict(i, [int(t) for t in draft_tokens[:i]] + [recovered], recovered, None)
    bonus = int(target_tokens[gamma])
    return Verdict(gamma, [int(t) for t in draft_tokens] + [bonus], None, bonus)
