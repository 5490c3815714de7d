"""The draft → verify loop: ``speculum.stream`` (a generator of chunks) and ``speculum.generate``.

Each block (Leviathan et al. 2023, Algorithm 1):

1. the drafter proposes up to γ tokens (:mod:`speculum.decoding.drafter`): a draft model samples them from
   its *warped* distribution and reports that distribution; a :class:`~speculum.models.Proposer` returns
   fixed tokens;
2. the target consumes ``[pending] + proposals`` in ONE ``extend`` call, which returns the γ + 1 rows
   needed (``pending`` is the last emitted token, not yet consumed by the target);
3. a pure rule from :mod:`speculum.decoding.verify` decides the emitted tokens;
4. the target and the drafter roll back the rejected tail: nothing is ever re-fed from the start.

With no draft (or γ = 0) the same loop is plain decoding: one target ``extend`` of one token per token.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .controller import GammaPolicy
from .drafter import Proposal, checked_rows, drafter_for
from .events import Chunk, DecodingStats, GenerationResult
from ..validation import check_int
from .plan import MODEL_EOS, Plan, make_rngs, plan_generation
from .verify import Verdict, verify_distribution, verify_greedy, verify_point_mass
from .warp import is_identity_warp, warp_logprobs

__all__ = ["generate", "generate_batch", "stream"]


class _Decoder:
    """One generation: the target's session, the context, the statistics; proposals come from a drafter."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.vocab_size = int(plan.target.vocab_size)
        self.stats = DecodingStats(draft_skipped=plan.draft_skipped)
        self.acceptance_rng, self.resampling_rng = plan.rngs[1], plan.rngs[2]
        self.greedy = plan.temperature == 0.0
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
        """The γ + 1 target rows (checked by :meth:`verify`): after ``pending`` and after each proposal."""
        if self.pending:
            return self.target.extend(self.pending + proposal.tokens)
        # a one-token prompt, or an empty one on a model with an initial distribution: the first row
        # needs no token
        first = self.target.next_logprobs()[None, :]
        return np.vstack([first, self.target.extend(proposal.tokens)]) if proposal.tokens else first

    def verify(self, proposal: Proposal, rows: np.ndarray, target_seconds: float, timed: bool = True) -> Chunk:
        """The block's verdict on the target's ``rows`` (γ + 1 of them), the rollbacks, and its chunk.
        ``timed=False``: ``target_seconds`` is not this block's verification cost (the forward also fed a
        prompt), so ``gamma="auto"`` does not learn from it."""
        stats, policy = self.stats, self.policy
        rows = checked_rows(rows, len(proposal.tokens) + 1, self.vocab_size, "target")
        stats.target_seconds += target_seconds
        stats.target_forwards += 1
        verdict = self._verify(proposal, rows)
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

    def _emit(self, context: list[int], verdict: Verdict, proposed: int, rows: np.ndarray) -> Chunk:
        """The block's chunk: its tokens cut at the budget and after eos, appended to ``context``; ``rows``:
        the block's target rows (row j is the law of emitted token j)."""
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
                     stop_reason is not None, stop_reason, stats, rows[: len(emitted)])


# ------------------------------------------------------------------------------------------ public API
def stream(target: Any, prompt_ids: Sequence[int], *, draft: Any = None, max_new_tokens: int = 64,
           gamma: int | str = 4, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, eos_token_id: Any = MODEL_EOS, seed: Any = None) -> Iterator[Chunk]:
    """Speculative decoding, streamed: yields one :class:`Chunk` per target forward.

    Guarantee: exact — the emitted tokens have exactly the law of plain sampling from the target with the
    same temperature / top-k / top-p; at ``temperature=0`` they are identical to plain greedy decoding.

    Args:
        target: a protocol model (``speculum.models``); ``.forward`` models (the compatibility API's) are
            adapted.
        prompt_ids: integer token ids (a list of Python / NumPy ints or an integer array; text, floats and
            bools are refused: call ``model.encode(text)``); empty only if the target has a BOS token or
            an initial distribution.
        draft: a model (distribution-aware verification), a proposer with ``propose(context, max_tokens)``
            (point-mass verification), or None (plain decoding). A draft model whose ``max_context``
            cannot hold the prompt is not used, and one whose window the context outgrows stops drafting
            there: plain decoding continues, and ``stats.draft_skipped`` says why.
        max_new_tokens: exact cap on emitted tokens (also capped by the target's ``max_context``).
        gamma: proposals per target forward, or ``"auto"`` (adapted from measured acceptance and costs).
        temperature: 0 = greedy; any finite value > 0 samples the tempered law (a vanishing one: uniform
            over the tied most probable tokens); top_k / top_p: applied identically to draft and target rows.
        eos_token_id: generation stops after emitting it (nothing after it is emitted). Default: the
            target's ``eos_token_id`` (no stop if it has none); ``None`` never stops early.
        seed: int / SeedSequence / Generator / None; split into drafting, acceptance, resampling streams.

    Arguments are validated before any model work (``InputError``, a ``ValueError``, naming the argument).
    Generations in concurrent threads may share one draft object: what ``gamma="auto"`` learns about a
    draft model is merged, never overwritten, and with a model whose sessions are independent, or a
    proposer whose proposals depend on the context only (:class:`~speculum.models.PromptLookup`), each
    gets exactly the output it gets alone.

    Example:
        >>> from speculum.models import MarkovModel
        >>> target = MarkovModel.random(6, seed=0); draft = MarkovModel.random(6, seed=1)
        >>> chunks = list(stream(target, [0], draft=draft, max_new_tokens=5, seed=0))
        >>> sum(len(c.tokens) for c in chunks)
        5
    """
    plan = plan_generation(target, prompt_ids, draft=draft, max_new_tokens=max_new_tokens, gamma=gamma,
                           temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
                           seed=seed)
    return _Decoder(plan).run()


