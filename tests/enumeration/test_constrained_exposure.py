"""Exposure within a format: exact ranks against brute force, and brackets that always hold the true rank."""
from __future__ import annotations

import math

import pytest

from speculum.enumeration import Choices, Regex, estimate_rank, estimate_ranks
from speculum.validation import InputError

from support.brute_force import EOS, PROMPT, VOCAB, brute_force, model

PATTERN = "[78]{2,3}x"


@pytest.mark.parametrize("strings", [False, True])
@pytest.mark.parametrize("seed", [0, 5])
def test_exact_ranks_and_exposure_equal_brute_force(strings, seed):
    m = model(seed)
    tokens, texts = brute_force(m, PATTERN, eos=False, max_tokens=4)
    expected = texts if strings else tokens
    items = [item for item, _ in expected]
    reports = estimate_ranks(m, items, constraint=Regex(PATTERN, vocabulary=VOCAB), prompt=PROMPT, strings=strings)
    size = 8 + 4 if strings else len(tokens)          # 4 two-character and 8 three-character strings
    for rank, (report, (item, log_prob)) in enumerate(zip(reports, expected)):
        assert report.method == "exact" and report.rank == rank == report.rank_lo == report.rank_hi
        assert report.log_prob == pytest.approx(log_prob, abs=1e-9)
        assert report.space_size == size
        assert report.exposure_bits == pytest.approx(math.log2(size) - math.log2(rank + 1))


@pytest.mark.parametrize("strings", [False, True])
@pytest.mark.parametrize("max_forwards", [0, 1, 3, 8])
def test_brackets_under_a_forward_budget_hold_the_true_rank(strings, max_forwards):
    m = model(7)
    tokens, texts = brute_force(m, "[78x]{1,4}", eos=True, max_tokens=5)
    expected = texts if strings else tokens
    for rank in range(0, len(expected), max(1, len(expected) // 9)):
        item = expected[rank][0]
        report = estimate_rank(m, item, constraint=Regex("[78x]{1,4}", vocabulary=VOCAB), prompt=PROMPT, eos=EOS,
                               max_len=5, strings=strings, max_forwards=max_forwards)
        assert report.rank_lo <= rank <= report.rank_hi
        assert report.rank_lo <= report.rank <= report.rank_hi
        if report.method == "exact":
            assert report.rank == rank
        low, high = report.exposure_bracket
        assert low <= report.exposure_bits <= high


def test_a_generous_budget_is_exact_and_a_zero_budget_is_a_bracket():
    m = model(2)
    tokens, _ = brute_force(m, "[78x]{1,4}", eos=True, max_tokens=5)
    deep = tokens[len(tokens) // 2][0]
    options = dict(constraint=Regex("[78x]{1,4}", vocabulary=VOCAB), prompt=PROMPT, eos=EOS, max_len=5)
    assert estimate_rank(m, deep, max_forwards=0, **options).method == "bracket"
    assert estimate_rank(m, deep, max_forwards=10**6, **options).rank == len(tokens) // 2


def test_bad_items_are_named():
    m = model()
    options = dict(constraint=Choices(["77", "xy"], vocabulary=VOCAB), prompt=PROMPT)
    with pytest.raises(InputError, match="token ids"):
        estimate_rank(m, "77", **options)
    with pytest.raises(InputError, match="not a member"):
        estimate_rank(m, "88", strings=True, **options)
    with pytest.raises(InputError, match="only apply with a constraint"):
        estimate_rank(m, [0, 1], prompt=PROMPT, strings=True)
