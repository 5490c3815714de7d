"""One generation's draft → verify loop, in steps: :class:`Decoder`.

Each block (Leviathan et al. 2023, Algorithm 1):

1. the drafter proposes up to γ tokens (:mod:`speculum.decoding.drafter`): a draft model samples them from
   its *warped* distribution and reports that distribution; a :class:`~speculum.models.Proposer` returns
   fixed tokens;
2. the target consumes ``[pending] + proposals`` in ONE ``extend`` call, which returns the γ + 1 rows
   needed (``pending`` is the last emitted token, not yet consumed by the target);
3. a pure rule from :mod:`speculum.decoding.verify` decides the emitted tokens;
4. the target and the drafter roll back the rejected tail: nothing is ever re-fed from the start.

With no draft (or γ = 0) the same loop is plain decoding: one target ``extend`` of one token per token.
:func:`speculum.stream` runs one :class:`Decoder` alone; :class:`~speculum.decoding.scheduler.Scheduler`
runs many, step by step, verifying their blocks in one packed forward.

Example:
    >>> from speculum.decoding.plan import plan_generation
    >>> from speculum.models import MarkovModel
    >>> target = MarkovModel.random(6, seed=0)
    >>> plan = plan_generation(target, [0, 1], draft=MarkovModel.random(6, seed=1), max_new_tokens=6, gamma=3,
    ...                        temperature=0, top_k=None, top_p=None, eos_token_id=None, seed=0)
    >>> decoder = Decoder(plan)
    >>> decoder.begin()
    True
    >>> proposal = decoder.propose()
    >>> chunk = decoder.verify(proposal, decoder.target_rows(proposal), target_seconds=0.0)
    >>> 1 <= len(chunk.tokens) <= len(proposal.tokens) + 1
    True
    >>> decoder.close()
"""
from __future__ import annotations

import time
from functools import partial
from typing import Callable, Iterator

import numpy as np

from ..models.base import capabilities_of
from .gamma.controller import GammaPolicy
from .drafter import Proposal, checked_rows, checked_tokens, drafter_for
from .events import Chunk, DecodingStats
from .plan import Plan
from .verify import Verdict, verify_distribution, verify_greedy, verify_greedy_tokens, verify_point_mass
from .warp import is_identity_warp, warp_logprobs

__all__ = ["Decoder"]


