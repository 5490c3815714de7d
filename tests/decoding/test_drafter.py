"""The drafter seam: declared capabilities instead of probing, one "can drafting pay" test, draft profiles
that concurrent generations share safely, and concurrent generations with one shared draft object."""
from __future__ import annotations

import pathlib
import re
import sys
import threading

import numpy as np
import pytest

import speculum
from speculum.decoding.gamma.controller import GammaController, GammaPolicy, best_speedup_if_verification_free
from speculum.decoding.plan import plan_generation
from speculum.decoding.gamma.profile import DraftProfile, profile_of
from speculum.models import MarkovModel, PromptLookup, TinyTransformer
from speculum.models.base import Capabilities

DECODING = pathlib.Path(speculum.__file__).parent / "decoding"

TARGET = TinyTransformer(24, d_model=24, n_layers=2, seed=0)
PROMPTS = ([1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 7, 8, 9, 7, 10, 11, 7, 8], [4, 4, 5, 6, 4, 4, 5])
MODES = [dict(gamma="auto", temperature=0), dict(gamma=3, temperature=0),
         dict(gamma="auto", temperature=0.9, seed=11), dict(gamma=4, temperature=1.0, top_k=6, seed=5)]


# ------------------------------------------------------------------------------------ no probing
def test_decoding_never_probes_objects_for_hooks():
    offenders = [f"{path.name}:{number}: {line.strip()}"
                 for path in sorted(DECODING.glob("*.py"))
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if re.search(r"\b(hasattr|getattr)\(", line)]
    assert offenders == []


class _Session:
    """A session offering ``advance`` that records whether it was called."""

    def __init__(self, inner, calls):
        self.inner, self.calls = inner, calls

    @property
    def length(self):
        return self.inner.length

    def next_logprobs(self):
        return self.inner.next_logprobs()

    def extend(self, tokens):
        return self.inner.extend(tokens)

    def rollback(self, n):
        self.inner.rollback(n)

    def advance(self, tokens):
        self.calls.append(list(tokens))
        return self.inner.extend(tokens)[-1]


class _Draft:
    """A draft model whose sessions offer ``advance``; whether it says so is up to the test."""

    def __init__(self, model, capabilities):
        self.model, self.vocab_size, self.capabilities, self.advanced = model, model.vocab_size, capabilities, []

    def start(self, prompt):
        return _Session(self.model.start(prompt), self.advanced)

    def next_logprobs(self, prefixes):
        return self.model.next_logprobs(prefixes)

    def score_sequences(self, sequences, prompt=()):
        return self.model.score_sequences(sequences, prompt)


@pytest.mark.parametrize("declared", [True, False])
def test_a_session_hook_is_used_only_when_the_model_declares_it(declared):
    draft = _Draft(TARGET.perturbed(0.2, seed=1), Capabilities(session_advance=declared))
    got = speculum.generate(TARGET, PROMPTS[0], draft=draft, gamma=3, max_new_tokens=30, temperature=0)
    assert got.tokens == speculum.generate(TARGET, PROMPTS[0], max_new_tokens=30, temperature=0).tokens
    assert bool(draft.advanced) == declared


class _PlainProposer:
    def propose(self, context, max_tokens):
        return [int(context[-1])] * max_tokens


def test_what_a_draft_offers_is_read_once_where_it_enters():
    def plan(draft):
        return plan_generation(TARGET, [1, 2], draft=draft, max_new_tokens=4, gamma="auto", temperature=0,
                               top_k=None, top_p=None, eos_token_id=None, seed=None)

    lookup, plain, model = plan(PromptLookup()), plan(_PlainProposer()), plan(TinyTransformer(24, max_len=9))
    assert (lookup.draft_kind, lookup.draft_reports_match) == ("proposer", True)
    assert (plain.draft_kind, plain.draft_reports_match) == ("proposer", False)
    assert (model.draft_kind, model.draft_max_context) == ("model", 9)


# ---------------------------------------------------------------------------- one "can it pay" test
@pytest.mark.parametrize("acceptance", [0.3, 0.6, 0.9, 1.0])
@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.3, 0.6, 0.95])
def test_starting_a_draft_and_probing_one_ask_the_same_question(acceptance, ratio):
    # The best speed-up if verification were free: max over γ of E[N](γ) / (γ·c + 1), E[N] geometric here.
    best = max(1.0, *(sum(acceptance ** j for j in range(g + 1)) / (g * ratio + 1.0) for g in range(1, 9)))
    assert best_speedup_if_verification_free(lambda j: acceptance, ratio, 8) == pytest.approx(best)
    # Starting a draft model: at the optimistic acceptance, its timed step against a 10 ms target step.
    starting = GammaController(max_gamma=8, optimistic_acceptance=acceptance)
    starting.observe_target(1, 0.010)
    assert starting.draft_can_pay(ratio * 0.010) == (best >= starting.min_gain)
    # Probing after calibration: at the acceptance learnt so far (here, recalled from earlier generations).
    probing = GammaController(max_gamma=8, prior_draft_ratio=ratio, prior_acceptance=acceptance,
                              position_prior_weight=1e9, prior_weight=1e9)
    probing.observe_target(1, 0.010)
    assert (probing.next_gamma() > 0) == (best >= probing.min_gain)


# ------------------------------------------------------------------------------------ draft profile
def _remembered(accepted_fraction, blocks=30):
    controller = GammaController(max_gamma=8)
    for k in range(blocks):
        controller.observe_acceptance(proposed=4, accepted=4 if k < accepted_fraction * blocks else 0)
    return controller.remembered()


