"""Enumeration stays bounded: deep queries cost about what a best-first search costs, builds respect a node
budget (and stay exact after hitting it), rank estimates scale with the length, mismatched supports are
refused."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from speculum.enumeration import AREnvelopeIndex, AutoregressiveEnumerable, RescoredIndex, Support
from speculum.enumeration.estimation import envelope as envelope_module
from speculum.enumeration.enumerable import IndexBudgetError
from speculum.models import MarkovModel

from support.brute_force import ranked_support


def best_first_forwards(model, threshold: float, **kwargs) -> int:
    """Prefixes a best-first search expands to certify everything down to ``threshold``: every live prefix
    with log p >= threshold (one forward each), counted by building a fresh tree to exactly that budget."""
    fresh = AutoregressiveEnumerable(model, **kwargs).seek_index()
    fresh.tree.extend(threshold)
    return fresh.tree.forwards


@pytest.mark.parametrize("max_len", [10, 11, 12, 13])
def test_deep_top_k_expands_about_what_best_first_expands(max_len):
    """No leaf exists until depth ``max_len``, so the leaf count gives no signal for the budget: growth must
    be paced by the forwards seen, not by doubling the budget's bits (which expanded ~2^11 times too many
    prefixes at length 11)."""
    model = MarkovModel.random(6, seed=0, eos_token_id=5)
    kwargs = dict(max_len=max_len, prompt=[0, 1])
    ar = AutoregressiveEnumerable(model, **kwargs)
    top = ar.top_k(3)
    minimum = best_first_forwards(model, top[-1][1], **kwargs)
    forwards = ar.seek_index().forwards          # the tree's and the aiming beam's
    assert minimum <= forwards <= 2.0 * minimum + 16, (forwards, minimum)
    # Without the beam the growth alone stays within the doubling bound (plus one batch).
    blind = AutoregressiveEnumerable(model, max_beam_forwards=0, batch_size=64, **kwargs)
    assert blind.top_k(3) == top
    assert blind.seek_index().forwards <= 4.0 * minimum + 64, (blind.seek_index().forwards, minimum)
    # The answer itself is the exact top 3: a fresh index built to the threshold holds the same sequences.
    check = AutoregressiveEnumerable(model, **kwargs)
    check.seek_index().extend_to(top[-1][1])
    assert check.top_k(3) == top


@pytest.mark.parametrize("k", [1, 20, 400])
def test_growth_stays_near_best_first_for_shallow_and_wide_queries(k):
    model = MarkovModel.random(12, seed=3)
    ar = AutoregressiveEnumerable(model, max_len=5, prompt=[0])
    threshold = ar.threshold(k)
    minimum = best_first_forwards(model, threshold, max_len=5, prompt=[0])
    assert ar.seek_index().forwards <= 2.0 * minimum + 16


def test_node_budget_refuses_up_front_without_forwarding():
    ar = AutoregressiveEnumerable(MarkovModel.random(8, seed=0), max_len=6, max_nodes=1_000)
    with pytest.raises(IndexBudgetError, match="max_nodes=1,000"):
        ar.top_k(5_000)
    with pytest.raises(IndexBudgetError, match="--max-nodes"):
        ar.unrank(100_000)
    assert ar.seek_index().tree.forwards == 0
    with pytest.raises(ValueError, match="max_nodes"):
        AutoregressiveEnumerable(MarkovModel.random(8, seed=0), max_len=3, max_nodes=0)


def test_build_stops_at_the_node_budget_and_the_index_stays_exact():
    """A build that reaches ``max_nodes`` raises before recording the chunk it could not store; the tree
    stays consistent, so raising the budget later gives exactly the brute-force answers — also when the
    interrupted chunk re-forwarded prefixes (deepening past their reserve)."""
    model = MarkovModel.random(4, seed=2)
    kwargs = dict(max_len=6, prompt=[1])
    brute = ranked_support(model, **kwargs)
    for budget in (40, 150, 400, 900, 2_000):
        ar = AutoregressiveEnumerable(model, max_nodes=budget, batch_size=7, reserve_bits=0.25, **kwargs)
        hit = False
        for k in (1, 10, 60, 300, 1_500):
            try:
                ar.top_k(k)
            except IndexBudgetError:
                hit = True
            stored = sum(len(level) for level in ar.seek_index().tree.levels)
            assert stored <= budget
        assert hit, budget
        ar.seek_index().tree.max_nodes = 10**9
        assert ar.top_k(len(brute)) == brute
        for seq, _ in brute[::97]:
            assert ar.unrank(ar.rank(seq))[0] == seq


def test_count_and_mass_at_infinite_thresholds_without_warnings():
    ar = AutoregressiveEnumerable(MarkovModel.random(4, seed=0), max_len=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ar.count(math.inf) == 0 and ar.count(0.5) == 0
        assert ar.mass_above(math.inf) == (0.0, 0.0)
        assert ar.count(-math.inf) == 16


def test_envelope_rank_work_grows_quadratically_not_cubically(monkeypatch):
    """The rank estimate convolves per-depth step histograms; padding every step to the full histogram
    made each convolution (length x length) and a rank of length L cost ~L^3."""
    work = []
    real = np.convolve

    def counting(a, b, *args, **kwargs):
        work[-1] += len(a) * len(b)
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(envelope_module.np, "convolve", counting)
    model = MarkovModel.random(6, seed=0)
    for length in (24, 48):
        work.append(0)
        env = AREnvelopeIndex(model, max_len=length, prompt=[0], n_paths=4, exact_limit=0)
        estimate, lo, hi = env.rank_estimate([(1 + j) % 6 for j in range(length)])
        assert lo <= estimate <= hi
    assert work[1] <= 5 * work[0], work


def test_rescored_index_refuses_a_target_index_with_another_support():
    model, other = MarkovModel.random(5, seed=0, eos_token_id=4), MarkovModel.random(5, seed=1, eos_token_id=4)
    draft = AutoregressiveEnumerable(other, max_len=3, prompt=[0])
    for target, match in [
        (AutoregressiveEnumerable(model, max_len=2, prompt=[0]), "length 2 vs 3"),
        (AutoregressiveEnumerable(model, max_len=3, eos=4, prompt=[0]), "eos token"),
        (AutoregressiveEnumerable(model, max_len=3, prompt=[1]), "prompt"),
        (AutoregressiveEnumerable(model, max_len=3, prompt=[0], branch_cap=2), "capped"),
    ]:
        with pytest.raises(ValueError, match=match):
            RescoredIndex(draft, target, assumed_gap=5.0)
    eos_draft = AutoregressiveEnumerable(other, max_len=3, eos=4, prompt=[0])
    with pytest.raises(ValueError, match="eos token"):
        RescoredIndex(eos_draft, AutoregressiveEnumerable(model, max_len=3, prompt=[0]), assumed_gap=5.0)
    # The same support is accepted, and its certified top-k is the target's exact top-k.
    target = AutoregressiveEnumerable(model, max_len=3, prompt=[0])
    result = RescoredIndex(draft, target, assumed_gap=20.0, certify=True, max_window=200).top_k(5)
    assert result["certified"] is True
    assert result["items"] == [(seq, lp) for seq, lp in target.top_k(5)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("eos", [None, 3])
def test_beam_finds_real_sequences_no_better_than_the_true_top(seed, eos):
    """The beam's i-th best is the exact log-prob of a real, distinct support sequence, so it is at most
    the true i-th best: a budget at it certainly certifies i sequences."""
    from speculum.enumeration.index.beam import beam_logprobs

    model = MarkovModel.random(4, seed=seed, eos_token_id=3)
    truth = [lp for _, lp in ranked_support(model, max_len=4, eos=eos, prompt=[0])]
    found, forwards = beam_logprobs(model, prompt=[0], width=5, support=Support(max_len=4, eos=eos))
    assert 0 < len(found) <= 5 and forwards <= 5 * 4
    assert np.all(np.diff(found) <= 0)
    assert all(lp <= best + 1e-12 for lp, best in zip(found, truth))


def test_whole_support_built_to_minus_infinity_is_complete():
    """After count(-inf) every prefix is expanded down to -inf: the tree knows it holds the whole support
    (zero-probability sequences excluded), so a rank past its end is an IndexError, not a search."""
    logits = np.zeros((3, 3))
    logits[0, 1] = -np.inf                      # the sequence (0, 1) has probability 0
    ar = AutoregressiveEnumerable(MarkovModel(logits, np.zeros(3)), max_len=2)
    assert ar.count(-math.inf) == 8
    assert ar.seek_index().support_size == 8
    with pytest.raises(IndexError, match="beyond the support"):
        ar.unrank(8)


def test_a_deepening_keeps_children_at_most_one_more_step_deep():
    """From a pilot that found a single leaf, the leaf-growth rate is a poor guess: the children kept for the
    next deepening stay within one more capped step, so a top-250 query stores a few times more nodes than
    it forwards, not a vocabulary per prefix."""
    rng = np.random.default_rng(0)
    vocab = 3000
    model = MarkovModel(rng.normal(scale=3.0, size=(vocab, vocab)), rng.normal(scale=3.0, size=vocab))
    ar = AutoregressiveEnumerable(model, max_len=3, batch_size=512, max_beam_forwards=0)
    threshold = ar.threshold(250)
    index = ar.seek_index()
    assert ar.count(threshold) >= 250
    assert sum(len(level) for level in index.tree.levels) < 100 * index.forwards


@pytest.mark.parametrize("options", [dict(max_len=6), dict(eos=True, max_len=8), dict(max_len=6, batch_size=3)])
def test_a_forward_budget_is_never_passed_and_changes_nothing_under_it(options):
    """max_forwards is checked before each batch (beam steps included): a refused query forwarded at most
    the limit; the exact need answers as an unlimited index, with the same forwards; lifting the limit
    afterwards finishes the same query exactly."""
    from support.counting import CountingModel
    from speculum.enumeration.enumerable import ForwardBudgetError

    def model():
        return CountingModel(MarkovModel.random(6, seed=3, eos_token_id=5))

    free = AutoregressiveEnumerable(model(), **options)
    truth = free.top_k(25)
    needed = free.seek_index().forwards
    assert needed > 3
    for limit in (0, 1, needed // 2, needed - 1):
        counted = model()
        ar = AutoregressiveEnumerable(counted, max_forwards=limit, **options)
        with pytest.raises(ForwardBudgetError) as raised:
            ar.top_k(25)
        assert counted.positions <= limit and raised.value.limit == limit and raised.value.needed > limit
        ar.seek_index().max_forwards = None
        assert ar.top_k(25) == truth
    exact = AutoregressiveEnumerable(model(), max_forwards=needed, **options)
    assert exact.top_k(25) == truth and exact.seek_index().forwards == needed
