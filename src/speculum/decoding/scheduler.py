"""Many generations at once: a :class:`Scheduler` advances every active generation by one block per step
(continuous batching: generations join and leave between steps).

Each step runs the three parts of a block for every generation: its drafter proposes, the target
computes the rows of every block (one batched call when the target declares
``Capabilities.batched_extend``, else one call per generation), and the pure verification rule decides
each block. Every generation keeps its own session, drafter and random streams, so its law is exactly
the target's whatever else runs. With ``batch_invariant=True`` (or a target without batched extend) each
generation's target calls are exactly those it makes alone, so its greedy tokens and seeded samples are
identical to its solo run. A batched call computes the same rows up to float rounding (other matrix
shapes), so at a near-tie a greedy token may differ from the solo run's, except on a target that declares
``Capabilities.canonical_rows`` (the PyTorch backend's fused forward): its rows are bitwise the same in
any batch, so packed verification keeps every solo output too, and it stays packed with
``batch_invariant=True``.

Example:
    >>> from speculum.models import MarkovModel
    >>> target = MarkovModel.random(6, seed=0)
    >>> scheduler = Scheduler(target)
    >>> first, second = scheduler.add([0], max_new_tokens=3, temperature=0), scheduler.add([1], max_new_tokens=5)
    >>> emitted = {first: 0, second: 0}
    >>> while scheduler.active:
    ...     for request, chunk in scheduler.step():
    ...         emitted[request] += len(chunk.tokens)
    >>> emitted == {first: 3, second: 5}
    True
"""
from __future__ import annotations

import time
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

from ..models.base import Feed, capabilities_of
from ..validation import check_int
from .events import Chunk, DecodingStats, GenerationResult
from .generation import Decoder
from .plan import MODEL_EOS, Plan, make_rngs, plan_generation

__all__ = ["Scheduler", "PackedCost", "generate_batch"]


