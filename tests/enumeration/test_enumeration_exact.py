"""Exact enumeration agrees with brute-force sorting, for every rank, on tiny models."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.enumeration import AutoregressiveEnumerable, SeekIndex
from speculum.enumeration.enumerable import BandTooLargeError
from speculum.models import MarkovModel
from speculum.models.base import Capabilities

from support.brute_force import ranked_support
from support.counting import CountingModel


# ------------------------------------------------------------------------------------------- helpers
def assert_every_query(ar, brute, *, lp_tol=0.0):
    """unrank / rank / slice / top_k / threshold / count / mass_above against brute force, every rank."""
    for i, (seq, lp) in enumerate(brute):
        got_seq, got_lp = ar.unrank(i)
        assert got_seq == seq, f"rank {i}"
        assert abs(got_lp - lp) <= lp_tol
        assert ar.rank(seq) == i
        assert ar.threshold(i + 1) == got_lp
    assert [s for s, _ in ar.top_k(len(brute) + 3)] == [s for s, _ in brute]
    assert [s for s, _ in ar.slice(2, 5)] == [s for s, _ in brute[2:7]]
    lps = np.array([lp for _, lp in brute])
    # With a tolerance, query just below each log-prob so that last-bit differences cannot matter.
    for lp in list(lps - 1e3 * lp_tol) + [0.0, lps.min() - 1.0, float(np.median(lps)) + 1e-9]:
        assert ar.count(lp) == int(np.sum(lps >= lp))
        lo, hi = ar.mass_above(lp)
        exact = math.fsum(np.exp(lps[lps >= lp]))
        assert lo <= exact * (1 + 1e-12) and exact <= hi * (1 + 1e-12) and hi - lo <= 1e-9
    with pytest.raises(IndexError, match=str(len(brute))):
        ar.unrank(len(brute))


# --------------------------------------------------------------------------------------- brute force
def test_markov_every_rank():
    model = MarkovModel.random(5, seed=1)
    assert_every_query(AutoregressiveEnumerable(model, max_len=4), ranked_support(model, max_len=4))


def test_markov_order2_with_prompt_every_rank():
    model = MarkovModel.random(4, order=2, seed=7)
    ar = AutoregressiveEnumerable(model, max_len=3, prompt=[2, 1])
    assert_every_query(ar, ranked_support(model, max_len=3, prompt=[2, 1]))


def test_eos_terminated_markov_every_rank():
    model = MarkovModel.random(5, seed=3, eos_token_id=4)
    ar = AutoregressiveEnumerable(model, eos=True, max_len=5)
    brute = ranked_support(model, eos=4, max_len=5)
    assert all(seq[-1] == 4 and 4 not in seq[:-1] for seq, _ in brute)
    assert_every_query(ar, brute)
    assert not ar.complete  # max_len cut longer positive-probability continuations


def test_eos_without_length_cap_uses_budget_only():
    logits = np.random.default_rng(5).normal(size=(4, 4))
    logits[:, 0] += 4.0  # eos=0 likely: short sequences
    model = MarkovModel(logits, np.array([4.0, 0.0, 0.0, 0.0]), eos_token_id=0)
    ar = AutoregressiveEnumerable(model, eos=0)
    brute = ranked_support(model, eos=0, max_len=8)
    # Every continuation longer than 8 makes 8 non-eos steps in a row.
    stay = max(np.max(1.0 - np.exp(model.transition_logprobs[:, 0])), 1.0 - np.exp(model.initial_logprobs[0]))
    longer_bound = 8 * math.log(stay)
    ranks = [i for i, (_, lp) in enumerate(brute) if lp > longer_bound]
    assert len(ranks) > 10
    for i in ranks:
        assert ar.unrank(i) == brute[i]
    assert ar.complete


def test_tiny_transformer_every_rank():
    from speculum.models import TinyTransformer

    model = TinyTransformer(5, d_model=16, n_layers=2, seed=0)
    prompt = [1]
    ar = AutoregressiveEnumerable(model, max_len=4, prompt=prompt)
    brute = ranked_support(model, max_len=4, prompt=prompt)
    # Batched float64 matmuls may differ in the last bits between batch compositions.
    assert_every_query(ar, brute, lp_tol=1e-12)


# ---------------------------------------------------------------------------------------- ties, -inf
def test_uniform_model_ties_are_lexicographic():
    model = MarkovModel(np.zeros((3, 3)), np.zeros(3))
    ar = AutoregressiveEnumerable(model, max_len=3)
    assert [s for s, _ in ar.top_k(27)] == list(itertools.product(range(3), repeat=3))
    assert ar.count(-3 * math.log(3) - 1e-12) == 27


def test_band_cap_raises_pointing_to_envelope():
    model = MarkovModel(np.zeros((3, 3)), np.zeros(3))
    ar = AutoregressiveEnumerable(model, max_len=3, max_band=10)
    with pytest.raises(BandTooLargeError, match="AREnvelopeIndex"):
        ar.unrank(0)


@settings(max_examples=40, deadline=None)
@given(
    vocab=st.integers(2, 4), length=st.integers(1, 3), order=st.sampled_from([1, 2]),
    seed=st.integers(0, 10_000), tie_levels=st.sampled_from([None, 1, 2, 3]),
    ban=st.floats(0.0, 0.4), eos=st.booleans(),
)
def test_random_models_match_brute_force(vocab, length, order, seed, tie_levels, ban, eos):
    rng = np.random.default_rng(seed)
    shape = (vocab,) * (order + 1)
    if tie_levels is None:
        logits = rng.normal(scale=2.0, size=shape)
    else:  # few distinct logits: many exact ties (tie_levels=1 is uniform)
        logits = rng.integers(0, tie_levels, size=shape).astype(float)
    mask = rng.random(shape) < ban
    mask[..., 0] = False  # keep every row normalisable
    logits[mask] = -np.inf
    model = MarkovModel(logits, rng.integers(0, 2, size=vocab).astype(float), order)
    if eos:
        ar = AutoregressiveEnumerable(model, eos=vocab - 1, max_len=length + 1)
        brute = ranked_support(model, eos=vocab - 1, max_len=length + 1)
    else:
        ar = AutoregressiveEnumerable(model, max_len=length)
        brute = ranked_support(model, max_len=length)
    if brute:
        assert_every_query(ar, brute)
    else:
        with pytest.raises(IndexError, match=" 0 sequences"):
            ar.unrank(0)


# ------------------------------------------------------------------------------------------ forwards
def live_prefixes(model, max_len, budget):
    """Prefixes of length < max_len with log p >= budget (the forwards a build to ``budget`` needs)."""
    out = set()
    for n in range(max_len):
        for prefix in itertools.product(range(model.vocab_size), repeat=n):
            lp = float(model.score_sequences([prefix])[0]) if prefix else 0.0
            if lp >= budget:
                out.add(prefix)
    return out


def test_full_build_forwards_each_live_prefix_once():
    model = CountingModel(MarkovModel.random(5, seed=2), record=True)
    ar = AutoregressiveEnumerable(model, max_len=4)
    ar.count(-math.inf)   # the whole support
    assert len(model.forwarded) == len(set(model.forwarded)) <= 1 + 5 + 25 + 125
    before = len(model.forwarded)
    ar.unrank(600), ar.top_k(10), ar.rank((0, 1, 2, 3)), ar.mass_above(-6.0), ar.threshold(5)
    assert len(model.forwarded) == before   # queries after a build run no forward


def test_second_query_and_deepening_reuse_the_tree():
    # The tree's own forwards (no aiming beam, which explores prefixes below the budget).
    model = CountingModel(MarkovModel.random(5, seed=4), record=True)
    ar = AutoregressiveEnumerable(model, max_len=4, max_beam_forwards=0)
    ar.unrank(20)
    first = len(model.forwarded)
    budget = ar.seek_index().tree.budget
    assert set(model.forwarded) <= live_prefixes(model.inner, 4, budget)
    ar.unrank(3), ar.count(ar.threshold(21))
    assert len(model.forwarded) == first
    # One build, then a deepening within the reserve: only newly live prefixes are forwarded.
    fresh = CountingModel(model.inner, record=True)
    ar2 = AutoregressiveEnumerable(fresh, max_len=4, max_beam_forwards=0)
    ar2.count(budget)
    ar2.count(budget - 0.5 * math.log(2))
    assert len(fresh.forwarded) == len(set(fresh.forwarded))
    assert ar2.seek_index().tree.reforwards == 0
    # Deepen far: prefixes are forwarded again only as counted reforwards, all of them live.
    ar.unrank(400)
    index = ar.seek_index()
    assert len(model.forwarded) - len(set(model.forwarded)) == index.tree.reforwards
    assert set(model.forwarded) <= live_prefixes(model.inner, 4, index.tree.budget)
    assert index.forwards == len(model.forwarded)


# ---------------------------------------------------------------------------------------- branch cap
@pytest.mark.parametrize("cap", [1, 2, 3])
def test_branch_cap_brackets_contain_the_true_count(cap):
    model = MarkovModel.random(5, seed=8)
    brute = ranked_support(model, max_len=3)
    lps = np.array([lp for _, lp in brute])
    ar = AutoregressiveEnumerable(model, max_len=3, branch_cap=cap)
    assert ar.capped and not ar.complete
    for lp in lps[::7]:
        lo, hi = ar.count_bracket(lp)
        assert lo <= int(np.sum(lps >= lp)) <= hi
        m_lo, m_hi = ar.mass_above(lp)
        assert m_lo <= math.fsum(np.exp(lps[lps >= lp])) * (1 + 1e-12) <= m_hi * (1 + 2e-12)
    # The capped sub-support is enumerated in exact order too.
    kept = [s for s, _ in ar.top_k(200)]
    assert kept == [s for s, _ in brute if s in set(kept)]
    assert len(kept) <= cap ** 3


# --------------------------------------------------------------------------------------- bad input
def test_bad_input():
    model = MarkovModel.random(3, seed=0)
    with pytest.raises(ValueError, match="max_len"):
        AutoregressiveEnumerable(model)
    with pytest.raises(ValueError, match="branch_cap"):
        AutoregressiveEnumerable(model, max_len=2, branch_cap=0)
    ar = AutoregressiveEnumerable(model, max_len=2)
    with pytest.raises(ValueError, match="k"):
        ar.top_k(0)
    with pytest.raises(ValueError, match="k"):
        ar.threshold(0)
    with pytest.raises(ValueError, match="i must be"):
        ar.unrank(-1)
    with pytest.raises(IndexError, match="9 sequences"):
        ar.unrank(9)
    with pytest.raises(IndexError, match="at most 9"):
        ar.unrank(10**9)
    with pytest.raises(ValueError, match="length"):
        ar.rank((0, 1, 2))
    with pytest.raises(ValueError, match="vocabulary"):
        ar.rank((0, 7))
    with pytest.raises(ValueError, match="NaN"):
        ar.count(float("nan"))
    banned = np.zeros((3, 3))
    banned[0, 1] = -np.inf
    with pytest.raises(ValueError, match="probability zero"):
        AutoregressiveEnumerable(MarkovModel(banned), max_len=2).rank((0, 1))
    eos_ar = AutoregressiveEnumerable(MarkovModel.random(3, seed=0, eos_token_id=2), eos=2)
    with pytest.raises(ValueError, match="eos"):
        eos_ar.rank((0, 1))


def test_interface_used_by_rescored_index():
    model = MarkovModel.random(4, seed=9)
    ar = AutoregressiveEnumerable(model, max_len=2, prompt=[1])
    index = ar.seek_index()
    assert isinstance(index, SeekIndex) and ar.seek_index() is index
    for obj in (ar, index):
        assert obj.order_error == 0.0 and obj.complete
        assert (obj.vocab_size, obj.max_len, obj.eos, obj.prompt) == (4, 2, None, (1,))
        seq, lp = obj.unrank(3)
        assert obj.score_sequences([seq])[0] == pytest.approx(lp, abs=1e-12)
        assert obj.top_k(2) == obj.slice(0, 2)


def test_progress_callback_reports_forwards():
    events = []
    ar = AutoregressiveEnumerable(MarkovModel.random(4, seed=1), max_len=3, progress=events.append,
                                  batch_size=4)
    ar.count(-math.inf)
    assert events and events[-1].forwards == ar.seek_index().forwards
    assert {e.level for e in events} == {0, 1, 2}


class JitteryModel(CountingModel):
    """Rows move in the last bits from call to call, like a batched GPU/BLAS backend."""

    def __init__(self, inner, seed: int) -> None:
        super().__init__(inner, record=True)
        self.rng = np.random.default_rng(seed)

    def next_logprobs(self, prefixes):
        rows = super().next_logprobs(prefixes)
        return rows + self.rng.normal(scale=1e-3, size=rows.shape)


def test_reforwards_on_a_jittery_backend_never_duplicate():
    model = JitteryModel(MarkovModel.random(5, seed=6), seed=0)
    ar = AutoregressiveEnumerable(model, max_len=4, reserve_bits=0.25)
    for i in range(0, 625, 25):
        ar.unrank(i)
    assert ar.seek_index().tree.reforwards > 0
    everything = [seq for seq, _ in ar.top_k(1000)]
    assert len(everything) == len(set(everything)) == 625


# ------------------------------------------------------------------------------- sparse model hook
class SparseHookModel(CountingModel):
    """Offers ``next_logprobs_above`` built from dense rows, returning a loose superset (entries down to
    ``slop`` below each floor) as a float32 pre-selection would; the tree must apply the exact test."""

    capabilities = Capabilities(sparse_rows=True)

    def __init__(self, inner, slop: float = 0.5) -> None:
        super().__init__(inner, record=True)
        self.slop = slop
        self.sparse_calls = 0

    def next_logprobs_above(self, prefixes, min_logprobs):
        self.sparse_calls += 1
        rows = self.next_logprobs(prefixes)
        finite = np.isfinite(rows)
        r, tok = np.nonzero(finite & (rows >= np.asarray(min_logprobs)[:, None] - self.slop))
        return r, tok, rows[r, tok], finite.sum(axis=1)


@pytest.mark.parametrize("reserve_bits", [0.0, 1.0])
def test_sparse_hook_builds_the_same_index_as_dense_rows(reserve_bits):
    rng = np.random.default_rng(3)
    logits = rng.normal(scale=2.0, size=(6, 6, 6))
    logits[(rng.random(logits.shape) < 0.2) & (np.arange(6) > 0)] = -np.inf   # banned tokens (-inf rows)
    markov = MarkovModel(logits, rng.normal(size=6), 2)
    for kwargs in ({"max_len": 4}, {"eos": 2, "max_len": 4}):
        dense = AutoregressiveEnumerable(CountingModel(markov, record=True), reserve_bits=reserve_bits, **kwargs)
        hooked_model = SparseHookModel(markov)
        hooked = AutoregressiveEnumerable(hooked_model, reserve_bits=reserve_bits, **kwargs)
        brute = ranked_support(markov, **kwargs)
        for i in range(0, len(brute), 7):      # deepen step by step: reserve and re-forward paths
            assert hooked.unrank(i) == dense.unrank(i) == brute[i]
        assert hooked_model.sparse_calls > 0
        assert hooked_model.forwarded == dense.seek_index().tree.model.forwarded
        assert_every_query(hooked, brute)


def test_forwards_stay_close_to_the_minimum():
    """Certifying the top k of length-2 continuations needs a forward of every first token at or above the
    k-th log-prob (one of its continuations could be almost as probable); the budget steps must not
    overshoot that by much."""
    markov = MarkovModel.random(400, seed=1)
    first = markov.next_logprobs([[]])[0] if markov.accepts_empty_prompt else None
    for k in (50, 2_000, 30_000):
        model = CountingModel(markov, record=True)
        ar = AutoregressiveEnumerable(model, max_len=2, reserve_bits=1.0)
        threshold = ar.threshold(k)
        row = first if first is not None else markov.next_logprobs([[0]])[0]
        minimum = 1 + int(np.sum(row >= threshold))
        unique = len(set(model.forwarded))
        assert minimum <= unique <= 1.15 * minimum + 8, (k, unique, minimum)


def test_hf_sparse_hook_equals_dense_rows_and_brute_force(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from support.hf_tiny import save_tiny_model
    from speculum.models.hf import HFModel

    model = HFModel.from_pretrained(save_tiny_model(tmp_path / "tiny"))
    prompt = [1, 5, 6]
    prefixes = [prompt, prompt + [7], prompt + [7, 8], prompt + [7]]
    rows = model.next_logprobs(prefixes)
    floors = np.array([-1.0, -3.0, -np.inf, -2.5])
    r, tok, lp, finite = model.next_logprobs_above(prefixes, floors)
    assert (finite == np.isfinite(rows).sum(axis=1)).all()
    assert np.array_equal(lp, rows[r, tok])                        # the same float64 values, bitwise
    wanted = set(zip(*np.nonzero(rows >= floors[:, None])))
    assert wanted <= set(zip(r.tolist(), tok.tolist()))            # nothing at or above a floor is lost
    # The index built through the hook equals the one built from dense rows (same batches: bitwise), and
    # its scores agree with batched teacher forcing of every length-2 continuation.
    every = model.vocab_size ** 2
    hooked = AutoregressiveEnumerable(model, max_len=2, prompt=prompt, reserve_bits=0.5).top_k(every)
    dense_model = CountingModel(model, sparse_rows=False)
    dense = AutoregressiveEnumerable(dense_model, max_len=2, prompt=prompt, reserve_bits=0.5).top_k(every)
    assert hooked == dense and len(hooked) == every
    scores = model.score_sequences([s for s, _ in hooked], prompt)
    assert np.allclose(scores, [lp for _, lp in hooked], atol=1e-5, rtol=0)
