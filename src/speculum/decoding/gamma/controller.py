"""The γ policy of a generation: a fixed lookahead, or ``gamma="auto"`` choosing γ from measured acceptance
and measured costs. Every γ decision lives here (:class:`GammaPolicy` for one generation, its
:class:`GammaController` for ``"auto"``); drafters ask, the loop reports what happened.

Leviathan et al. (2023, §3.3–3.5): with per-token acceptance α, a block of γ proposals yields
E[N] = (1 − α^(γ+1)) / (1 − α) tokens per target forward. Its cost, in units of one plain decode step, is
γ·c (drafting; c = draft/target cost per token) plus v(γ), the cost of verifying γ + 1 tokens in one
forward. On a GPU v ≈ 1; on a CPU it grows with γ, so the controller measures it. The expected
speed-up is S(γ) = E[N] / (γ·c + v(γ)) and S(0) = 1 (plain decoding). We pick the γ maximising S, fall back
to plain decoding when no γ pays (α too low for c), and re-probe now and then since α drifts with content.

Acceptance is not i.i.d. across a block: prompt lookup is all-or-nothing (a copied span is accepted in a
run, a bad match fails at once), so the geometric model underestimates long blocks. We therefore estimate
the conditional rate a_j = P(position j accepted | positions < j accepted) per position, shrunk towards the
pooled α, and use E[N](γ) = 1 + Σ_{j≤γ} Π_{i≤j} a_i, which equals the geometric formula when a_j ≡ α.

Acceptance also depends on the situation, which a proposer can see before the target does: a prompt-lookup
match that agrees with the context on 8 tokens is copied far more reliably than a 1-token match (on
SmolLM2 the mean accepted run grows from under one token to about ten). Statistics are therefore kept per
*context key* (the caller's bucket of that evidence; None = one pool), each shrunk towards the pooled
estimate, so γ is chosen per situation: long blocks after long matches, none after weak ones.
A situation is probed the first time it is seen: otherwise it would inherit a pooled rate that early
failures in weak situations have pushed below the point where drafting is ever chosen.

None of this can affect exactness: γ and early stopping only change *what is proposed*, and every rule in
:mod:`speculum.decoding.verify` is exact for any proposal.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any, Callable, Hashable

from .costs import CostModel

__all__ = ["GammaController", "GammaPolicy", "situation_key", "best_speedup_if_verification_free"]


def situation_key(match: Any) -> Hashable:
    """The controller key for a proposer's evidence (``Proposer.propose_with_match``): an int is a match
    length, bucketed on a log scale (1, 2-3, 4-7, ... up to 32+); any other evidence is the key as it is."""
    return min(int(match).bit_length(), 6) if isinstance(match, Integral) else match


def best_speedup_if_verification_free(acceptance: Callable[[int], float], draft_ratio: float,
                                      max_gamma: int) -> float:
    """The best speed-up any γ in ``1..max_gamma`` could give if verifying a block cost one plain step:
    max of E[N](γ) / (γ·c + 1) and 1 (plain decoding), with ``acceptance(j)`` the rate of block position j
    given every earlier one was accepted and c = ``draft_ratio``. Verification never costs less than a
    step, so below ``min_gain`` drafting cannot pay whatever verification turns out to cost.

    Example:
        >>> round(best_speedup_if_verification_free(lambda j: 1.0, 0.5, 4), 3)      # γ = 4: 5 / 3
        1.667
    """
    best, tokens, survive = 1.0, 1.0, 1.0
    for gamma in range(1, max_gamma + 1):
        survive *= acceptance(gamma - 1)
        tokens += survive
        best = max(best, tokens / (gamma * draft_ratio + 1.0))
    return best


@dataclass
class GammaController:
    """Chooses the lookahead γ for each iteration and when to stop drafting early. Guarantee: heuristic
    (speed only — never affects the output law).

    Example:
        >>> ctl = GammaController(max_gamma=8)
        >>> ctl.observe_target(1, 0.010); ctl.observe_target(5, 0.012)
        >>> ctl.observe_draft(4, 0.002); ctl.observe_acceptance(proposed=4, accepted=4)
        >>> ctl.next_gamma() > 0
        True
    """

    max_gamma: int = 16
    min_confidence: float = 0.3      # greedy: stop drafting after a proposal the draft gives p < this
    decay: float = 0.9               # per-observation decay of acceptance and cost estimates
    probe_every: int = 16            # plain steps between re-probes once drafting stopped paying
    max_probe_gap: int = 128         # ...doubling after each probe that fails to resume drafting, up to this
    explore_every: int = 8           # while drafting, every this many blocks try a longer one
    probe_sizes: tuple = (2, 4, 8)   # probes cycle through these (within probe_cost_budget)
    probe_draft_budget: float = 0.5  # ...and an exploratory block's drafting at most this many steps
    probe_cost_budget: float = 0.8   # a probe may cost at most this many steps more than a plain step
    prior_acceptance: float = 0.6
    prior_weight: float = 2.0        # pseudo-observations behind the acceptance prior
    prior_draft_ratio: float = 0.1   # c before any draft timing is known
    prior_verify_slope: float = 0.3  # v(γ) ≈ 1 + slope·γ before verification timings are known: pessimistic,
                                     # since on CPUs each verified token can cost half a decode step
    position_prior_weight: float = 2.0  # pseudo-observations pulling each a_j towards the pooled α
    timed: bool = True               # False: costs come from the prior model, not wall-clock timings, so
                                     # γ depends only on acceptance — reproducible draws for a seeded sampler
    probe_new_keys: bool = True      # probe a situation key the first time it is seen
    optimistic_acceptance: float = 0.9  # acceptance assumed when deciding whether a draft can pay at all
    min_catch_up: int = 4            # shortest draft catch-up whose timing is used as a per-token reading cost
    min_gain: float = 1.1            # speculate only if S(γ) beats plain decoding by this factor: the loop's
                                     # own overhead (sampling, verification) is not in the measured costs
    min_realized_blocks: int = 3     # drafting blocks in a situation before what they delivered can veto it
    # Running state (not constructor arguments).
    _pooled: "AcceptanceCounts" = field(default_factory=lambda: AcceptanceCounts(), init=False, repr=False)
    _by_key: dict = field(default_factory=dict, init=False, repr=False)     # context key -> AcceptanceCounts
    _realized: dict = field(default_factory=dict, init=False, repr=False)   # key -> [seconds, tokens, blocks]
    _probes: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.costs = CostModel(prior_draft_ratio=self.prior_draft_ratio, prior_verify_slope=self.prior_verify_slope,
                               decay=self.decay, min_catch_up=self.min_catch_up, timed=self.timed)

    # ----------------------------------------------------------------------------------- observations
    def observe_acceptance(self, *, proposed: int, accepted: int, key: Hashable = None) -> None:
        """Record one verification: ``accepted`` of ``proposed`` (a rejection iff accepted < proposed),
        made in the situation ``key`` (None: no context; the pooled statistics always learn)."""
        if proposed == 0:
            return
        self._pooled.observe(proposed, accepted, self.decay)
        if key is not None:
            self._stats(key).observe(proposed, accepted, self.decay)

    def _stats(self, key: Hashable) -> "AcceptanceCounts":
        if key is None:
            return self._pooled
        if key not in self._by_key:
            self._by_key[key] = AcceptanceCounts()
        return self._by_key[key]

    def observe_target(self, n_tokens: int, seconds: float) -> None:
        """Record one target call that fed ``n_tokens`` tokens and took ``seconds``."""
        self.costs.observe_target(n_tokens, seconds)

    def observe_draft(self, n_tokens: int, seconds: float) -> None:
        """Record drafting ``n_tokens`` proposals in ``seconds`` (catch-up included: it is a real cost)."""
        self.costs.observe_draft(n_tokens, seconds)

    def observe_catch_up(self, n_tokens: int, seconds: float) -> None:
        """Record a draft model consuming ``n_tokens`` accepted tokens it had not seen, in ``seconds``
        (:meth:`CostModel.observe_catch_up`)."""
        self.costs.observe_catch_up(n_tokens, seconds)

    def observe_delivered(self, seconds: float, tokens: int, key: Hashable = None) -> None:
        """Record a drafting block in the situation ``key``: drafting and verifying it took ``seconds`` and
        it emitted ``tokens`` tokens. The seconds count in plain steps of that moment, so that a step's cost
        changing (a batch growing or shrinking) does not make earlier blocks look better or worse."""
        step = self.costs.step_seconds()
        if not self.timed or not step:
            return
        realized = self._realized.setdefault(key, [0.0, 0.0, 0])
        realized[0] = self.decay * realized[0] + seconds / step
        realized[1] = self.decay * realized[1] + tokens
        realized[2] += 1

    def delivered_speedup(self, key: Hashable = None) -> float | None:
        """What drafting in ``key`` has delivered so far, against plain steps: tokens a plain step's time in
        its recent drafting blocks, probes included (None: too few blocks to tell)."""
        realized = self._realized.get(key)
        if realized is None or realized[2] < self.min_realized_blocks or realized[0] <= 0:
            return None
        return realized[1] / realized[0]

    def share_forward(self, fixed: float, per_token: float, blocks: int) -> None:
        """The next forwards are shared by ``blocks`` generations' blocks (:meth:`CostModel.share_forward`)."""
        self.costs.share_forward(fixed, per_token, blocks)

    def forward_alone(self) -> None:
        """The next forwards' costs are this generation's own timings (:meth:`CostModel.forward_alone`)."""
        self.costs.forward_alone()

    def catch_up_ratio(self) -> float:
        """Cost of a draft model consuming one accepted token in a batch, in plain decode steps (0: unknown)."""
        return self.costs.catch_up_ratio()

    # --------------------------------------------------------------------------------------- estimates
    @property
    def acceptance(self) -> float:
        """Pooled estimate of α: accepted / (accepted + rejections), the censored-geometric MLE, with prior."""
        return self._pooled.rate(self.prior_acceptance, self.prior_weight)

    def key_acceptance(self, key: Hashable = None) -> float:
        """α in the situation ``key``, shrunk towards the pooled α (which is shrunk towards the prior)."""
        pooled = self.acceptance
        if key is None or key not in self._by_key:
            return pooled
        return self._by_key[key].rate(pooled, self.prior_weight)

    def step_seconds(self) -> float | None:
        """Seconds of one plain target decode step (measured or inferred; None before any timing)."""
        return self.costs.step_seconds()

    def verify_cost(self, gamma: int, step_seconds: float | None = None) -> float:
        """v(γ): cost of feeding γ + 1 tokens in one forward, in plain decode steps (:class:`CostModel`)."""
        return self.costs.verify_cost(gamma, step_seconds)

    def draft_ratio(self) -> float:
        """c: draft cost per proposed token relative to one plain target step."""
        return self.costs.draft_ratio()

    def position_acceptance(self, j: int, key: Hashable = None) -> float:
        """a_j: P(proposal j of a block is accepted | all before it were), 0-based, shrunk towards α."""
        alpha = self.key_acceptance(key)
        stats = self._stats(key) if key is None or key in self._by_key else None
        if stats is None or j >= len(stats.tried):
            return alpha
        weight = self.position_prior_weight
        return (stats.passed[j] + weight * alpha) / (stats.tried[j] + weight)

    def expected_tokens(self, gamma: int, key: Hashable = None) -> float:
        """E[N](γ) = 1 + Σ_{j<γ} Π_{i≤j} a_i: tokens emitted per target forward (bonus included)."""
        total, survive = 1.0, 1.0
        for j in range(gamma):
            survive *= self.position_acceptance(j, key)
            total += survive
        return total

    def expected_speedup(self, gamma: int, key: Hashable = None, overhead: float = 0.0) -> float:
        """S(γ) = E[N] / (γ·c + v(γ) + overhead) under the current estimates (S(0) = 1); ``overhead``: a
        one-off cost of this block in steps (a draft model's catch-up on tokens it missed)."""
        if gamma == 0:
            return 1.0
        return self.expected_tokens(gamma, key) / (gamma * self.draft_ratio() + self.verify_cost(gamma) + overhead)

    # ---------------------------------------------------------------------------------------- decisions
    def next_gamma(self, key: Hashable = None, backlog: int = 0) -> int:
        """γ for the next iteration in the situation ``key``; 0 means a plain decode step.

        ``backlog``: accepted tokens a draft model must consume before it can propose (its catch-up). A
        probe whose catch-up alone would cost more than ``probe_cost_budget`` steps is not made: after
        plain steps a draft model must re-read everything it missed, so probing a draft that is dear to
        run (a bf16 twin on a CPU without bf16 matrix instructions) would cost a share of every token.
        """
        sizes = self.costs.sizes()
        if not sizes:
            return 0                   # calibrate: time one plain step first
        if max(sizes) == 1 and self._could_pay(key):
            return self._probe_gamma()  # then time one verification (if a proposal comes)
        if key is not None and key not in self._by_key and self.probe_new_keys:
            # First sight of a situation: try it. Its statistics would otherwise start from the pooled
            # rate, which early failures in weak situations drag below the point where drafting is ever
            # chosen, so a strong situation (a long copy) would wait probe_every plain steps per try.
            self._stats(key)
            return self._probe_gamma()
        stats = self._stats(key)
        # Catching up on more than the usual last proposal + bonus token (already inside the measured c)
        # is a one-off cost of this block: after plain steps a dear draft may not be worth resuming.
        overhead = max(backlog - 2, 0) * self.catch_up_ratio()
        best = max(range(1, self.max_gamma + 1),
                   key=lambda g: self.expected_speedup(g, key, overhead)) if self.max_gamma else 0
        if best and self.expected_speedup(best, key, overhead) < self.min_gain:
            best = 0
        delivered = self.delivered_speedup(key)
        if best and delivered is not None and delivered < 1.0:
            # The model's estimate is checked against what drafting here has delivered, timed whole: costs
            # outside the target's forward, or timings that misled the estimates, show up there.
            best = 0
        if best == 0:
            stats.plain_steps += 1
            gap = stats.probe_gap or self.probe_every
            if stats.plain_steps >= gap:
                # Exponential back-off: each probe that does not bring drafting back doubles the wait
                # (up to max_probe_gap), so a useless draft costs ever less.
                stats.plain_steps, stats.probe_gap = 0, min(2 * gap, self.max_probe_gap)
                if backlog * self.catch_up_ratio() <= self.probe_cost_budget:
                    return self._probe_gamma()
        else:
            stats.plain_steps, stats.probe_gap = 0, 0
            stats.drafting_blocks += 1
            if stats.drafting_blocks % self.explore_every == 0:
                # Acceptance of deep positions and the cost of long blocks are only learnt by trying them:
                # without this the controller sticks to the short blocks it started with.
                best = max(best, min(max(2 * best, best + 2), self._explore_cap()))
        return best

    def _could_pay(self, key: Hashable = None) -> bool:
        """Whether drafting could pay in ``key`` at the acceptance learnt so far: false only when recalled
        evidence (:meth:`recall`) already shows this draft rarely agrees, so that the verification cost
        need not be measured now."""
        return best_speedup_if_verification_free(
            lambda j: self.position_acceptance(j, key), self.draft_ratio(), self.max_gamma) >= self.min_gain

    def remembered(self) -> "AcceptanceCounts":
        """The pooled acceptance statistics and probe back-off, for a later generation with the same draft
        (:meth:`recall`)."""
        return copy.deepcopy(self._pooled)

    def recall(self, pooled: "AcceptanceCounts", weight: float = 8.0) -> None:
        """Start from an earlier generation's pooled statistics (:meth:`remembered`), scaled down to at most
        ``weight`` observations so that this prompt's own evidence soon outweighs them, and with half the
        probe gap it had reached. A draft known to disagree then skips the probes it already failed."""
        state = copy.deepcopy(pooled)
        total = state.accepted + state.rejected
        if total > weight:
            scale = weight / total
            state.accepted, state.rejected = state.accepted * scale, state.rejected * scale
            state.tried = [t * scale for t in state.tried]
            state.passed = [t * scale for t in state.passed]
        state.plain_steps, state.drafting_blocks = 0, 0
        state.probe_gap = max(state.probe_gap // 2, self.probe_every) if state.probe_gap else 0
        self._pooled = state

    def draft_can_pay(self, draft_step_seconds: float, *, setup_seconds: float = 0.0,
                      tokens_left: int | None = None) -> bool:
        """False when a draft model cannot beat plain decoding even in a good case: the test made before the
        opening probe (:func:`best_speedup_if_verification_free`), here at acceptance
        ``optimistic_acceptance`` at every position and c = draft step / target step. The best such speed-up
        S* must reach ``min_gain``, and the steps it saves, ``tokens_left·(1 − 1/S*)``, must exceed the
        draft's one-off ``setup_seconds`` (reading the context).

        Used before starting a draft: a bf16 twin on a CPU without bf16 matrix instructions decodes a token
        for most of a target step but reads a prompt several times slower than the float32 target, so it
        never pays back.
        """
        step = self.costs.step_seconds()
        if not step or not self.timed:
            return True
        best = best_speedup_if_verification_free(
            lambda j: self.optimistic_acceptance, draft_step_seconds / step, self.max_gamma)
        if best < self.min_gain:
            return False
        return tokens_left is None or setup_seconds < tokens_left * step * (1.0 - 1.0 / best)

    def _explore_cap(self) -> int:
        """Largest exploratory block: drafting it may cost at most ``probe_draft_budget`` steps."""
        ratio = self.draft_ratio()
        cap = self.max_gamma if ratio <= 0 else max(1, int(self.probe_draft_budget / ratio))
        return max(1, min(cap, self.max_gamma))

    def _probe_gamma(self) -> int:
        """Next probe size: cycles through ``probe_sizes``, shortened until the probe's extra cost over a
        plain step (drafting + verification) is within ``probe_cost_budget``: a probe usually fails, and
        on backends where each verified token costs a good part of a step (llama.cpp) long ones are dear."""
        size = self.probe_sizes[self._probes % len(self.probe_sizes)]
        self._probes += 1
        size = max(1, min(size, self.max_gamma))
        ratio = self.draft_ratio()
        while size > 1 and size * ratio + self.verify_cost(size) - 1.0 > self.probe_cost_budget:
            size -= 1
        return size

    def stop_drafting(self, draft_probability: float) -> bool:
        """True when the draft's own probability of the argmax it just proposed is below the threshold.

        Used at temperature 0, where a draft unsure of its argmax rarely matches the target's. The token
        is still proposed; only the *next* proposals are skipped. (When sampling, dropping a token because
        of its value would also bias the proposal away from the reported draft distribution.)
        """
        return draft_probability < self.min_confidence


class GammaPolicy:
    """The lookahead of one generation: a fixed ``gamma``, or ``gamma="auto"``'s :class:`GammaController`.
    Drafters ask it for γ (:meth:`lookahead`) and report their costs; the loop reports each verification.
    Guarantee: heuristic (speed only: every rule in :mod:`speculum.decoding.verify` is exact for any γ).

    A seeded sampler must be reproducible run to run, but γ decides which random numbers are drawn: its
    controller is then untimed (a fixed cost model instead of wall-clock timings), and it neither reads nor
    feeds a draft's profile, so its draws never depend on earlier calls.

    Example:
        >>> GammaPolicy(4, draft_kind="model").lookahead(cap=2)
        2
        >>> GammaPolicy("auto", draft_kind="none").adaptive     # nothing to draft: nothing to adapt
        False
    """

    def __init__(self, gamma: int | str, *, draft_kind: str, greedy: bool = False, seeded: bool = False) -> None:
        self.greedy = greedy
        self.controller: GammaController | None = None
        self._draft_seconds = 0.0            # the current block's drafting, until its verification
        self._fixed = 0 if gamma == "auto" or draft_kind == "none" else int(gamma)
        if gamma == "auto" and draft_kind != "none":
            self.controller = GammaController(timed=not (seeded and not greedy),
                                              prior_draft_ratio=0.1 if draft_kind == "model" else 0.0)

    @property
    def adaptive(self) -> bool:
        """γ is chosen block by block (``gamma="auto"``)."""
        return self.controller is not None

    @property
    def timed(self) -> bool:
        """γ follows wall-clock timings: a draft may be timed before it starts, and its profile is used."""
        return self.controller is not None and self.controller.timed

    def lookahead(self, cap: int, key: Hashable = None, backlog: int = 0) -> int:
        """γ for the next block, within ``[0, cap]`` (0: a plain step), in the situation ``key``, with a draft
        model that must first read ``backlog`` tokens it missed (:meth:`GammaController.next_gamma`)."""
        gamma = self._fixed if self.controller is None else self.controller.next_gamma(key, backlog=backlog)
        return max(min(gamma, cap), 0)

    def longest(self, cap: int) -> int:
        """The longest block :meth:`lookahead` could choose within ``cap``."""
        return max(min(cap, self._fixed if self.controller is None else self.controller.max_gamma), 0)

    def stops_after(self, draft_probability: float) -> bool:
        """Greedy adaptive drafting stops after (never instead of) a proposal its draft was unsure of: such
        an argmax rarely matches the target's. Never when sampling: acceptance is then min(1, p_t/p_d),
        unrelated to how peaked the draft is (a flat draft equal to the target is always accepted)."""
        return self.greedy and self.controller is not None and self.controller.stop_drafting(draft_probability)

    def draft_can_pay(self, draft_step_seconds: float, *, setup_seconds: float, tokens_left: int) -> bool:
        """Whether starting a draft model that steps in ``draft_step_seconds`` and first reads the context in
        ``setup_seconds`` could pay (:meth:`GammaController.draft_can_pay`; always, for a fixed γ)."""
        return self.controller is None or self.controller.draft_can_pay(
            draft_step_seconds, setup_seconds=setup_seconds, tokens_left=tokens_left)

    def step_seconds(self) -> float | None:
        """Seconds of one plain target step, as measured so far (None: not yet, or a fixed γ)."""
        return None if self.controller is None else self.controller.step_seconds()

    def share_forward(self, fixed: float, per_token: float, blocks: int) -> None:
        """The next forwards are shared: ``fixed + per_token·tokens`` seconds, ``blocks`` blocks in each
        (:meth:`CostModel.share_forward`); nothing for a fixed γ."""
        if self.controller is not None:
            self.controller.share_forward(fixed, per_token, blocks)

    def forward_alone(self) -> None:
        """The next forwards' costs are this generation's own timings again."""
        if self.controller is not None:
            self.controller.forward_alone()

    def observe_draft(self, proposed: int, seconds: float) -> None:
        """A drafter proposed ``proposed`` tokens in ``seconds`` (one-off set-up costs excluded)."""
        if self.controller is not None:
            self.controller.observe_draft(proposed, seconds)
            self._draft_seconds = seconds

    def observe_catch_up(self, n_tokens: int, seconds: float) -> None:
        """A draft model read ``n_tokens`` context tokens it had missed in ``seconds``."""
        if self.controller is not None:
            self.controller.observe_catch_up(n_tokens, seconds)

    def observe_verification(self, fed: int, seconds: float | None, *, proposed: int, accepted: int,
                             key: Hashable = None) -> None:
        """One target forward fed ``fed`` tokens in ``seconds`` (None: not a measure of this block's cost)
        and accepted ``accepted`` of ``proposed``."""
        if self.controller is not None:
            if seconds is not None:
                self.controller.observe_target(fed, seconds)
                if proposed:
                    self.controller.observe_delivered(self._draft_seconds + seconds, accepted + 1, key)
            self.controller.observe_acceptance(proposed=proposed, accepted=accepted, key=key)
            self._draft_seconds = 0.0

    def remembered(self) -> "AcceptanceCounts | None":
        """What a later generation with the same draft may start from (None: nothing to keep)."""
        return self.controller.remembered() if self.timed else None

    def recall(self, remembered: "AcceptanceCounts | None") -> None:
        """Start from what earlier generations with this draft learnt (only when timed)."""
        if remembered is not None and self.timed:
            self.controller.recall(remembered)


@dataclass
class AcceptanceCounts:
    """Decayed acceptance counts of one situation: pooled (α) and per block position (a_j)."""

    accepted: float = 0.0
    rejected: float = 0.0
    tried: list = field(default_factory=list)     # [j]: decayed tries of position j
    passed: list = field(default_factory=list)    # [j]: decayed passes of position j
    plain_steps: int = 0                          # plain steps chosen in this situation since the last probe
    probe_gap: int = 0                            # plain steps before the next probe (0: probe_every)
    drafting_blocks: int = 0                      # drafting blocks chosen in this situation

    def observe(self, proposed: int, accepted: int, decay: float) -> None:
        self.accepted = decay * self.accepted + accepted
        self.rejected = decay * self.rejected + (1.0 if accepted < proposed else 0.0)
        # Positions 0..accepted were tried (the one after the accepted run, if any, was rejected).
        for j in range(min(accepted + 1, proposed)):
            if j == len(self.tried):
                self.tried.append(0.0)
                self.passed.append(0.0)
            self.tried[j] = decay * self.tried[j] + 1.0
            self.passed[j] = decay * self.passed[j] + (1.0 if j < accepted else 0.0)

    def merged(self, other: "AcceptanceCounts") -> "AcceptanceCounts":
        """Both statistics' evidence in one: counts added, then scaled to the larger of the two totals so that
        repeated merges let old evidence fade as decay does; the longer probe gap."""
        tried = [a + b for a, b in zip(_padded(self.tried, other.tried), _padded(other.tried, self.tried))]
        passed = [a + b for a, b in zip(_padded(self.passed, other.passed), _padded(other.passed, self.passed))]
        totals = (self.accepted + self.rejected, other.accepted + other.rejected)
        scale = max(totals) / sum(totals) if sum(totals) > 0 else 1.0
        return AcceptanceCounts(accepted=(self.accepted + other.accepted) * scale,
                           rejected=(self.rejected + other.rejected) * scale,
                           tried=[t * scale for t in tried], passed=[t * scale for t in passed],
                           probe_gap=max(self.probe_gap, other.probe_gap))

    def rate(self, prior: float, weight: float) -> float:
        """accepted / (accepted + rejections) with ``weight`` pseudo-observations at rate ``prior``."""
        return (self.accepted + weight * prior) / (self.accepted + self.rejected + weight)


def _padded(values: list, other: list) -> list:
    """``values`` padded with zeros to the length of ``other`` (per-position counts of unequal depth)."""
    return values + [0.0] * (len(other) - len(values))