class PackedCost:
    """The cost of a packed forward, ``seconds ≈ fixed + per_token · tokens`` (decayed least squares over
    the steps seen), used to charge each generation its part: ``fixed / B + per_token · its tokens``,
    scaled so the parts add up to the measured time. A generation's extra draft tokens are then charged
    what they add to the shared forward, so ``gamma="auto"`` stops drafting when, at this batch size,
    verifying them costs more than the tokens they bring. Until two batch sizes have been seen the time
    is split evenly. Before each step the fit is also each generation's cost model for that step
    (``fixed / B + per_token`` a plain step, B the blocks that run): the charges of past steps lag behind
    generations joining and leaving.

    Example:
        >>> cost = PackedCost()
        >>> for tokens in (4, 8, 16):
        ...     cost.observe(tokens, 0.01 + 0.001 * tokens)
        >>> [round(s, 4) for s in cost.split([1, 7], 0.018)]
        [0.006, 0.012]
    """

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self._n = self._t = self._tt = self._s = self._ts = 0.0     # decayed sums: 1, T, T², s, T·s

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self._n, self._t, self._tt = d * self._n + 1, d * self._t + tokens, d * self._tt + tokens * tokens
        self._s, self._ts = d * self._s + seconds, d * self._ts + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed, per_token) seconds, both >= 0; None while the token counts seen do not vary."""
        spread = self._n * self._tt - self._t * self._t
        if self._n < 2 or spread <= 1e-9 * max(1.0, self._tt * self._n):
            return None
        per_token = max(0.0, (self._n * self._ts - self._t * self._s) / spread)
        fixed = max(0.0, (self._s - per_token * self._t) / self._n)
        return fixed, per_token

    def split(self, fed: list[int], seconds: float) -> list[float]:
        """The seconds each block of a packed forward that fed ``fed`` tokens is charged (sum: ``seconds``)."""
        fitted = self.fit()
        if fitted is None:
            return [seconds / len(fed)] * len(fed)
        fixed, per_token = fitted
        parts = [fixed / len(fed) + per_token * n for n in fed]
        total = sum(parts)
        return [seconds * part / total for part in parts] if total > 0 else [seconds / len(fed)] * len(fed)


class Scheduler:
    """Generations on one target, advanced together one block per :meth:`step`.

    Guarantee: exact — every generation has the law of :func:`speculum.stream` with its own arguments,
    independent of the others; with ``batch_invariant=True``, or a target declaring ``canonical_rows``, its
    output is identical to its solo run (greedy tokens, seeded samples).
    """

    def __init__(self, target: Any, *, batch_invariant: bool = False, prompt_tokens_per_step: int = 512) -> None:
        check_int(prompt_tokens_per_step, "prompt_tokens_per_step", minimum=1)
        self.target = target
        self._decoders: dict[int, Decoder] = {}
        self._finished_at_start: dict[int, str] = {}   # id -> stop reason: nothing to generate
        self._next_id = 0
        declared = capabilities_of(target)
        # A target with canonical rows gives each generation its solo rows in a packed forward too, so it
        # keeps the packed forward even when asked for batch invariance.
        self.batched = declared.batched_extend and (declared.canonical_rows or not batch_invariant)
        # A new generation's prompt rides in the next packed forward instead of a forward of its own
        # (continuous batching with the prefill in the decode step): the others' blocks are verified
        # in the time of the prompt's forward, where a separate prefill would stall them.
        self.defer_prefill = self.batched and declared.deferred_prefill
        # At most this many prompt tokens per packed forward (oldest prompts first; a longer prompt is fed
        # in parts over several steps), so a long prompt joining delays the running generations' next
        # tokens by one bounded step, not by its whole prefill (chunked prefill).
        self.prompt_tokens_per_step = prompt_tokens_per_step
        # How many generations may run together (a target whose sessions share one state: one at a time).
        self.capacity: int | None = None if declared.independent_sessions else 1
        self.packed_cost = PackedCost()

    @property
    def active(self) -> int:
        """Generations that still emit (including those that end at their first step)."""
        return len(self._decoders) + len(self._finished_at_start)

    @property
    def decoders(self) -> Mapping[int, Decoder]:
        """The decoder of each generation that runs blocks, by id (a read-only view; a generation that ends
        at its first step has none)."""
        return MappingProxyType(self._decoders)

    def add(self, prompt_ids: Sequence[int], *, draft: Any = None, max_new_tokens: int = 64,
            gamma: int | str = 4, temperature: float = 1.0, top_k: int | None = None,
            top_p: float | None = None, eos_token_id: Any = MODEL_EOS, seed: Any = None,
            target_logprobs: bool = True) -> int:
        """Start a generation (the arguments of :func:`speculum.stream`, checked here); returns its id.
        It emits from the next :meth:`step` on; its prompt is fed now, or by that step's packed forward
        when the target declares ``deferred_prefill`` (and the scheduler is not batch-invariant)."""
        return self.add_plan(plan_generation(self.target, prompt_ids, draft=draft, max_new_tokens=max_new_tokens,
                                             gamma=gamma, temperature=temperature, top_k=top_k, top_p=top_p,
                                             eos_token_id=eos_token_id, seed=seed,
                                             target_logprobs=target_logprobs))

    def add_plan(self, plan: Plan) -> int:
        """Start a generation from checked arguments (:func:`~speculum.decoding.plan.plan_generation` for
        this target); returns its id."""
        request, self._next_id = self._next_id, self._next_id + 1
        decoder = Decoder(plan)
        # A draft made of the target's first layers reads the target's cache from its start: not deferred.
        if decoder.begin(defer=self.defer_prefill and not decoder.drafter.reads_target_cache):
            self._decoders[request] = decoder
        else:
            self._finished_at_start[request] = plan.budget_reason
        return request

    def cancel(self, request: int) -> None:
        """Stop a generation now (its reader went away); its session and drafter are released."""
        decoder = self._decoders.pop(request, None)
        if decoder is not None:
            decoder.close()
        self._finished_at_start.pop(request, None)

    def close(self) -> None:
        for request in list(self._decoders):
            self.cancel(request)

    def step(self) -> list[tuple[int, Chunk]]:
        """One block of every active generation: ``(id, chunk)`` pairs; a finished generation leaves. A
        generation whose prompt does not fit this step's prompt budget gets no chunk (its prompt is fed
        in part, or waits)."""
        out = [(request, Chunk([], 0, 0, None, None, True, reason, DecodingStats()))
               for request, reason in self._finished_at_start.items()]
        self._finished_at_start.clear()
        if not self._decoders:
            return out
        requests = list(self._decoders)
        decoders = [self._decoders[r] for r in requests]
        limits = self._prompt_limits(decoders)
        self._share_costs(decoders, limits)
        proposals = {i: decoder.propose() for i, decoder in enumerate(decoders) if limits[i] is None}
        # A step that also fed a prompt says nothing about what verifying a block costs.
        timed = not any(limit or (limit is None and decoder.prefilling) for limit, decoder in zip(limits, decoders))
        rows, seconds = self._target_rows(decoders, proposals, limits, timed)
        for i, proposal in proposals.items():
            request, decoder = requests[i], decoders[i]
            try:
                chunk = decoder.verify(proposal, rows[i], seconds[i], timed=timed)
            except Exception:
                self.cancel(request)
                raise
            out.append((request, chunk))
            if chunk.finished:
                self.cancel(request)
        return out

    def _share_costs(self, decoders: list[Decoder], limits: list[int | None]) -> None:
        """Tell each generation what its block will cost in this step's packed forward: the fitted forward
        cost shared by the blocks that run (:meth:`~speculum.decoding.gamma.costs.CostModel.share_forward`),
        so that ``gamma="auto"`` weighs a drafted row against the batch's current size."""
        fitted = self.packed_cost.fit() if self.batched else None
        blocks = sum(limit is None for limit in limits)
        for decoder in decoders:
            if fitted is None or blocks == 0:
                decoder.policy.forward_alone()
            else:
                decoder.policy.share_forward(*fitted, blocks)

    def _prompt_limits(self, decoders: list[Decoder]) -> list[int | None]:
        """Per generation: None when it runs a block this step (its prompt, if any is left, fed whole with
        it), else how many of its deferred prompt tokens to feed without a block (0: it waits)."""
        limits: list[int | None] = []
        budget = self.prompt_tokens_per_step
        for decoder in decoders:
            unfed = decoder.target.unfed if decoder.prefilling else 0
            if unfed <= budget:
                budget -= unfed
                limits.append(None)
            else:
                limits.append(budget)
                budget = 0
        return limits

    def _target_rows(self, decoders: list[Decoder], proposals: dict[int, Any], limits: list[int | None],
                     timed: bool) -> tuple[list[Any], list[float]]:
        """The target rows of every block (``proposals[i]``: generation i runs a block), and the seconds
        each block is charged; a generation with a prompt limit only feeds that part of its prompt. A
        batched call is split by :class:`PackedCost`, so ``gamma="auto"`` sees what its block adds to the
        shared forward (the cost model learns only from ``timed`` calls)."""
        feeding = [i for i, limit in enumerate(limits) if limit]
        batchable = sorted([i for i in proposals if decoders[i].pending] + feeding)
        rows: list[Any] = [None] * len(decoders)
        seconds = [0.0] * len(decoders)
        done: set[int] = set()
        if self.batched and len(batchable) > 1:
            inputs = [decoders[i].target_input(proposals[i]) if i in proposals else [] for i in batchable]
            feeds = [Feed(decoders[i].target, tokens, limits[i], i in proposals and decoders[i].greedy_tokens)
                     for i, tokens in zip(batchable, inputs)]
            started = time.perf_counter()
            batch = self.target.extend_sessions(feeds)
            elapsed = time.perf_counter() - started
            blocks = [j for j, i in enumerate(batchable) if i in proposals]
            fed = [len(inputs[j]) for j in blocks]
            if timed:
                self.packed_cost.observe(sum(fed), elapsed)
            for j, charge in zip(blocks, self.packed_cost.split(fed, elapsed) if blocks else []):
                rows[batchable[j]], seconds[batchable[j]] = batch[j], charge
            done.update(batchable)
        for i in feeding:
            if i not in done:
                decoders[i].target.feed_prompt(limits[i])
        for i, proposal in proposals.items():
            if i not in done:
                started = time.perf_counter()
                rows[i] = decoders[i].target_rows(proposal)
                seconds[i] = time.perf_counter() - started
        return rows, seconds


