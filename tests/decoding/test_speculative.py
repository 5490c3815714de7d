"""The decoding loop: greedy equality, draft == target, analytic acceptance, budgets, eos, bad input."""
from __future__ import annotations

import time

import numpy as np
import pytest

import speculum
from speculum import models
from speculum.decoding import DecodingStats, GammaController, GenerationResult, generate, stream
from speculum.models import MarkovModel
from speculum.models.base import Capabilities

from support.greedy import plain_greedy

V = 8


class Counting:
    """Wraps a model and counts every call into it (sessions included)."""

    def __init__(self, model, *, accepts_empty_prompt=None, max_context=None, corrupt_after=None,
                 step_seconds=0.0):
        self.model = model
        self.vocab_size = model.vocab_size
        self.accepts_empty_prompt = (getattr(model, "accepts_empty_prompt", False)
                                     if accepts_empty_prompt is None else accepts_empty_prompt)
        self.max_context = max_context
        self.calls = 0
        self.extends = 0
        self.fed = 0
        self.corrupt_after = corrupt_after
        self.step_seconds = step_seconds            # simulated cost of one forward (an expensive target)

    def start(self, prompt):
        self.calls += 1
        return CountingSession(self, self.model.start(prompt))

    def next_logprobs(self, prefixes):
        self.calls += 1
        return self.model.next_logprobs(prefixes)

    def score_sequences(self, sequences, prompt=()):
        self.calls += 1
        return self.model.score_sequences(sequences, prompt)


class CountingSession:
    def __init__(self, owner, inner):
        self.owner, self.inner = owner, inner

    @property
    def length(self):
        return self.inner.length

    def next_logprobs(self):
        self.owner.calls += 1
        return self.inner.next_logprobs()

    def extend(self, tokens):
        self.owner.calls += 1
        self.owner.extends += 1
        self.owner.fed += len(tokens)
        rows = self.inner.extend(tokens)
        if self.owner.step_seconds:
            time.sleep(self.owner.step_seconds * (1 + 0.05 * len(tokens)))
        if self.owner.corrupt_after is not None and self.owner.extends > self.owner.corrupt_after:
            rows = rows.copy()
            rows[-1, 0] = np.nan
        return rows

    def rollback(self, n):
        self.inner.rollback(n)


class GreedyChainProposer:
    """Point-mass draft: the greedy continuation of another chain."""

    def __init__(self, model):
        self.model = model

    def propose(self, context, max_tokens):
        return plain_greedy(self.model, context, max_tokens)


TARGET = MarkovModel.random(V, seed=0, order=2)
DRAFT = MarkovModel.random(V, seed=1, order=2)
NEAR = MarkovModel(TARGET.transition_logprobs + np.random.default_rng(5).normal(scale=0.5, size=(V, V, V)),
                   TARGET.initial_logprobs, order=2)


# ----------------------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("draft", [None, DRAFT, TARGET, NEAR, GreedyChainProposer(NEAR)],
                         ids=["plain", "random", "draft==target", "near", "proposer"])
@pytest.mark.parametrize("gamma", [1, 3, 7, "auto"])
def test_greedy_equals_plain_greedy(draft, gamma):
    for prompt in ([1], [3, 2, 5], []):
        expected = plain_greedy(TARGET, prompt, 40)
        got = generate(TARGET, prompt, draft=draft, gamma=gamma, max_new_tokens=40, temperature=0, seed=0)
        assert got.tokens == expected


def test_greedy_equals_plain_greedy_with_eos_inside_drafts():
    for eos in range(V):
        expected = plain_greedy(TARGET, [1], 30, eos=eos)
        got = generate(TARGET, [1], draft=TARGET, gamma=5, max_new_tokens=30, temperature=0, eos_token_id=eos)
        assert got.tokens == expected
        if eos in expected:
            assert got.stop_reason == "eos"