class Decoder:
    """One generation: the target's session, the context, the statistics; proposals come from a drafter
    (:func:`~speculum.decoding.drafter.drafter_for`).

    :meth:`run` yields its chunks alone. A scheduler drives the same block in three steps instead —
    :meth:`propose`, the target's forward (:meth:`target_input` is what it feeds; :meth:`target_rows` runs
    it alone), :meth:`verify` — so that the forwards of many generations can be packed into one.

    Guarantee: exact — every chunk's tokens have the law of plain sampling from the target under the
    plan's temperature / top-k / top-p (greedy: the tokens of plain greedy decoding), whichever rows of
    the target's law :meth:`verify` is given, as long as they are the target's rows for
    :meth:`target_input`.
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.vocab_size = int(plan.target.vocab_size)
        capabilities = capabilities_of(plan.target)
        self.normalised_rows = capabilities.normalised_rows    # checked where computed
        self.stats = DecodingStats(draft_skipped=plan.draft_skipped)
        self.acceptance_rng, self.resampling_rng = plan.rngs[1], plan.rngs[2]
        self.greedy = plan.temperature == 0.0
        # Greedy verification reads only each row's argmax: a target that gives it without the rows
        # saves a pass of exp over the vocabulary a row, unless the chunks must carry the rows.
        self.greedy_tokens = self.greedy and not plan.target_logprobs and capabilities.greedy_tokens
        self.warp: Callable[[np.ndarray], np.ndarray]
        if self.greedy or is_identity_warp(plan.temperature, plan.top_k, plan.top_p, self.vocab_size):
            self.warp = lambda rows: rows
        else:
            self.warp = partial(warp_logprobs, temperature=plan.temperature, top_k=plan.top_k, top_p=plan.top_p)
        self.policy = GammaPolicy(plan.gamma, draft_kind=plan.draft_kind, greedy=self.greedy, seeded=plan.seeded)
        self.drafter = drafter_for(plan, self.policy, self.stats, self.warp)

    def run(self) -> Iterator[Chunk]:
        if not self.begin():
            return
        try:
            while True:
                proposal = self.propose()
                t1 = time.perf_counter()
                rows = self.target_rows(proposal)
                chunk = self.verify(proposal, rows, time.perf_counter() - t1)
                yield chunk
                if chunk.finished:
                    return
        finally:
            self.close()

    # One block in three steps, so that a scheduler can verify the blocks of many generations together:
    # propose (drafter), target rows (the target's forward: batched across generations by the caller),
    # verify (the pure rule, rollbacks, the chunk).
    def begin(self, defer: bool = False) -> bool:
        """Prefill the target and start the drafter; False when there is nothing to generate. With
        ``defer`` (a target declaring ``deferred_prefill``) the prompt is fed by the first block's forward,
        which a scheduler packs with the other generations' blocks."""
        plan = self.plan
        self.context = list(plan.prompt)                 # prompt + emitted tokens
        self.started = time.perf_counter()
        if plan.budget == 0:
            return False
        # Prefill all but the last prompt token: it becomes the first `pending` token, so every block is
        # exactly one target extend([pending] + proposals) returning the γ + 1 rows it needs. A one-token
        # prompt is prefilled whole: an empty session starts from the model's BOS, another context.
        self.deferred = defer and len(self.context) > 1  # a session of start_deferred, which counts `unfed`
        if len(self.context) == 1:
            self.target = plan.target.start(self.context)
            self.pending = []
        elif defer:
            self.target = plan.target.start_deferred(self.context[:-1])
            self.pending = self.context[-1:]
        else:
            self.target = plan.target.start(self.context[:-1])
            self.pending = self.context[-1:]
        self.stats.target_seconds += time.perf_counter() - self.started
        self.drafter.start(self.context, self.target)
        return True

    def propose(self) -> Proposal:
        t0 = time.perf_counter()
        proposal = self.drafter.propose(self.context, self.plan.budget - self.stats.emitted)
        self.stats.draft_seconds += time.perf_counter() - t0
        return proposal

    @property
    def prefilling(self) -> bool:
        """The target session holds prompt tokens it has not fed yet (a deferred prefill): its next forward
        feeds them."""
        return self.deferred and self.target.unfed > 0

    def target_input(self, proposal: Proposal) -> list[int]:
        """The tokens the target consumes this block (empty ``pending``: see :meth:`target_rows`)."""
        return self.pending + proposal.tokens

    def target_rows(self, proposal: Proposal) -> np.ndarray:
        """The γ + 1 target rows (checked by :meth:`verify`): after ``pending`` and after each proposal;
        with :attr:`greedy_tokens`, their ``(γ + 1,)`` greedy tokens instead."""
        if self.pending:
            if self.greedy_tokens:
                return self.target.extend_greedy(self.pending + proposal.tokens)
            return self.target.extend(self.pending + proposal.tokens)
        # a one-token prompt, or an empty one on a model with an initial distribution: the first row
        # needs no token
        first = self.target.next_logprobs()[None, :]
        rows = np.vstack([first, self.target.extend(proposal.tokens)]) if proposal.tokens else first
        return rows.argmax(axis=-1) if self.greedy_tokens else rows

    def verify(self, proposal: Proposal, rows: np.ndarray, target_seconds: float, timed: bool = True) -> Chunk:
        """The block's verdict on the target's ``rows`` (γ + 1 of them), the rollbacks, and its chunk.
        ``timed=False``: ``target_seconds`` is not this block's verification cost (the forward also fed a
        prompt), so ``gamma="auto"`` does not learn from it."""
        stats, policy = self.stats, self.policy
        if self.greedy_tokens:
            verdict = verify_greedy_tokens(proposal.tokens, checked_tokens(rows, len(proposal.tokens) + 1,
                                                                            self.vocab_size, "target"))
            rows = None
        else:
            rows = checked_rows(rows, len(proposal.tokens) + 1, self.vocab_size, "target",
                                normalised=self.normalised_rows)
            verdict = self._verify(proposal, rows)
        stats.target_seconds += target_seconds
        stats.target_forwards += 1
        proposed = len(proposal.tokens)
        stats.record_block(proposed, verdict.accepted)
        policy.observe_verification(len(self.pending) + proposed, target_seconds if timed else None,
                                    proposed=proposed, accepted=verdict.accepted, key=proposal.key)
        self.target.rollback(proposed - verdict.accepted)   # the target consumed every proposal
        self.drafter.verified(verdict.accepted)
        chunk = self._emit(self.context, verdict, proposed, rows)
        stats.total_seconds = time.perf_counter() - self.started
        self.pending = chunk.tokens[-1:]
        return chunk

    def close(self) -> None:
        self.drafter.finish()

    def _verify(self, proposal: Proposal, target_rows: np.ndarray) -> Verdict:
        if self.greedy:
            return verify_greedy(proposal.tokens, target_rows)
        warped = self.warp(target_rows)
        if proposal.draft_logprobs is not None:
            return verify_distribution(proposal.tokens, proposal.draft_logprobs, warped,
                                       self.acceptance_rng, self.resampling_rng)
        # Fixed tokens, or no proposal at all (a plain step: the bonus token is a plain sample).
        return verify_point_mass(proposal.tokens, warped, self.acceptance_rng, self.resampling_rng)

    def _emit(self, context: list[int], verdict: Verdict, proposed: int, rows: np.ndarray | None) -> Chunk:
        """The block's chunk: its tokens cut at the budget and after eos, appended to ``context``; ``rows``:
        the block's target rows (row j is the law of emitted token j), None where only greedy tokens were
        computed."""
        plan, stats = self.plan, self.stats
        emitted = verdict.emitted[: plan.budget - stats.emitted]
        stop_reason = None
        if plan.eos_token_id is not None and plan.eos_token_id in emitted:
            emitted = emitted[: emitted.index(plan.eos_token_id) + 1]
            stop_reason = "eos"
        context.extend(emitted)
        stats.emitted += len(emitted)
        if stop_reason is None and stats.emitted >= plan.budget:
            stop_reason = plan.budget_reason
        return Chunk(emitted, proposed, verdict.accepted, verdict.recovered, verdict.bonus,
                     stop_reason is not None, stop_reason, stats, None if rows is None else rows[: len(emitted)])
