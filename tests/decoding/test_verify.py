"""The pure acceptance rules: edge cases with hand-built extreme rows, exact one-step laws, fixed draws."""
from __future__ import annotations

import copy

import numpy as np
import pytest
from scipy import stats

from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.decoding.drafter import checked_tokens
from speculum.decoding.verify import (residual_logprobs, verify_distribution, verify_greedy, verify_greedy_tokens,
                                      verify_point_mass)
from speculum.decoding.warp import sample_from_logprobs


def log(probs) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(probs, dtype=np.float64))


def rngs(seed: int = 0):
    return np.random.default_rng(seed), np.random.default_rng(seed + 1000)


def test_residual_matches_direct_formula():
    rng = np.random.default_rng(0)
    target, draft = rng.dirichlet(np.ones(8)), rng.dirichlet(np.ones(8))
    direct = np.maximum(target - draft, 0)
    np.testing.assert_allclose(np.exp(residual_logprobs(log(target), log(draft))), direct / direct.sum(), atol=1e-12)


def test_residual_is_stable_for_tiny_and_nearly_equal_probabilities():
    # Entries around e^-700 underflow as probabilities; in log space their residual stays exact.
    target = np.array([np.log(0.3), -700.0, np.log(0.7)])
    draft = np.array([np.log(0.4), -701.0, np.log(0.6)])
    residual = residual_logprobs(target, draft)
    expected_tiny = -700.0 + np.log1p(-np.exp(-1.0)) - np.log(0.1)
    assert residual[0] == -np.inf
    assert residual[1] == pytest.approx(expected_tiny, abs=1e-9)
    assert residual[2] == pytest.approx(0.0, abs=1e-12)
    # Nearly equal rows: the residual is the tiny positive difference, renormalised.
    target = log([0.5 + 1e-9, 0.5 - 1e-9])
    assert residual_logprobs(target, log([0.5, 0.5]))[0] == 0.0


def test_residual_is_none_when_rows_are_equal():
    row = log([0.2, 0.3, 0.5])
    assert residual_logprobs(row, row.copy()) is None


def test_draft_equal_target_accepts_everything_and_samples_a_bonus():
    rows = log(np.random.default_rng(3).dirichlet(np.ones(5), size=4))        # (4, 5)
    for seed in range(50):
        acceptance, resampling = rngs(seed)
        draft_tokens = [int(np.argmin(rows[i])) for i in range(3)]             # even the least likely token
        verdict = verify_distribution(draft_tokens, rows[:3], rows, acceptance, resampling)
        assert verdict.accepted == 3 and verdict.bonus is not None and verdict.recovered is None
        assert verdict.emitted == draft_tokens + [verdict.bonus]


