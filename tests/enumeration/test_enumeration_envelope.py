"""AREnvelopeIndex and estimate_rank against brute force on tiny models."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from speculum.enumeration.estimation.envelope import AREnvelopeIndex
from speculum.enumeration.estimation.exposure import estimate_rank
from speculum.enumeration.rescored import RescoredIndex
from speculum.models import MarkovModel
from speculum.models.base import BaseModel, check_token_ids, log_softmax


class DepthSession:
    def __init__(self, model, prompt):
        self.model, self.tokens = model, check_token_ids(prompt, model.vocab_size)

    @property
    def length(self):
        return len(self.tokens)

    def next_logprobs(self):
        return self.model.rows[min(len(self.tokens) - self.model.prompt_len, len(self.model.rows) - 1)]

    def extend(self, tokens):
        rows = []
        for t in tokens:
            self.tokens.append(int(t))
            rows.append(self.next_logprobs())
        return np.stack(rows)

    def rollback(self, n):
        del self.tokens[len(self.tokens) - n:]


class DepthModel(BaseModel):
    """Prefix-independent: the next-token law depends only on the depth (one distribution per step)."""

    accepts_empty_prompt = True

    def __init__(self, logits, *, eos=None, prompt_len=0):
        self.rows = log_softmax(np.asarray(logits, dtype=float))
        self.vocab_size, self.eos_token_id, self.prompt_len = self.rows.shape[1], eos, prompt_len

    def start(self, prompt):
        return DepthSession(self, prompt)


def brute(model, vocab_size, max_len, eos=None, prompt=()):
    if eos is None:
        seqs = list(itertools.product(range(vocab_size), repeat=max_len))
    else:
        body = [t for t in range(vocab_size) if t != eos]
        seqs = [tuple(p) + (eos,) for n in range(max_len) for p in itertools.product(body, repeat=n)]
    scores = model.score_sequences(seqs, prompt=prompt)
    return sorted(zip(seqs, scores.tolist()), key=lambda item: (-item[1], item[0]))


@pytest.mark.parametrize("eos", [None, 3])
def test_exact_on_prefix_independent_models(eos):
    rng = np.random.default_rng(0)
    model = DepthModel(rng.normal(scale=2.0, size=(4, 5)), eos=eos)
    truth = brute(model, 5, 4, eos)
    env = AREnvelopeIndex(model, max_len=4, eos=eos, n_paths=8, seed=1)
    got = env.top_k(len(truth) + 5)
    assert [s for s, _ in got] == [s for s, _ in truth]
    np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in truth], rtol=0, atol=1e-12)
    for position in (0, 7, len(truth) // 2, len(truth) - 1):
        seq, lp = truth[position]
        estimate, lo, hi = env.rank_estimate(seq)
        strictly_better = sum(1 for _, other in truth if other > lp)
        assert estimate == strictly_better and lo <= strictly_better <= hi
    with pytest.raises(IndexError):
        env.unrank(len(truth))


def test_quantised_region_of_prefix_independent_model_is_ordered_within_resolution():
    rng = np.random.default_rng(1)
    model = DepthModel(rng.normal(scale=2.0, size=(4, 6)))
    truth = brute(model, 6, 4)
    env = AREnvelopeIndex(model, max_len=4, n_paths=4, exact_limit=50, resolution=0.05)
    got = env.top_k(len(truth))
    assert sorted(s for s, _ in got) == sorted(s for s, _ in truth)
    infos = -np.array([lp for _, lp in got])
    # Past the exact region, a later item never beats an earlier one by more than max_len bins.
    assert np.all(infos[1:] >= np.maximum.accumulate(infos)[:-1] - 4 * 0.05 - 1e-9)


@pytest.mark.parametrize("order,eos", [(1, None), (2, None), (1, 4)])
def test_rank_brackets_contain_the_true_rank(order, eos):
    model = MarkovModel.random(5, order=order, seed=7, eos_token_id=eos)
    truth = brute(model, 5, 4, eos)
    scores = np.array([lp for _, lp in truth])
    env = AREnvelopeIndex(model, max_len=4, eos=eos, n_paths=64, seed=0, exact_limit=100)
    for seq, lp in truth[:: max(1, len(truth) // 60)]:
        estimate, lo, hi = env.rank_estimate(seq)
        true_rank = int(np.sum(scores > lp))
        assert lo <= true_rank <= hi and lo <= estimate <= hi


def test_no_duplicates_over_10000_ranks_and_exact_scores():
    model = MarkovModel.random(8, seed=3)
    env = AREnvelopeIndex(model, max_len=6, n_paths=32, seed=0, exact_limit=500)
    items = env.slice(0, 10_000)
    seqs = [s for s, _ in items]
    assert len(items) == 10_000 and len(set(seqs)) == 10_000
    np.testing.assert_allclose([lp for _, lp in items], model.score_sequences(seqs), rtol=0, atol=1e-12)


def test_eos_support_is_covered_exactly_once():
    model = MarkovModel.random(5, seed=4, eos_token_id=4)
    truth = brute(model, 5, 5, eos=4)
    env = AREnvelopeIndex(model, eos=4, max_len=5, n_paths=16, exact_limit=40)
    got = env.slice(0, len(truth) + 3)
    assert len(got) == len(truth) and {s for s, _ in got} == {s for s, _ in truth}


def test_deep_ranks_deepen_instead_of_raising():
    model = MarkovModel.random(8, seed=5)
    env = AREnvelopeIndex(model, max_len=20, n_paths=16, exact_limit=100)
    entry = env.entry(10**12)
    assert len(entry.sequence) == 20 and entry.rank_lo <= entry.rank_estimate <= entry.rank_hi
    assert entry.log_prob == pytest.approx(float(model.score_sequences([entry.sequence])[0]), abs=1e-9)
    assert env.threshold(10**12) <= env.threshold(10)
    eos_env = AREnvelopeIndex(MarkovModel.random(5, seed=6, eos_token_id=0), eos=0, n_paths=8)
    seq, _ = eos_env.unrank(10**9)
    assert seq[-1] == 0 and 0 not in seq[:-1]


def test_accepts_an_enumerable_and_feeds_rescored_index_without_certificate():
    from speculum.enumeration import AutoregressiveEnumerable

    draft = MarkovModel.random(4, seed=8)
    target = MarkovModel.random(4, seed=9)
    env = AREnvelopeIndex(AutoregressiveEnumerable(draft, max_len=3), n_paths=8)
    assert env.max_len == 3 and env.order_error is None
    result = RescoredIndex(env, target, rerank_window=8, assumed_gap=100.0).top_k(3)
    assert result["certified"] is None and len(result["items"]) == 3


def test_estimate_rank_uses_exact_when_cheap_and_envelope_otherwise():
    model = MarkovModel.random(5, seed=10)
    truth = brute(model, 5, 3)
    seq, lp = truth[17]
    report = estimate_rank(model, seq, exact_limit=1000)
    assert report.method == "exact" and report.rank == 17
    assert report.exposure_bits == pytest.approx(3 * math.log2(5) - math.log2(18))
    deep = estimate_rank(model, seq, exact_limit=0)
    assert deep.method == "envelope" and deep.rank_lo <= 17 <= deep.rank_hi
    low, high = deep.exposure_bracket
    assert low <= deep.exposure_bits <= high


def test_bad_input():
    model = MarkovModel.random(4, seed=0)
    for kwargs, word in [({"n_paths": 0}, "n_paths"), ({"resolution": 0.0}, "resolution"),
                         ({"exploration": 2.0}, "exploration"), ({"max_len": 0}, "max_len"),
                         ({"exact_limit": -1}, "exact_limit")]:
        with pytest.raises(ValueError, match=word):
            AREnvelopeIndex(model, **{"max_len": 3, **kwargs})
    with pytest.raises(ValueError, match="max_len"):
        AREnvelopeIndex(model)
    with pytest.raises(ValueError, match="ar_or_model"):
        AREnvelopeIndex(object(), max_len=2)
    env = AREnvelopeIndex(model, max_len=3, n_paths=4)
    for call, word in [(lambda: env.unrank(-1), "i"), (lambda: env.unrank(2**53), "2\\*\\*53"),
                       (lambda: env.rank_estimate([0, 1]), "length"), (lambda: env.rank_estimate([0, 1, 9]), "sequence"),
                       (lambda: env.slice(0, 0), "k"), (lambda: estimate_rank(model, []), "empty")]:
        with pytest.raises(ValueError, match=word):
            call()
    eos_env = AREnvelopeIndex(MarkovModel.random(4, seed=1, eos_token_id=3), eos=3, max_len=3, n_paths=4)
    with pytest.raises(ValueError, match="eos"):
        eos_env.rank_estimate([3, 3])