def test_greedy_on_tiny_transformer():
    TinyTransformer = models.TinyTransformer
    target = TinyTransformer(vocab_size=32, d_model=32, n_layers=2, seed=0)
    draft = TinyTransformer(vocab_size=32, d_model=16, n_layers=1, seed=1)
    prompt = [1, 2, 3]
    expected = plain_greedy(target, prompt, 24)
    for candidate in (draft, target.perturbed(0.3, seed=2), target):
        for gamma in (1, 4, "auto"):
            got = generate(target, prompt, draft=candidate, gamma=gamma, max_new_tokens=24, temperature=0)
            assert got.tokens == expected
    # Draft == target also at temperature 1: batched and incremental rows agree, acceptance is exactly 1.
    sampled = generate(target, prompt, draft=target, gamma=3, max_new_tokens=24, seed=0)
    assert sampled.stats.acceptance_rate == 1.0 and sampled.stats.tokens_per_target_forward == 4


# ------------------------------------------------------------------------------------- draft == target
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 3, None), (1.3, None, 0.8), (0, None, None)])
@pytest.mark.parametrize("gamma", [1, 4])
def test_draft_equal_target_accepts_everything(temperature, top_k, top_p, gamma):
    n_blocks = 12
    chunks = list(stream(TARGET, [2], draft=TARGET, gamma=gamma, max_new_tokens=n_blocks * (gamma + 1),
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=3))
    stats = chunks[-1].stats
    assert stats.acceptance_rate == 1.0
    assert stats.tokens_per_target_forward == gamma + 1
    assert all(len(c.tokens) == gamma + 1 and c.accepted == c.proposed == gamma and c.bonus is not None
               for c in chunks)


# ---------------------------------------------------------------------------------- analytic acceptance
@pytest.mark.parametrize("kind", ["distribution", "point_mass"])
def test_measured_acceptance_matches_analytic(kind):
    # γ = 1: each block proposes one token from the state after the context, so its acceptance probability
    # is Σ_x min(p_target, p_draft) (distribution-aware) or p_target(proposal) (point-mass), computable
    # exactly per block. The sum of these is the expected number of acceptances.
    target, draft = MarkovModel.random(6, seed=10), MarkovModel.random(6, seed=11)
    proposer = GreedyChainProposer(draft)
    context = [0]
    expected = variance = accepted = 0.0
    for chunk in stream(target, context, draft=draft if kind == "distribution" else proposer, gamma=1,
                        max_new_tokens=3000, seed=4):
        state = context[-1:]                                   # order 1: the last token is the state
        p_target = np.exp(target.next_logprobs([state])[0])
        if kind == "distribution":
            alpha = np.minimum(p_target, np.exp(draft.next_logprobs([state])[0])).sum()
        else:
            alpha = p_target[proposer.propose(state, 1)[0]]
        if chunk.proposed:
            expected += alpha
            variance += alpha * (1 - alpha)
            accepted += chunk.accepted
        context.extend(chunk.tokens)
    assert abs(accepted - expected) < 4.5 * np.sqrt(variance)


# ------------------------------------------------------------------------------------ budget, eos, misc
@pytest.mark.parametrize("gamma", [1, 2, 5, "auto"])
@pytest.mark.parametrize("draft", [DRAFT, GreedyChainProposer(DRAFT), TARGET])
def test_max_new_tokens_is_exact(gamma, draft):
    for n in (0, 1, 2, 3, 7, 20):
        result = generate(TARGET, [1], draft=draft, gamma=gamma, max_new_tokens=n, seed=n)
        assert len(result.tokens) == n and result.stats.emitted == n


def test_max_new_tokens_zero_does_no_work():
    target = Counting(TARGET)
    result = generate(target, [1], draft=DRAFT, max_new_tokens=0)
    assert result.tokens == [] and target.calls == 0