def test_zero_target_probability_is_always_rejected_and_never_recovered():
    target = log([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    draft = log([[0.9, 0.05, 0.05]])
    for seed in range(50):
        verdict = verify_distribution([0], draft, target, *rngs(seed))
        assert verdict.accepted == 0 and verdict.recovered in (1, 2) and verdict.emitted == [verdict.recovered]
        verdict = verify_point_mass([0], target, *rngs(seed))
        assert verdict.accepted == 0 and verdict.recovered in (1, 2)


def test_point_mass_token_with_all_the_mass_is_always_accepted():
    target = log([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    for seed in range(50):
        assert verify_point_mass([1], target, *rngs(seed)).accepted == 1


def test_draft_token_outside_its_own_distribution_is_an_error():
    with pytest.raises(ValueError, match="zero probability under the draft"):
        verify_distribution([0], log([[0.0, 1.0]]), log([[0.5, 0.5], [0.5, 0.5]]), *rngs())


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="target_logprobs"):
        verify_greedy([0, 1], log([[0.5, 0.5], [0.5, 0.5]]))


def _one_step_law(rule, target_row, draft_row, n, seed=0):
    """Empirical law of the first emitted token over n independent draws (γ = 1)."""
    draw_rng = np.random.default_rng(seed)
    acceptance, resampling = rngs(seed + 1)
    target = np.stack([target_row, target_row])
    counts = np.zeros(len(target_row))
    for _ in range(n):
        if rule == "distribution":
            token = sample_from_logprobs(draft_row, draw_rng.random())
            verdict = verify_distribution([token], draft_row[None, :], target, acceptance, resampling)
        else:
            token = int(draw_rng.integers(len(target_row)))                   # any proposal at all
            verdict = verify_point_mass([token], target, acceptance, resampling)
        counts[verdict.emitted[0]] += 1
    return counts


@pytest.mark.parametrize("rule", ["distribution", "point_mass"])
def test_one_step_law_is_the_target_row(rule):
    target_row = log([0.05, 0.4, 0.0, 0.25, 0.3])
    draft_row = log([0.5, 0.1, 0.2, 0.2, 0.0])                                # mismatched supports
    n = 8000
    counts = _one_step_law(rule, target_row, draft_row, n)
    assert counts[2] == 0
    support = np.exp(target_row) > 0
    pvalue = stats.chisquare(counts[support], np.exp(target_row[support]) * n).pvalue
    assert pvalue > 0.001


@pytest.mark.parametrize("rule", ["distribution", "point_mass"])
def test_random_draws_are_fixed_whatever_the_outcome(rule):
    rows = log(np.random.default_rng(5).dirichlet(np.ones(4), size=4))       # (4, 4)
    for seed in range(20):
        acceptance, resampling = rngs(seed)
        acceptance_copy, resampling_copy = copy.deepcopy(acceptance), copy.deepcopy(resampling)
        tokens = [seed % 4, (seed // 4) % 4, 1]
        if rule == "distribution":
            verify_distribution(tokens, rows[:3], rows, acceptance, resampling)
        else:
            verify_point_mass(tokens, rows, acceptance, resampling)
        acceptance_copy.random(3)
        resampling_copy.random()
        assert acceptance.random() == acceptance_copy.random()
        assert resampling.random() == resampling_copy.random()


def test_greedy_accepts_while_argmax_matches_and_breaks_ties_low():
    rows = log([[0.1, 0.9, 0.0], [0.4, 0.4, 0.2], [0.3, 0.3, 0.4]])
    assert verify_greedy([1, 0], rows).emitted == [1, 0, 2]            # tie in row 1 -> token 0
    verdict = verify_greedy([1, 1], rows)
    assert verdict.accepted == 1 and verdict.recovered == 0 and verdict.emitted == [1, 0]
    assert verify_greedy([], rows[:1]).emitted == [1]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 6).flatmap(lambda gamma: st.tuples(
    st.lists(st.integers(0, 3), min_size=gamma, max_size=gamma),
    st.lists(st.lists(st.integers(-3, 0), min_size=4, max_size=4), min_size=gamma + 1, max_size=gamma + 1))))
def test_greedy_on_tokens_alone_is_greedy_on_the_rows_argmax(case):
    """Rows of few distinct values (many ties): the tokens-only rule decides as the rows' rule does."""
    draft_tokens, values = case
    rows = np.asarray(values, dtype=np.float64)
    assert verify_greedy_tokens(draft_tokens, rows.argmax(axis=-1)) == verify_greedy(draft_tokens, rows)


def test_greedy_tokens_of_the_wrong_shape_or_outside_the_vocabulary_are_errors():
    with pytest.raises(ValueError, match=r"target_tokens must have shape \(3,\)"):
        verify_greedy_tokens([0, 1], np.array([0, 1]))
    with pytest.raises(ValueError, match=r"greedy tokens of shape \(2,\)"):
        checked_tokens(np.array([0, 1]), 3, 5, "target")
    with pytest.raises(ValueError, match="dtype float64"):
        checked_tokens(np.zeros(3), 3, 5, "target")
    with pytest.raises(ValueError, match="outside its vocabulary of 5"):
        checked_tokens(np.array([0, 5, 1]), 3, 5, "target")
    assert checked_tokens(np.array([0, 4, 1]), 3, 5, "target").tolist() == [0, 4, 1]