def test_a_profile_merges_what_concurrent_generations_learnt():
    profile = DraftProfile()
    _, version = profile.acceptance()
    agreeing, disagreeing = _remembered(1.0), _remembered(0.0)
    # Two generations started from the same version: the second to finish must not erase the first.
    profile.publish(agreeing, since=version)
    profile.publish(disagreeing, since=version)
    merged, _ = profile.acceptance()
    rate = merged.rate(0.5, 0.0)
    assert disagreeing.rate(0.5, 0.0) < rate < agreeing.rate(0.5, 0.0)
    assert merged.accepted + merged.rejected <= max(s.accepted + s.rejected for s in (agreeing, disagreeing)) + 1e-9
    # A generation that started from the latest version continues it: its statistics replace them.
    _, version = profile.acceptance()
    profile.publish(disagreeing, since=version)
    assert profile.acceptance()[0] is disagreeing


def test_concurrent_trials_keep_the_lower_timings_and_profiles_belong_to_their_draft():
    profile = DraftProfile()
    profile.record_timings(0.004, 0.001)
    profile.record_timings(0.003, 0.002)
    assert profile.timings() == (0.003, 0.001)
    draft = TARGET.perturbed(0.1, seed=4)
    assert profile_of(draft) is profile_of(draft) and profile_of(draft) is not profile_of(TARGET)


def test_seeded_sampling_neither_reads_nor_feeds_the_profile():
    draft = TARGET.perturbed(0.3, seed=2)
    args = dict(draft=draft, gamma="auto", max_new_tokens=40, temperature=0.9, seed=3)
    first = speculum.generate(TARGET, PROMPTS[1], **args)
    assert profile_of(draft).acceptance() == (None, 0) and profile_of(draft).timings() is None
    # A greedy gamma="auto" generation (timed) fills the profile, here followed by evidence that the draft
    # never agrees, which would stop every probe of a reader; the seeded sampler's draws stay the same.
    speculum.generate(TARGET, PROMPTS[1], draft=draft, gamma="auto", max_new_tokens=40, temperature=0)
    profile, version = profile_of(draft).acceptance()
    assert profile is not None
    profile_of(draft).publish(_remembered(0.0, blocks=200), since=version)
    again = speculum.generate(TARGET, PROMPTS[1], **args)
    assert again.tokens == first.tokens and again.stats.gamma_history == first.stats.gamma_history


def test_an_abandoned_stream_still_leaves_its_statistics():
    draft = TARGET.perturbed(0.3, seed=6)
    chunks = speculum.stream(TARGET, PROMPTS[0], draft=draft, gamma="auto", max_new_tokens=40, temperature=0)
    for _ in zip(range(5), chunks):
        pass
    chunks.close()
    assert profile_of(draft).acceptance()[1] == 1


def test_a_fixed_gamma_policy_has_nothing_to_learn():
    policy = GammaPolicy(3, draft_kind="model")
    assert not policy.adaptive and not policy.timed and policy.remembered() is None
    assert policy.lookahead(cap=10) == 3 and policy.lookahead(cap=1) == 1 and policy.longest(cap=10) == 3


# ------------------------------------------------------------------- one draft, concurrent generations
@pytest.fixture
def frequent_thread_switches():
    # Switch threads every few microseconds so that concurrent generations interleave inside each call.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def _run_concurrently(jobs):
    """Run every job in its own thread, all released at once; their results, or the first exception."""
    barrier, results, errors = threading.Barrier(len(jobs)), [None] * len(jobs), []

    def work(i, job):
        try:
            barrier.wait()
            results[i] = job()
        except BaseException as error:   # noqa: BLE001 - re-raised in the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i, job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


# A cheap target and long prompts for the proposer: most of each generation is then spent proposing, where
# concurrent calls on one unguarded index would corrupt it.
MARKOV = MarkovModel.random(6, seed=0, order=2, scale=3.0)
LONG_PROMPTS = tuple([int(t) for t in np.random.default_rng(i).integers(0, 6, size=50)] for i in range(3))


@pytest.mark.parametrize("draft_kind", ["model", "lookup"])
def test_concurrent_generations_sharing_one_draft_get_what_they_get_alone(draft_kind, frequent_thread_switches):
    if draft_kind == "model":
        target, draft, prompts, repeats = TARGET, TARGET.perturbed(0.3, seed=2), PROMPTS, 1
    else:
        target, draft, prompts, repeats = MARKOV, PromptLookup(max_ngram=2), LONG_PROMPTS, 3
    cases = [(prompt, mode) for prompt in prompts for mode in MODES]

    def run(prompt, mode):
        result = speculum.generate(target, prompt, draft=draft, max_new_tokens=50, **mode)
        return result.tokens, (result.stats.gamma_history if "seed" in mode else None)

    alone = [run(prompt, mode) for prompt, mode in cases]
    # Each thread runs the cases in its own order, so different generations overlap at every moment.
    n = len(cases)
    orders = [list(range(n)), list(reversed(range(n))), list(range(1, n, 2)), list(range(0, n, 2))]
    together = _run_concurrently([lambda order=order: [(i, run(*cases[i])) for i in order * repeats]
                                  for order in orders])
    for outputs in together:
        for i, got in outputs:
            assert got == alone[i], cases[i]