def test_eos_stops_and_nothing_follows_it():
    for seed in range(30):
        result = generate(TARGET, [1], draft=DRAFT, gamma=4, max_new_tokens=50, eos_token_id=3, seed=seed)
        assert 3 not in result.tokens[:-1]
        assert result.stop_reason == ("eos" if result.tokens[-1] == 3 else "max_new_tokens")


def test_one_target_extend_per_chunk_and_no_refeeding():
    target = Counting(TARGET)
    prompt = [1, 2, 3, 4]
    result = generate(target, prompt, draft=DRAFT, gamma=4, max_new_tokens=60, seed=1)
    assert target.extends == result.stats.target_forwards
    # Every token fed is the last prompt token, an emitted token or a proposal: never the whole sequence.
    assert target.fed <= 1 + result.stats.emitted + result.stats.proposed


def test_plain_decoding_is_one_token_per_extend():
    target = Counting(TARGET)
    result = generate(target, [1, 2], max_new_tokens=25, seed=0)
    assert target.extends == 25 and target.fed == 25 and result.stats.proposed == 0
    # A one-token prompt is prefilled whole: the first row comes from the session, no extend.
    target = Counting(TARGET)
    generate(target, [1], max_new_tokens=25, seed=0)
    assert target.extends == 24 and target.fed == 24


def test_seed_reproducible_and_generator_accepted():
    a = generate(TARGET, [1], draft=DRAFT, max_new_tokens=30, seed=7).tokens
    assert a == generate(TARGET, [1], draft=DRAFT, max_new_tokens=30, seed=7).tokens
    assert len(generate(TARGET, [1], draft=DRAFT, max_new_tokens=30, seed=np.random.default_rng(7)).tokens) == 30


def test_stream_chunks_carry_running_stats():
    chunks = list(stream(TARGET, [1], draft=DRAFT, max_new_tokens=30, gamma=3, seed=2))
    assert sum(len(c.tokens) for c in chunks) == 30 and chunks[-1].finished and not chunks[0].finished
    stats = chunks[-1].stats
    assert isinstance(stats, DecodingStats) and stats.target_forwards == len(chunks)
    assert len(stats.per_position_acceptance) == 3 and stats.gamma_history == [c.proposed for c in chunks]
    assert set(stats.as_dict()) >= {"acceptance_rate", "tokens_per_target_forward", "draft_seconds"}


def test_max_context_caps_and_rejects_long_prompts():
    target = Counting(TARGET, max_context=10)
    result = generate(target, [1, 2, 3, 4], draft=DRAFT, max_new_tokens=50, seed=0)
    assert len(result.tokens) == 6 and result.stop_reason == "max_context"
    with pytest.raises(ValueError, match="max_context"):
        generate(target, list(range(8)) * 2, max_new_tokens=5)


def test_auto_gamma_falls_back_to_plain_decoding_for_a_useless_draft():
    hostile = MarkovModel(-8 * TARGET.transition_logprobs, -8 * TARGET.initial_logprobs, order=2)
    result = generate(TARGET, [1], draft=hostile, gamma="auto", max_new_tokens=200, seed=0)
    assert len(result.tokens) == 200
    assert result.stats.gamma_history.count(0) > 0.7 * len(result.stats.gamma_history)


def _controller_with_verify_costs(max_gamma, seconds_per_token):
    """A controller that has timed a 10 ms plain step and every block size up to max_gamma + 1 tokens."""
    ctl = GammaController(max_gamma=max_gamma)
    ctl.observe_target(1, 0.010)
    for n in range(2, max_gamma + 2):
        ctl.observe_target(n, 0.010 + seconds_per_token * n)
    return ctl


def test_auto_gamma_speculates_deeply_when_drafting_pays():
    # Deterministic: costs are injected, not timed (wall-clock timings are noisy on shared machines).
    # A cheap draft (c = 0.01) that is always accepted, and a verifier whose cost barely grows with γ.
    ctl = _controller_with_verify_costs(max_gamma=8, seconds_per_token=0.0005)
    for _ in range(20):
        ctl.observe_draft(4, 0.0004)
        ctl.observe_acceptance(proposed=4, accepted=4)
    assert ctl.next_gamma() >= 6
    # The same draft rejected every time: no γ pays, so it falls back to plain steps (γ = 0).
    for _ in range(40):
        ctl.observe_acceptance(proposed=4, accepted=0)
    assert ctl.next_gamma() == 0