def generate(target: Any, prompt_ids: Sequence[int], *, draft: Any = None, max_new_tokens: int = 64,
             gamma: int | str = 4, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: Any = MODEL_EOS, seed: Any = None) -> GenerationResult:
    """Speculative decoding, blocking: the new tokens (prompt excluded) and :class:`DecodingStats`.

    Guarantee: exact, as :func:`stream` (which it wraps; same arguments and defaults: it stops at the
    target's eos unless ``eos_token_id`` says otherwise).

    Example:
        >>> from speculum.models import MarkovModel
        >>> target = MarkovModel.random(6, seed=0)
        >>> plain = generate(target, [0], max_new_tokens=8, temperature=0)
        >>> fast = generate(target, [0], draft=MarkovModel.random(6, seed=1), max_new_tokens=8, temperature=0)
        >>> fast.tokens == plain.tokens
        True
    """
    tokens: list[int] = []
    stats, stop_reason = DecodingStats(), None
    for chunk in stream(target, prompt_ids, draft=draft, max_new_tokens=max_new_tokens, gamma=gamma,
                        temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, seed=seed):
        tokens.extend(chunk.tokens)
        stats, stop_reason = chunk.stats, chunk.stop_reason
    return GenerationResult(tokens, stats, stop_reason)



def generate_batch(target: Any, prompts: Sequence[Sequence[int]], *, draft: Any = None, max_new_tokens: int = 64,
                   gamma: int | str = 4, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None, eos_token_id: Any = MODEL_EOS, seed: Any = None,
                   max_batch: int = 16, batch_invariant: bool = False) -> list[GenerationResult]:
    """Speculative decoding of many prompts (an offline job): one :class:`GenerationResult` per prompt.

    Up to ``max_batch`` prompts are generated together (:class:`~speculum.decoding.batch.Scheduler`: one
    block of each per step, verified in one forward when the target declares ``batched_extend``).
    Every prompt is checked before any model work. ``seed`` gives each prompt its own independent streams
    (``SeedSequence.spawn``), so a prompt's output depends on its position in the list and the seed only.

    Guarantee: exact, as :func:`generate`, for every prompt; with ``batch_invariant=True`` (or a target
    without batched extend) each output is identical to :func:`generate` of that prompt with its seed
    alone, otherwise up to float rounding in the target's rows.

    Example:
        >>> from speculum.models import MarkovModel
        >>> target = MarkovModel.random(6, seed=0)
        >>> results = generate_batch(target, [[0], [1, 2]], max_new_tokens=4, temperature=0)
        >>> [len(r.tokens) for r in results]
        [4, 4]
    """
    from .batch import Scheduler

    check_int(max_batch, "max_batch", minimum=1)
    prompts = list(prompts)
    if isinstance(seed, np.random.Generator):
        seeds: list[Any] = list(seed.spawn(len(prompts)))
    elif seed is None:
        seeds = [None] * len(prompts)
    else:
        make_rngs(seed)                                      # the same check and message as generate's
        sequence = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
        seeds = list(sequence.spawn(len(prompts)))
    plans = [plan_generation(target, prompt, draft=draft, max_new_tokens=max_new_tokens, gamma=gamma,
                             temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
                             seed=prompt_seed)
             for prompt, prompt_seed in zip(prompts, seeds)]      # every prompt checked before any model work
    scheduler = Scheduler(target, batch_invariant=batch_invariant)
    max_batch = min(max_batch, scheduler.capacity or max_batch)
    tokens: list[list[int]] = [[] for _ in prompts]
    last: list[Any] = [None] * len(prompts)
    position: dict[int, int] = {}
    waiting = 0
    try:
        while waiting < len(prompts) or scheduler.active:
            while waiting < len(prompts) and scheduler.active < max_batch:
                position[scheduler.add_plan(plans[waiting])] = waiting
                waiting += 1
            for request, chunk in scheduler.step():
                tokens[position[request]].extend(chunk.tokens)
                last[position[request]] = chunk
    finally:
        scheduler.close()
    return [GenerationResult(out, chunk.stats if chunk else DecodingStats(), chunk.stop_reason if chunk else None)
            for out, chunk in zip(tokens, last)]