def generate_batch(target: Any, prompts: Sequence[Sequence[int]], *, draft: Any = None, max_new_tokens: int = 64,
                   gamma: int | str = 4, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None, eos_token_id: Any = MODEL_EOS, seed: Any = None,
                   max_batch: int = 16, batch_invariant: bool = False) -> list[GenerationResult]:
    """Speculative decoding of many prompts (an offline job): one :class:`GenerationResult` per prompt.

    Up to ``max_batch`` prompts are generated together (:class:`Scheduler`: one
    block of each per step, verified in one forward when the target declares ``batched_extend``).
    Every prompt is checked before any model work. ``seed`` gives each prompt its own independent streams
    (``SeedSequence.spawn``), so a prompt's output depends on its position in the list and the seed only.

    Guarantee: exact, as :func:`generate`, for every prompt; with ``batch_invariant=True`` (or a target
    without batched extend, or one declaring ``canonical_rows``) each output is identical to
    :func:`generate` of that prompt with its seed alone, otherwise up to float rounding in the target's rows.

    Example:
        >>> from speculum.models import MarkovModel
        >>> target = MarkovModel.random(6, seed=0)
        >>> results = generate_batch(target, [[0], [1, 2]], max_new_tokens=4, temperature=0)
        >>> [len(r.tokens) for r in results]
        [4, 4]
    """
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
                             seed=prompt_seed, target_logprobs=False)
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