def test_top_level_exports():
    assert speculum.generate is generate and speculum.GenerationResult is GenerationResult
    assert speculum.DecodingStats is DecodingStats and speculum.stream is stream


# ---------------------------------------------------------------------------------------- bad input
BAD_INPUTS = [
    (dict(prompt_ids=[]), "prompt_ids"),
    (dict(prompt_ids=[1, V]), "prompt_ids"),
    (dict(prompt_ids=[-1]), "prompt_ids"),
    (dict(draft=MarkovModel.random(V + 1, seed=0)), "vocab"),
    (dict(draft=object()), "draft"),
    (dict(gamma=0), "gamma"),
    (dict(gamma=-2), "gamma"),
    (dict(gamma=2.5), "gamma"),
    (dict(gamma="fast"), "gamma"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(eos_token_id=V), "eos_token_id"),
    (dict(seed=-3), "seed"),
    (dict(seed="abc"), "seed"),
]


@pytest.mark.parametrize("kwargs,name", BAD_INPUTS, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD_INPUTS)])
def test_bad_input_is_a_value_error_before_any_work(kwargs, name):
    target = Counting(TARGET, accepts_empty_prompt=False)
    draft = Counting(DRAFT)
    args = dict(prompt_ids=[1], draft=draft, max_new_tokens=5, seed=0)
    args.update(kwargs)
    prompt = args.pop("prompt_ids")
    with pytest.raises(ValueError, match=name):
        stream(target, prompt, **args)                      # eager: raises before the first chunk
    assert target.calls == 0 and draft.calls == 0


