"""Where proposals come from: one :class:`Drafter` per generation turns the context into the next block's
:class:`Proposal` and, once the block is verified, keeps its own state on a prefix of the new context.

* :class:`PlainDrafter` — no draft: every block is a plain step.
* :class:`ProposerDrafter` — fixed tokens from a :class:`~speculum.models.Proposer` (point-mass
  verification). With ``gamma="auto"`` and a :class:`~speculum.decoding.plan.MatchingProposer`, the
  evidence behind the proposal is read first and γ chosen knowing it.
* :class:`ModelDrafter` — a draft model sampling from its warped rows (distribution-aware verification).
  It runs the draft's whole lifecycle: its session, the lazy start behind a timed trial, the catch-up on
  tokens it missed, reading the target's cache when it is the target's first layers, and the stop when the
  context outgrows its window.

γ is the policy's (:class:`~speculum.decoding.gamma.controller.GammaPolicy`); what it learns about a draft model
outlives the generation in the draft's :class:`~speculum.decoding.gamma.profile.DraftProfile`. Verification is
the loop's, with the pure rules of :mod:`speculum.decoding.verify`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import numpy as np

from ..models.base import Session, capabilities_of, check_token_ids
from ..validation import InputError
from .gamma.controller import GammaPolicy, situation_key
from .events import DecodingStats
from .plan import Plan
from .gamma.profile import profile_of
from .warp import sample_from_logprobs

__all__ = ["Proposal", "Drafter", "PlainDrafter", "ProposerDrafter", "ModelDrafter", "drafter_for",
           "checked_rows"]

_ROW_MASS_TOLERANCE = 1e-6
_TRIAL_TOKENS = 8    # context tokens a draft model reads in its timed trial (ModelDrafter._start_after_trial)


@dataclass(frozen=True)
class Proposal:
    """One block's proposal.

    ``tokens``: the proposed tokens (none: a plain step). ``draft_logprobs``: ``(len(tokens), vocab)``, the
    warped rows a draft model sampled them from (distribution-aware verification), or None for fixed
    tokens (point-mass verification). ``key``: the situation whose acceptance statistics the block's
    outcome feeds (None: the pooled ones).
    """

    tokens: list[int]
    draft_logprobs: np.ndarray | None = None
    key: Hashable = None


_NOTHING = Proposal([])


def checked_rows(rows: Any, expected: int, vocab_size: int, name: str, *, normalised: bool = False) -> np.ndarray:
    """Cheap check of rows a model returned: shape, no NaN / +inf, some mass, normalised (fail at the origin).
    ``normalised``: the model checks its rows where it computes them (``Capabilities.normalised_rows``), and
    only the shape is checked here."""
    rows = np.asarray(rows, dtype=np.float64)
    if rows.shape != (expected, vocab_size):
        raise InputError(f"{name} returned log-probs of shape {rows.shape}, expected ({expected}, {vocab_size})")
    if normalised:
        return rows
    # One pass: NaN or +inf make the mass NaN / inf, an all -inf row makes it 0; all fail the comparison.
    mass = np.exp(rows).sum(axis=-1)                                            # (expected,)
    if not np.abs(mass - 1.0).max() <= _ROW_MASS_TOLERANCE:
        if np.isnan(rows).any() or np.isposinf(rows).any() or not (mass > 0).all():
            raise InputError(f"{name} returned a log-prob row with NaN, +inf or no finite entry")
        raise InputError(f"{name} returned log-probs that are not normalised "
                         f"(row mass {mass.min():.6g}..{mass.max():.6g})")
    return rows


def checked_tokens(tokens: Any, expected: int, vocab_size: int, name: str) -> np.ndarray:
    """Check of greedy tokens a model returned (``Capabilities.greedy_tokens``): ``(expected,)`` integer
    ids in the vocabulary (fail at the origin)."""
    array = np.asarray(tokens)
    if array.shape != (expected,) or not np.issubdtype(array.dtype, np.integer):
        raise InputError(f"{name} returned greedy tokens of shape {array.shape} and dtype {array.dtype}, "
                         f"expected ({expected},) integers")
    if expected and not (0 <= array.min() and array.max() < vocab_size):
        raise InputError(f"{name} returned a greedy token outside its vocabulary of {vocab_size}")
    return array


class Drafter:
    """What the loop drafts through. Each generation has its own drafter; the draft object behind it may
    be shared by concurrent generations."""

    # True when :meth:`start` reads the target session's cache (a draft made of the target's first
    # layers), which must then hold the prompt: the target's prefill is not deferred.
    reads_target_cache = False

    def start(self, context: list[int], target_session: Session) -> None:
        """The target has read ``context`` but its last token into ``target_session``."""

    def propose(self, context: list[int], remaining: int) -> Proposal:
        """The next block's proposal after ``context``: at most ``remaining - 1`` tokens, so that the block
        (proposals and the target's own token) never emits more than ``remaining``."""
        return _NOTHING

    def verified(self, accepted: int) -> None:
        """The first ``accepted`` tokens of the last proposal were accepted: the context grows by those and
        one target token."""

    def finish(self) -> None:
        """The generation ended, or was abandoned: keep what later generations may use."""


class PlainDrafter(Drafter):
    """No draft: every block is a plain step, one target token per forward."""


class ProposerDrafter(Drafter):
    """Fixed-token proposals from a proposer (verified as point masses, exact for any proposal)."""

    def __init__(self, plan: Plan, policy: GammaPolicy) -> None:
        self.proposer, self.policy = plan.draft, policy
        self.vocab_size, self.eos_token_id = int(plan.target.vocab_size), plan.eos_token_id
        self.reports_match = plan.draft_reports_match

    def propose(self, context: list[int], remaining: int) -> Proposal:
        started = time.perf_counter()
        proposal = self._propose(context, max(remaining - 1, 0))
        self.policy.observe_draft(len(proposal.tokens), time.perf_counter() - started)
        return proposal

    def _propose(self, context: list[int], cap: int) -> Proposal:
        key = None
        if self.reports_match and self.policy.adaptive:
            # The evidence first (one proposed token), then γ chosen knowing how well the proposal matched,
            # and only then γ tokens: most steps draft nothing, and an n-gram proposal costs a vocabulary
            # row per token.
            cap = self.policy.longest(cap)
            proposal, match = self.proposer.propose_with_match(context, 1) if cap > 0 else ([], 0)
            if not proposal:
                return _NOTHING
            key = situation_key(match)
            gamma = self.policy.lookahead(cap, key)
            if gamma > 1:
                proposal, _ = self.proposer.propose_with_match(context, gamma)
        else:
            gamma = self.policy.lookahead(cap)
            proposal = self.proposer.propose(context, gamma) if gamma > 0 else []
        tokens = check_token_ids(proposal, self.vocab_size, name="draft proposal")[:gamma]
        if self.eos_token_id in tokens:
            tokens = tokens[: tokens.index(self.eos_token_id) + 1]
        return Proposal(tokens, None, key)


class ModelDrafter(Drafter):
    """A draft model's proposals, sampled from the rows it reports, and the draft's lifecycle.

    The session stays on a prefix of the context: ``consumed`` tokens read, the rest (the tokens emitted
    since, at least the target's last one) read at the next proposal. With ``gamma="auto"`` (timed) the
    session starts only when γ first asks for a proposal, after a trial shows that drafting can pay, so
    the prompt prefill of a draft that cannot pay is never spent.
    """

    def __init__(self, plan: Plan, policy: GammaPolicy, stats: DecodingStats,
                 warp: Callable[[np.ndarray], np.ndarray]) -> None:
        self.model, self.target, self.policy, self.stats, self.warp = plan.draft, plan.target, policy, stats, warp
        self.capabilities = capabilities_of(plan.draft)
        self.reads_target_cache = self.capabilities.shares_prefix_cache and self.model.prefix_of is self.target
        self.max_context = plan.draft_max_context
        self.greedy, self.rng = plan.temperature == 0.0, plan.rngs[0]
        self.vocab_size, self.eos_token_id = int(plan.target.vocab_size), plan.eos_token_id
        # A seeded sampler's γ must not depend on earlier calls: its policy is untimed, so no profile.
        self.profile = profile_of(plan.draft) if policy.timed else None
        self.recalled_version = 0
        if self.profile is not None:
            remembered, self.recalled_version = self.profile.acceptance()
            policy.recall(remembered)
        self.session: Session | None = None
        self.waiting = False                  # to start at its first proposal, after a trial
        self.shares_target_layers = False     # the draft reads the target's cache (its first layers)
        self.target_session: Session | None = None
        self.consumed = 0                     # context tokens the session has read
        self.block = (0, 0)                   # (context length, tokens proposed) of the last proposal

    def start(self, context: list[int], target_session: Session) -> None:
        started = time.perf_counter()
        self.target_session = target_session
        if self.reads_target_cache:
            self.session = self.model.start_sharing(target_session)       # None: layout not shareable
            self.shares_target_layers = self.session is not None
        if self.session is None:
            if self.policy.timed:
                self.waiting = True
            else:
                self.session = self._open(context)
        self.stats.draft_seconds += time.perf_counter() - started

    def propose(self, context: list[int], remaining: int) -> Proposal:
        self.block = (len(context), 0)
        if self.session is None and not self.waiting:
            return _NOTHING
        if self.max_context is not None and len(context) > self.max_context:
            # Proposing one token means reading the whole context: past the draft's window it can no longer
            # propose, so the rest is plain decoding (exact anyway).
            self.session, self.waiting = None, False
            self.stats.draft_skipped = (f"the context reached {len(context)} tokens, more than the draft's "
                                        f"max_context {self.max_context}: drafting stopped there")
            return _NOTHING
        started = time.perf_counter()
        cap = remaining - 1
        if self.max_context is not None:
            cap = min(cap, self.max_context - len(context) + 1)   # it reads the context and γ − 1 proposals
        # A draft re-reads what it missed during plain steps, unless it reads the target's cache.
        backlog = 0 if self.shares_target_layers else len(context) - self.consumed
        gamma = self.policy.lookahead(max(cap, 0), backlog=backlog)
        if gamma == 0:
            return _NOTHING
        setup = 0.0
        if self.session is None:
            self.session, self.waiting = self._start_after_trial(context, remaining), False
            setup = time.perf_counter() - started          # a one-off: not a per-token drafting cost
            if self.session is None:
                return _NOTHING
        tokens, rows = self._sample(context, gamma)
        self.block = (len(context), len(tokens))
        self.policy.observe_draft(len(tokens), time.perf_counter() - started - setup)
        return Proposal(tokens, rows)

    def verified(self, accepted: int) -> None:
        length, proposed = self.block
        if proposed and self.session is not None:
            # The draft read every proposal but the last: it keeps the accepted ones among them.
            kept = min(accepted, proposed - 1)
            self.session.rollback(proposed - 1 - kept)
            self.consumed = length + kept

    def finish(self) -> None:
        if self.profile is not None:
            self.profile.publish(self.policy.remembered(), since=self.recalled_version)

    # ------------------------------------------------------------------------------------------ drafting
    def _sample(self, context: list[int], gamma: int) -> tuple[list[int], np.ndarray | None]:
        """Up to γ proposals sampled from the draft's warped rows (argmax when greedy); returns the tokens
        and, when sampling, exactly the rows they were sampled from."""
        session = self.session
        if self.shares_target_layers:
            # The draft is the target's first blocks: their keys and values come from the target's cache (it
            # holds everything but the pending token) instead of a draft forward over accepted tokens.
            session.adopt_prefix_layers(self.target_session)
            self.consumed = session.length
        backlog = context[self.consumed:]
        if not backlog:
            row = session.next_logprobs()
        else:
            started = time.perf_counter()
            # Catching up needs only the row after the last token.
            row = session.advance(backlog) if self.capabilities.session_advance else session.extend(backlog)[-1]
            self.policy.observe_catch_up(len(backlog), time.perf_counter() - started)
        self.consumed = len(context)
        self.stats.draft_forwards += 1
        tokens: list[int] = []
        reported: list[np.ndarray] = []
        for i in range(gamma):
            row = checked_rows(row[None, :], 1, self.vocab_size, "draft")[0]
            if self.greedy:
                token = int(np.argmax(row))
                unsure = self.policy.stops_after(float(np.exp(row[token])))
            else:
                warped = self.warp(row)
                token = sample_from_logprobs(warped, float(self.rng.random()))
                reported.append(warped)
                unsure = False
            tokens.append(token)
            if token == self.eos_token_id or i == gamma - 1 or unsure:
                break
            row = session.extend([token])[0]
            self.stats.draft_forwards += 1
        return tokens, (np.stack(reported) if reported else None)

    # --------------------------------------------------------------------------------------- lifecycle
    def _start_after_trial(self, context: list[int], tokens_left: int) -> Session | None:
        """The draft's session, or None when its timings show drafting cannot pay.

        Without timings in the draft's profile, a trial reads the last ``_TRIAL_TOKENS`` context tokens
        (timing the draft's reading rate, so its cost for the whole context can be estimated) and times two
        decode steps (best of two); the timings go to the profile for later generations. A draft that loses
        is thus rejected for the price of a short read, or for nothing, instead of a read of the whole
        context. A context no longer than the trial is read once: the trial session is then the real one.
        """
        if len(context) < 2:
            return self._open(context)
        known = self.profile.timings() if self.profile is not None else None
        session = None
        trial = context[-_TRIAL_TOKENS - 1:]
        if known is None:
            started = time.perf_counter()
            session = self.model.start(trial[:-1])
            read = time.perf_counter() - started
            step = float("inf")
            for _ in range(2):
                started = time.perf_counter()
                session.extend(trial[-1:])
                step = min(step, time.perf_counter() - started)
                session.rollback(1)
            # Reading n tokens costs about one call (a step) plus n - 1 times the marginal rate.
            read_rate = max(read - step, 0.0) / max(len(trial) - 2, 1)
            self.policy.observe_catch_up(len(trial) - 1, read)
            if self.profile is not None:
                self.profile.record_timings(step, read_rate)
        else:
            step, read_rate = known
            # What the trial's read would have told the policy (its catch-up cost estimate).
            self.policy.observe_catch_up(_TRIAL_TOKENS, step + read_rate * (_TRIAL_TOKENS - 1))
        reread = 0 if session is not None and len(trial) == len(context) else len(context) - 1
        if not self.policy.draft_can_pay(step, setup_seconds=read_rate * reread, tokens_left=tokens_left):
            target_step = self.policy.step_seconds()
            self.stats.draft_skipped = (
                f"a draft step costs {step / target_step:.2f} target steps and reading the context "
                f"~{read_rate * reread / target_step:.0f}: drafting cannot pay, so the draft model was not used")
            return None
        if reread:
            return self._open(context)
        self.consumed = len(context) - 1
        return session

    def _open(self, context: list[int]) -> Session:
        """A session over all but the last context token (the target's ``pending``)."""
        self.consumed = max(len(context) - 1, 0)
        return self.model.start(context[:-1])


def drafter_for(plan: Plan, policy: GammaPolicy, stats: DecodingStats,
                warp: Callable[[np.ndarray], np.ndarray]) -> Drafter:
    """The drafter of ``plan``'s draft (its kind was classified where the draft entered)."""
    if plan.draft_kind == "model":
        return ModelDrafter(plan, policy, stats, warp)
    if plan.draft_kind == "proposer":
        return ProposerDrafter(plan, policy)
    return PlainDrafter()
