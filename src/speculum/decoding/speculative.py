"""The draft → verify loop: ``speculum.stream`` (a generator of chunks) and ``speculum.generate``.

Each iteration (Leviathan et al. 2023, Algorithm 1):

1. the draft proposes up to γ tokens — a model samples them from its *warped* distribution and reports
   that distribution; a :class:`~speculum.models.Proposer` returns fixed tokens;
2. the target consumes ``[pending] + proposals`` in ONE ``extend`` call, which returns the γ + 1 rows
   needed (``pending`` is the last emitted token, not yet consumed by the target);
3. a pure rule from :mod:`speculum.decoding.verify` decides the emitted tokens;
4. both sessions roll back the rejected tail — nothing is ever re-fed from the start.

With no draft (or γ = 0) the same loop is plain decoding: one target ``extend`` of one token per token.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..models.base import check_token_ids
from .controller import GammaController, situation_key
from .events import Chunk, DecodingStats, GenerationResult
from .plan import MODEL_EOS, Plan, plan_generation
from .verify import verify_distribution, verify_greedy, verify_point_mass
from .warp import is_identity_warp, sample_from_logprobs, warp_logprobs

__all__ = ["generate", "stream"]

_ROW_MASS_TOLERANCE = 1e-6
_TRIAL_TOKENS = 8    # context tokens a draft model reads in its timed trial (gamma="auto", _start_draft)


@dataclass
class _DraftMemory:
    """What ``gamma="auto"`` keeps per draft model object for the life of the process."""

    # The trial's timings (step seconds, marginal read seconds per token): later generations with the same
    # draft decide without a trial. On SmolLM2 with the fused forward a trial costs 2-4 % of 128 tokens.
    timings: tuple[float, float] | None = None
    # The latest timed controller: a new generation starts from its pooled acceptance and probe back-off
    # (GammaController.recall), so a draft that rarely agrees is not re-probed from scratch each time. Not
    # for untimed controllers (seeded sampling): their γ sequence must not depend on earlier calls.
    controller: GammaController | None = None


_DRAFT_MEMORY: "weakref.WeakKeyDictionary[Any, _DraftMemory]" = weakref.WeakKeyDictionary()


# -------------------------------------------------------------------------------------- checked rows
def _checked_rows(rows: Any, expected: int, vocab_size: int, name: str) -> np.ndarray:
    """Cheap check of rows a model returned: shape, no NaN / +inf, some mass, normalised (fail at the origin)."""
    rows = np.asarray(rows, dtype=np.float64)
    if rows.shape != (expected, vocab_size):
        raise ValueError(f"{name} returned log-probs of shape {rows.shape}, expected ({expected}, {vocab_size})")
    # One pass: NaN or +inf make the mass NaN / inf, an all -inf row makes it 0; all fail the comparison.
    mass = np.exp(rows).sum(axis=-1)                                            # (expected,)
    if not np.abs(mass - 1.0).max() <= _ROW_MASS_TOLERANCE:
        if np.isnan(rows).any() or np.isposinf(rows).any() or not (mass > 0).all():
            raise ValueError(f"{name} returned a log-prob row with NaN, +inf or no finite entry")
        raise ValueError(f"{name} returned log-probs that are not normalised (row mass {mass.min():.6g}..{mass.max():.6g})")
    return rows


# -------------------------------------------------------------------------------------------- the loop
class _Decoder:
    """State of one generation: both sessions, the context, the streams, the statistics."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.vocab_size = int(plan.target.vocab_size)
        self.stats = DecodingStats(draft_skipped=plan.draft_skipped)
        self.drafting_rng, self.acceptance_rng, self.resampling_rng = plan.rngs
        self.greedy = plan.temperature == 0.0
        self.warp: Callable[[np.ndarray], np.ndarray]
        if self.greedy or is_identity_warp(plan.temperature, plan.top_k, plan.top_p, self.vocab_size):
            self.warp = lambda rows: rows
        else:
            self.warp = partial(warp_logprobs, temperature=plan.temperature, top_k=plan.top_k, top_p=plan.top_p)
        self.controller = None
        if plan.gamma == "auto" and plan.draft_kind != "none":
            # A seeded sampler must be reproducible run to run, but γ decides which random numbers are
            # drawn: so it then follows a fixed cost model instead of (noisy) wall-clock timings.
            self.controller = GammaController(
                timed=not (plan.seeded and not self.greedy),
                prior_draft_ratio=0.1 if plan.draft_kind == "model" else 0.0)
            memory = _draft_memory(plan.draft) if plan.draft_kind == "model" and self.controller.timed else None
            if memory is not None:
                earlier, memory.controller = memory.controller, self.controller
                if earlier is not None:
                    self.controller.recall(earlier.remembered())
        self.context = list(plan.prompt)          # prompt + emitted tokens
        self.key: Any = None                      # the controller's situation key for this block
        self.shares_target_layers = False         # the draft reads the target's KV cache (truncated_draft)
        self.target_session: Any = None
        self.draft_consumed = 0                   # context tokens the draft session has consumed
        self.draft_max_context = getattr(plan.draft, "max_context", None) if plan.draft_kind == "model" else None

    # ------------------------------------------------------------------------------------------ drafting
    def _draft_fits(self) -> bool:
        """Whether the draft model can still propose: it reads the whole context to propose one token."""
        return self.draft_max_context is None or len(self.context) <= self.draft_max_context

    def _gamma_cap(self, remaining: int) -> int:
        """Most proposals this block may carry."""
        cap = remaining - 1                      # never overshoot: a block emits at most γ + 1 tokens
        if self.draft_max_context is not None:
            # The draft consumes the context plus γ − 1 proposals.
            cap = min(cap, self.draft_max_context - len(self.context) + 1)
        return max(cap, 0)

    def _gamma(self, remaining: int, key: Any = None) -> int:
        if self.plan.draft_kind == "none":
            return 0
        if self.controller is None:
            gamma = int(self.plan.gamma)
        else:
            # A draft model re-reads what it missed during plain steps (not one reading the target's cache).
            backlog = (len(self.context) - self.draft_consumed
                       if self.plan.draft_kind == "model" and not self.shares_target_layers else 0)
            gamma = self.controller.next_gamma(key, backlog=backlog)
        return max(min(gamma, self._gamma_cap(remaining)), 0)

    def _draft_with_model(self, session: Any, gamma: int) -> tuple[list[int], np.ndarray | None]:
        """Sample up to γ proposals from the draft's warped rows; returns tokens and those exact rows."""
        if self.shares_target_layers:
            # The draft is the target's first blocks: take their keys and values from the target's cache
            # (it holds everything but the pending token) instead of running the draft over accepted tokens.
            session.adopt_prefix_layers(self.target_session)
            self.draft_consumed = session.length
        backlog = self.context[self.draft_consumed:]
        if not backlog:
            row = session.next_logprobs()
        else:
            t0 = time.perf_counter()
            if callable(getattr(session, "advance", None)):
                row = session.advance(backlog)     # catching up needs only the last row
            else:
                row = session.extend(backlog)[-1]
            if self.controller is not None:
                self.controller.observe_catch_up(len(backlog), time.perf_counter() - t0)
        self.draft_consumed = len(self.context)
        self.stats.draft_forwards += 1
        tokens: list[int] = []
        reported: list[np.ndarray] = []
        for i in range(gamma):
            row = _checked_rows(row[None, :], 1, self.vocab_size, "draft")[0]
            if self.greedy:
                token = int(np.argmax(row))
                confidence = float(np.exp(row[token]))
            else:
                warped = self.warp(row)
                token = sample_from_logprobs(warped, float(self.drafting_rng.random()))
                confidence = 1.0                 # unused when sampling (see below)
                reported.append(warped)
            tokens.append(token)
            # Greedy: a draft unsure of its argmax rarely matches the target's, so stop drafting after (never
            # instead of) such a proposal. Not when sampling: there acceptance is min(1, p_t/p_d), unrelated
            # to how peaked the draft is (a flat draft equal to the target is always accepted).
            if token == self.plan.eos_token_id or i == gamma - 1 or (
                    self.greedy and self.controller is not None and self.controller.stop_drafting(confidence)):
                break
            row = session.extend([token])[0]
            self.stats.draft_forwards += 1
        return tokens, (np.stack(reported) if reported else None)

    def _start_draft(self, tokens_left: int) -> Any:
        """Start the draft model's session, or None when its timings show drafting cannot pay.

        The first time a draft model is used in this process, a trial reads the last ``_TRIAL_TOKENS``
        context tokens (timing the draft's reading rate, so its cost for the whole context can be
        estimated) and times two decode steps (best of two); the timings are kept for later generations
        with the same draft. A draft that loses is thus rejected for the price of a short read (or for
        nothing) instead of a read of the whole context. A context no longer than the trial is read once:
        the trial session is then the real one.
        """
        draft, context = self.plan.draft, self.context
        if len(context) < 2:
            return self._open_draft_session()
        memory = _draft_memory(draft)
        known = memory.timings if memory is not None else None
        session = None
        trial = context[-_TRIAL_TOKENS - 1:]
        if known is None:
            t0 = time.perf_counter()
            session = draft.start(trial[:-1])
            read = time.perf_counter() - t0
            step = float("inf")
            for _ in range(2):
                t0 = time.perf_counter()
                session.extend(trial[-1:])
                step = min(step, time.perf_counter() - t0)
                session.rollback(1)
            # Reading n tokens costs about one call (a step) plus n - 1 times the marginal rate.
            read_rate = max(read - step, 0.0) / max(len(trial) - 2, 1)
            self.controller.observe_catch_up(len(trial) - 1, read)
            if memory is not None:
                memory.timings = (step, read_rate)
        else:
            step, read_rate = known
            # What the trial's read would have told the controller (its catch-up cost estimate).
            self.controller.observe_catch_up(_TRIAL_TOKENS, step + read_rate * (_TRIAL_TOKENS - 1))
        reread = 0 if session is not None and len(trial) == len(context) else len(context) - 1
        if not self.controller.draft_can_pay(step, setup_seconds=read_rate * reread, tokens_left=tokens_left):
            target_step = self.controller.step_seconds()
            self.stats.draft_skipped = (
                f"a draft step costs {step / target_step:.2f} target steps and reading the context "
                f"~{read_rate * reread / target_step:.0f}: drafting cannot pay, so the draft model was not used")
            return None
        if reread:
            return self._open_draft_session()
        self.draft_consumed = len(context) - 1
        return session

    def _open_draft_session(self) -> Any:
        """The draft model's session over all but the last context token (the target's ``pending``)."""
        self.draft_consumed = max(len(self.context) - 1, 0)
        return self.plan.draft.start(self.context[:-1])

    def _draft_with_proposer(self, remaining: int) -> list[int]:
        draft = self.plan.draft
        if self.controller is not None and callable(getattr(draft, "propose_with_match", None)):
            # Find the evidence first (one proposed token), then let the controller choose γ knowing how well
            # the proposal matched (controller.py: acceptance is learnt per situation), and only then propose
            # γ tokens: most steps draft nothing, and an n-gram proposal costs a vocabulary row per token.
            cap = min(self._gamma_cap(remaining), self.controller.max_gamma)
            proposal, match = draft.propose_with_match(self.context, 1) if cap > 0 else ([], 0)
            if not proposal:
                return []
            self.key = situation_key(match)
            gamma = max(min(self.controller.next_gamma(self.key), cap), 0)
            if gamma > 1:
                proposal, _ = draft.propose_with_match(self.context, gamma)
        else:
            gamma = self._gamma(remaining)
            proposal = draft.propose(self.context, gamma) if gamma > 0 else []
        tokens = check_token_ids(proposal, self.vocab_size, name="draft proposal")[:gamma]
        if self.plan.eos_token_id in tokens:
            tokens = tokens[: tokens.index(self.plan.eos_token_id) + 1]
        return tokens

    # ------------------------------------------------------------------------------------------ verify
    def _verify(self, tokens: list[int], draft_rows: np.ndarray | None, target_rows: np.ndarray):
        if self.greedy:
            return verify_greedy(tokens, target_rows)
        warped = self.warp(target_rows)
        if self.plan.draft_kind == "model" and tokens:
            return verify_distribution(tokens, draft_rows, warped, self.acceptance_rng, self.resampling_rng)
        # Proposals, or no proposal at all (a plain step: the bonus token is a plain sample).
        return verify_point_mass(tokens, warped, self.acceptance_rng, self.resampling_rng)

    # -------------------------------------------------------------------------------------------- run
    def run(self) -> Iterator[Chunk]:
        plan, stats, context = self.plan, self.stats, self.context
        started = time.perf_counter()
        if plan.budget == 0:
            return
        # Prefill all but the last prompt token: it becomes the first `pending` token, so every iteration
        # is exactly one target extend([pending] + proposals) returning the γ + 1 rows it needs.
        target_session = plan.target.start(context[:-1])
        pending = context[-1:]
        stats.target_seconds += time.perf_counter() - started
        self.target_session = target_session
        draft_session = None
        # gamma="auto" (timed) starts a draft model only when it first wants to draft, after timing one draft
        # step: the prompt prefill of a draft that cannot pay is then never spent (see _start_draft).
        lazy_draft = False
        if plan.draft_kind == "model":
            t0 = time.perf_counter()
            if getattr(plan.draft, "prefix_of", None) is plan.target and hasattr(plan.draft, "start_sharing"):
                draft_session = plan.draft.start_sharing(target_session)   # None: layout not shareable
                self.shares_target_layers = draft_session is not None
            if draft_session is None:
                if self.controller is not None and self.controller.timed:
                    lazy_draft = True
                else:
                    draft_session = self._open_draft_session()
            stats.draft_seconds += time.perf_counter() - t0

        while True:
            remaining = plan.budget - stats.emitted
            self.key = None
            if (draft_session is not None or lazy_draft) and not self._draft_fits():
                # Proposing one token means reading the whole context: past the draft's window it can no
                # longer propose, so the rest is plain decoding (exact anyway).
                draft_session, lazy_draft = None, False
                stats.draft_skipped = (
                    f"the context reached {len(context)} tokens, more than the draft's max_context "
                    f"{self.draft_max_context}: drafting stopped there")

            t0 = time.perf_counter()
            setup = 0.0
            draft_rows = None
            tokens: list[int] = []
            if plan.draft_kind == "proposer":
                tokens = self._draft_with_proposer(remaining)
            elif draft_session is not None or lazy_draft:
                gamma = self._gamma(remaining)
                if gamma > 0 and draft_session is None:
                    draft_session, lazy_draft = self._start_draft(remaining), False
                    setup = time.perf_counter() - t0   # a one-off: not a per-token drafting cost
                if gamma > 0 and draft_session is not None:
                    tokens, draft_rows = self._draft_with_model(draft_session, gamma)
            t1 = time.perf_counter()

            feed = pending + tokens
            if pending:
                rows = target_session.extend(feed)
            else:  # empty prompt on a model with an initial distribution: first row needs no token
                first = target_session.next_logprobs()[None, :]
                rows = np.vstack([first, target_session.extend(tokens)]) if tokens else first
            t2 = time.perf_counter()
            stats.target_forwards += 1
            stats.draft_seconds += t1 - t0
            stats.target_seconds += t2 - t1
            rows = _checked_rows(rows, len(tokens) + 1, self.vocab_size, "target")

            verdict = self._verify(tokens, draft_rows, rows)
            stats.record_block(len(tokens), verdict.accepted)
            if self.controller is not None:
                self.controller.observe_target(len(feed), t2 - t1)
                self.controller.observe_draft(len(tokens), t1 - t0 - setup)
                self.controller.observe_acceptance(proposed=len(tokens), accepted=verdict.accepted, key=self.key)

            # Keep both sessions on a prefix of the new context: the target drops the rejected proposals
            # (it consumed all of them); the draft consumed every proposal but the last.
            target_session.rollback(len(tokens) - verdict.accepted)
            if tokens and draft_session is not None:
                kept = min(verdict.accepted, len(tokens) - 1)
                draft_session.rollback(len(tokens) - 1 - kept)
                self.draft_consumed = len(context) + kept

            emitted = verdict.emitted[:remaining]
            stop_reason = None
            if plan.eos_token_id is not None and plan.eos_token_id in emitted:
                emitted = emitted[: emitted.index(plan.eos_token_id) + 1]
                stop_reason = "eos"
            context.extend(emitted)
            pending = emitted[-1:]
            stats.emitted += len(emitted)
            if stop_reason is None and stats.emitted >= plan.budget:
                stop_reason = plan.budget_reason
            stats.total_seconds = time.perf_counter() - started
            yield Chunk(emitted, len(tokens), verdict.accepted, verdict.recovered, verdict.bonus,
                        stop_reason is not None, stop_reason, stats)
            if stop_reason is not None:
                return


# ------------------------------------------------------------------------------------------ public API
def stream(target: Any, prompt_ids: Sequence[int], *, draft: Any = None, max_new_tokens: int = 64,
           gamma: int | str = 4, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, eos_token_id: Any = MODEL_EOS, seed: Any = None) -> Iterator[Chunk]:
    """Speculative decoding, streamed: yields one :class:`Chunk` per target forward.

    Guarantee: exact — the emitted tokens have exactly the law of plain sampling from the target with the
    same temperature / top-k / top-p; at ``temperature=0`` they are identical to plain greedy decoding.

    Args:
        target: a protocol model (``speculum.models``); seed-style ``.forward`` models are adapted.
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

    Arguments are validated before any model work (``ValueError`` naming the argument).

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


def _draft_memory(draft: Any) -> _DraftMemory | None:
    """The process-wide memory of ``draft`` (created empty), or None when the draft object cannot key a
    weak dictionary (not weak-referenceable or not hashable): it is then timed and learnt afresh each time."""
    try:
        return _DRAFT_MEMORY.setdefault(draft, _DraftMemory())
    except TypeError:
        return None