def test_nan_logits_are_rejected_where_they_enter():
    bad = np.zeros((V, V))
    bad[2, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        MarkovModel(bad)
    with pytest.raises(ValueError, match="NaN"):
        generate(Counting(TARGET, corrupt_after=2), [1], draft=DRAFT, max_new_tokens=40, seed=0)
    with pytest.raises(ValueError, match="draft"):
        generate(TARGET, [1], draft=Counting(DRAFT, corrupt_after=2), max_new_tokens=40, seed=0)


def test_a_target_declaring_normalised_rows_is_trusted_with_their_mass():
    """The loop checks a target's rows (a pass of exp over the vocabulary each) unless the target declares
    that it checks them where it computes them: the same corrupted rows are refused from a target that
    does not declare it and taken as they are from one that does (the declaration is its word)."""
    class Declaring(Counting):
        capabilities = Capabilities(normalised_rows=True)

    with pytest.raises(ValueError, match="NaN"):
        generate(Counting(TARGET, corrupt_after=2), [1], max_new_tokens=8, temperature=0)
    declared = Declaring(TARGET, corrupt_after=2)
    out = generate(declared, [1], max_new_tokens=8, temperature=0)
    assert declared.extends > 2 and len(out.tokens) == 8


def test_auto_gamma_models_all_or_nothing_acceptance_runs():
    # Prompt lookup: a copied span is accepted whole or its first token fails. The per-position model
    # must see that long blocks pay (a pooled geometric α ≈ 0.8 would predict E[N](8) ≈ 4.3, not ≈ 5.5).
    ctl = GammaController(max_gamma=8)
    for k in range(200):
        ctl.observe_acceptance(proposed=8, accepted=8 if k % 2 else 0)
    assert ctl.position_acceptance(0) == pytest.approx(0.5, abs=0.1)
    assert all(ctl.position_acceptance(j) > 0.9 for j in range(1, 8))
    assert ctl.expected_tokens(8) == pytest.approx(1 + 0.5 * 8, rel=0.15)
    # With constant acceptance it is the geometric formula of Leviathan et al.
    geometric = GammaController(max_gamma=8, position_prior_weight=1e9, prior_weight=1e9, prior_acceptance=0.7)
    assert geometric.expected_tokens(5) == pytest.approx((1 - 0.7 ** 6) / (1 - 0.7))


class _JitteryTarget(Counting):
    """A target whose forwards take a random (unseeded) time, like a real model on a busy machine."""

    def start(self, prompt):
        session = super().start(prompt)
        extend = session.extend

        def jittery_extend(tokens):
            time.sleep(float(np.random.default_rng().uniform(0, 0.002)) * len(tokens))
            return extend(tokens)

        session.extend = jittery_extend
        return session


@pytest.mark.parametrize("draft_kind", ["model", "proposer"])
def test_seeded_sampling_with_auto_gamma_is_reproducible(draft_kind):
    # gamma="auto" must not let wall-clock noise change which random numbers a seeded run draws.
    draft = TARGET if draft_kind == "model" else GreedyChainProposer(TARGET)
    runs = [generate(_JitteryTarget(TARGET), [1], draft=draft, gamma="auto", max_new_tokens=80,
                     temperature=0.8, seed=7).tokens for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_auto_gamma_learns_acceptance_per_situation():
    # Prompt lookup after a long match is copied whole, after a 1-token match it fails: with statistics
    # kept per context key, γ is long in the first situation and 0 (a plain step) in the second.
    ctl = _controller_with_verify_costs(max_gamma=16, seconds_per_token=0.001)
    for _ in range(30):
        ctl.observe_acceptance(proposed=8, accepted=8, key="long match")
        ctl.observe_acceptance(proposed=8, accepted=0, key="1-token match")
    assert ctl.next_gamma("long match") >= 8
    assert ctl.next_gamma("1-token match") == 0
    # An unseen situation starts from the pooled estimate (half the blocks were accepted whole).
    assert ctl.key_acceptance("new") == pytest.approx(ctl.acceptance)


@pytest.mark.parametrize("probe_new_keys", [True, False])
def test_auto_gamma_probes_a_situation_the_first_time_it_is_seen(probe_new_keys):
    # Early blocks after 1-token matches fail and drag the pooled rate down; a situation first seen later
    # (a long match) must still be tried at once, not wait probe_every plain steps behind that rate.
    ctl = _controller_with_verify_costs(max_gamma=16, seconds_per_token=0.001)
    ctl.probe_new_keys = probe_new_keys
    for _ in range(10):
        ctl.observe_acceptance(proposed=4, accepted=0, key="1-token match")
    assert ctl.next_gamma("1-token match") == 0
    assert (ctl.next_gamma("long match") > 0) == probe_new_keys
    assert ctl.next_gamma("long match") == 0          # tried once; its own statistics decide from now on


# Verification cost (ms) of n tokens on SmolLM2-135M float32, 2 CPU cores: a step at 4, flat from 12 to 16.
_CPU_VERIFY_MS = {1: 31.5, 2: 34.1, 3: 36.4, 4: 50.1, 5: 52.0, 6: 53.6, 7: 60.0, 8: 65.1, 9: 67.0, 10: 69.8,
                  11: 71.5, 12: 73.1, 13: 73.3, 14: 73.5, 15: 73.6, 16: 73.7, 17: 75.1}


@pytest.mark.parametrize("explore_every,reaches_long_blocks", [(8, True), (10**9, False)])
def test_auto_gamma_explores_longer_blocks_than_it_has_tried(explore_every, reaches_long_blocks):
    # Every proposal is accepted, but after short blocks the curve looks steep (3 -> 4 tokens jumps by
    # 14 ms), so extrapolation alone keeps γ short: exploration must try longer blocks, which then pay.
    ctl = GammaController(max_gamma=16, prior_draft_ratio=0.0, explore_every=explore_every)
    for n in (1, 3, 4):
        ctl.observe_target(n, _CPU_VERIFY_MS[n] / 1000)
    chosen = []
    for _ in range(60):
        gamma = ctl.next_gamma()
        chosen.append(gamma)
        ctl.observe_target(gamma + 1, _CPU_VERIFY_MS[gamma + 1] / 1000)
        ctl.observe_acceptance(proposed=gamma, accepted=gamma)
    assert (min(chosen[-10:]) >= 12) == reaches_long_blocks, chosen


class _MatchReportingProposer(GreedyChainProposer):
    """A proposer that also reports a match length (like PromptLookup); records what it was asked."""

    def __init__(self, model, match):
        super().__init__(model)
        self.match, self.calls = match, 0

    def propose_with_match(self, context, max_tokens):
        self.calls += 1
        self.asked = [*getattr(self, "asked", []), max_tokens]
        return self.propose(context, max_tokens), self.match


@pytest.mark.parametrize("match,key", [(1, 1), (9, 4), (1000, 6), ((2, 3), (2, 3))])
def test_decoder_chooses_gamma_from_the_proposers_match(match, key, monkeypatch):
    asked = []
    original = GammaController.next_gamma
    monkeypatch.setattr(GammaController, "next_gamma",
                        lambda self, k=None, **kwargs: asked.append(k) or original(self, k, **kwargs))
    proposer = _MatchReportingProposer(NEAR, match)
    got = generate(TARGET, [1], draft=proposer, gamma="auto", max_new_tokens=60, temperature=0)
    assert got.tokens == plain_greedy(TARGET, [1], 60)       # still exact
    # γ was chosen after proposing, in the match length's log-scale bucket (capped at 6).
    assert proposer.calls > 0 and set(asked) == {key}


def test_decoder_asks_a_proposer_for_more_than_one_token_only_when_drafting():
    # Evidence first (one token), the full proposal only for a block that drafts: an n-gram proposal costs
    # a vocabulary row per token, and most steps of a draft that does not pay draft nothing.
    proposer = _MatchReportingProposer(NEAR, 1)
    got = generate(TARGET, [1], draft=proposer, gamma="auto", max_new_tokens=60, temperature=0)
    assert got.tokens == plain_greedy(TARGET, [1], 60)
    drafting_blocks = sum(1 for proposed in got.stats.gamma_history if proposed > 1)
    long_asks = [i for i, asked in enumerate(proposer.asked) if asked > 1]
    assert len(long_asks) == drafting_blocks and 0 < drafting_blocks < len(got.stats.gamma_history)
    assert all(proposer.asked[i - 1] == 1 for i in long_asks)      # always after reading the evidence


class _FlatCostTarget(Counting):
    """A target whose forward costs the same for any number of tokens (like a GPU), so drafting pays."""

    def start(self, prompt):
        session = super().start(prompt)
        extend = session.extend

        def flat_extend(tokens):
            time.sleep(0.002)
            return extend(tokens)

        session.extend = flat_extend
        return session


def test_prompt_lookup_auto_equals_plain_on_repetitive_text():
    # A greedy chain that cycles: lookup with gamma="auto" must copy long runs and stay exact.
    target = MarkovModel.random(V, seed=3, order=2, scale=4.0)
    expected = plain_greedy(target, [1, 2], 120)
    got = generate(_FlatCostTarget(target), [1, 2], draft=models.PromptLookup(), gamma="auto",
                   max_new_tokens=120, temperature=0)
    assert got.tokens == expected
    assert got.stats.tokens_per_target_forward > 4.0


class _AdvancingSession(CountingSession):
    """A session that also offers ``advance`` (the last row only), recording the tokens it was given."""

    advanced: list = []

    def advance(self, tokens):
        type(self).advanced.append(list(tokens))
        return self.extend(tokens)[-1]


class _AdvancingModel(Counting):
    capabilities = Capabilities(session_advance=True)

    def start(self, prompt):
        self.calls += 1
        return _AdvancingSession(self, self.model.start(prompt))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_draft_catch_up_uses_advance_when_the_session_has_it(temperature):
    _AdvancingSession.advanced = []
    draft = _AdvancingModel(NEAR)
    got = generate(TARGET, [1], draft=draft, gamma=3, max_new_tokens=40, temperature=temperature, seed=3)
    ref = generate(TARGET, [1], draft=NEAR, gamma=3, max_new_tokens=40, temperature=temperature, seed=3)
    assert got.tokens == ref.tokens                      # same rows, same random draws: same output
    assert _AdvancingSession.advanced and all(len(t) >= 1 for t in _AdvancingSession.advanced)


@pytest.mark.parametrize("catch_up_seconds_per_token,probes", [(0.0001, True), (0.01, False)])
def test_auto_gamma_does_not_probe_a_draft_whose_catch_up_is_dear(catch_up_seconds_per_token, probes):
    # After plain steps a draft model must re-read every token it missed: with a 10 ms step, a backlog of
    # 5 tokens at 10 ms each costs 5 steps, beyond the 0.8-step probe budget; at 0.1 ms, 0.05 steps.
    ctl = _controller_with_verify_costs(max_gamma=8, seconds_per_token=0.001)
    for _ in range(10):
        ctl.observe_acceptance(proposed=2, accepted=0)       # drafting does not pay: plain steps
    ctl.observe_catch_up(16, 16 * catch_up_seconds_per_token)
    chosen = [ctl.next_gamma(backlog=5) for _ in range(200)]
    assert (max(chosen) > 0) == probes


def test_draft_can_pay_bounds_the_best_case_speed_up():
    ctl = _controller_with_verify_costs(max_gamma=8, seconds_per_token=0.001)   # a 10 ms plain step
    assert ctl.draft_can_pay(0.002)                 # c = 0.2: up to 5x with perfect acceptance
    assert not ctl.draft_can_pay(0.0095)            # c = 0.95: under 1/c < min_gain even if all accepted
    assert GammaController().draft_can_pay(1.0)     # no step timed yet: cannot tell, so try
    assert GammaController(timed=False).draft_can_pay(1.0)


@pytest.mark.parametrize("draft_step_seconds,target_step_seconds,used", [(0.01, 0.0, False), (0.0, 0.01, True)])
def test_auto_gamma_starts_a_draft_model_only_if_it_can_pay(draft_step_seconds, target_step_seconds, used):
    # A draft dearer per step than the target is timed on a throwaway session and never started: the
    # prompt prefill it would cost is never spent and every token comes from plain target steps.
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7]
    draft = Counting(NEAR, step_seconds=draft_step_seconds)
    target = Counting(TARGET, step_seconds=target_step_seconds)
    result = generate(target, prompt, draft=draft, gamma="auto", max_new_tokens=30, temperature=0)
    assert result.tokens == plain_greedy(TARGET, prompt, 30)
    if used:
        assert result.stats.draft_skipped is None and result.stats.draft_forwards > 0
    else:
        assert "cannot pay" in result.stats.draft_skipped
        assert draft.calls == 3                     # the trial: one start, two timed steps
        assert result.stats.draft_forwards == 0 and max(result.stats.gamma_history) == 0
    # The trial's timings are kept for the draft object: a second generation decides without a trial.
    calls = draft.calls
    again = generate(target, prompt, draft=draft, gamma="auto", max_new_tokens=30, temperature=0)
    assert again.tokens == result.tokens
    if used:
        assert again.stats.draft_forwards > 0
    else:
        assert draft.calls == calls and "cannot pay" in again.stats.draft_skipped


def test_auto_gamma_counts_a_long_catch_up_against_resuming_a_dear_draft():
    # Drafting pays block by block (c = 0.05, always accepted), but a draft that missed 40 tokens and reads
    # each for 0.5 steps would first spend 19 steps catching up: a plain step is better.
    ctl = _controller_with_verify_costs(max_gamma=8, seconds_per_token=0.0005)
    for _ in range(20):
        ctl.observe_draft(4, 0.002)
        ctl.observe_acceptance(proposed=4, accepted=4)
    ctl.observe_catch_up(16, 16 * 0.005)
    assert ctl.next_gamma(backlog=2) > 0          # the usual catch-up (last proposal + bonus) is in c
    assert ctl.next_gamma(backlog=40) == 0
    ctl.observe_catch_up(3, 3 * 0.1)              # a short catch-up is mostly one call's fixed cost: ignored
    assert ctl.catch_up_ratio() == pytest.approx(0.5)


def test_recall_keeps_a_bounded_memory_of_acceptance_and_half_the_probe_gap():
    earlier = _controller_with_verify_costs(max_gamma=8, seconds_per_token=0.001)
    for _ in range(30):
        earlier.observe_acceptance(proposed=2, accepted=0)
    earlier._pooled.probe_gap = 128
    ctl = _controller_with_verify_costs(max_gamma=8, seconds_per_token=0.001)
    ctl.recall(earlier.remembered())
    assert ctl.acceptance < 0.2                                   # the evidence came along...
    assert ctl._pooled.accepted + ctl._pooled.rejected <= 8.0 + 1e-9   # ...worth at most 8 observations
    assert ctl._pooled.probe_gap == 64
    for _ in range(20):                                           # so this prompt's evidence soon wins
        ctl.observe_acceptance(proposed=2, accepted=2)
    assert ctl.acceptance > 0.6
    assert earlier.acceptance < 0.2                               # the earlier controller is untouched


def test_auto_gamma_remembers_a_disagreeing_draft_across_generations():
    # A draft whose argmax is always the target's argmin never agrees at temperature 0. The first
    # generation learns that by probing, starting with a block at once (to time verification); the next
    # one (same draft object) starts from what was learnt: no opening probe, and the back-off it had
    # reached. Outputs stay plain greedy decoding.
    flipped = -TARGET.transition_logprobs
    flipped = flipped - np.log(np.exp(flipped).sum(axis=-1, keepdims=True))
    draft = Counting(MarkovModel(flipped, TARGET.initial_logprobs, order=2), step_seconds=0.0025)
    target = Counting(TARGET, step_seconds=0.005)
    prompt = [1, 2, 3, 4]
    runs = [generate(target, prompt, draft=draft, gamma="auto", max_new_tokens=60, temperature=0) for _ in range(2)]
    for run in runs:
        assert run.tokens == plain_greedy(TARGET, prompt, 60)
        assert run.stats.accepted == 0
    first, second = ([i for i, g in enumerate(run.stats.gamma_history) if g > 0] for run in runs)
    assert first and first[0] <= 2 and len(first) >= 2
    assert not [i for i in second if i < 16] and len(second) < len(first)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_chunk_carries_the_targets_rows_of_its_tokens(temperature):
    """``Chunk.target_logprobs[j]`` is the target's own distribution at ``tokens[j]``'s position (the rows the
    verification used, before any warp): equal to a fresh query of the target after that token's context."""
    from speculum.models import TinyTransformer

    target = TinyTransformer(12, d_model=32, n_layers=2, seed=4)
    draft = TinyTransformer(12, d_model=32, n_layers=2, seed=7)
    prompt, context = [1, 2, 3], [1, 2, 3]
    for chunk in speculum.stream(target, prompt, draft=draft, gamma=3, max_new_tokens=25, temperature=temperature,
                                 seed=0):
        assert chunk.target_logprobs.shape == (len(chunk.tokens), 12)
        for token, row in zip(chunk.tokens, chunk.target_logprobs):
            assert np.allclose(row, target.next_logprobs([context])[0], rtol=0, atol=1e-12)
            context.append(token)
    assert len(context) == len(prompt) + 25
