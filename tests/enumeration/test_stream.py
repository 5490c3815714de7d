"""``iter_ranked``: the index's items, in its exact order with its log-probs, streamed in bounded memory."""
from __future__ import annotations

import gc
import itertools
import math
import os
import tracemalloc
from functools import partial

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from speculum.enumeration import AutoregressiveEnumerable, Regex
from speculum.enumeration.index.stream import DEFAULT_STREAM_WINDOW, StreamProgress
from speculum.models import MarkovModel, TinyTransformer
from speculum.models.base import Capabilities
from speculum.validation import InputError

from support.counting import CountingModel


# ------------------------------------------------------------------------------------------- helpers
def brute_force(model, *, max_len, eos=None, prompt=(), keep=lambda seq: True):
    """Every positive-probability support sequence with its log-prob (the float sum of its clipped steps,
    in order from the root), sorted by log-prob descending then tokens: the order the index promises."""
    if eos is None:
        candidates = itertools.product(range(model.vocab_size), repeat=max_len)
    else:
        others = [t for t in range(model.vocab_size) if t != eos]
        candidates = (body + (eos,) for n in range(max_len) for body in itertools.product(others, repeat=n))
    out = []
    for seq in candidates:
        if not keep(seq):
            continue
        total = 0.0
        for j, token in enumerate(seq):
            # One prefix a call: a batch of one is what a batch_size=1 index and stream send.
            total += min(float(model.next_logprobs([list(prompt) + list(seq[:j])])[0, token]), 0.0)
        if math.isfinite(total):
            out.append((tuple(seq), total))
    return sorted(out, key=lambda item: (-item[1], item[0]))


def markov(seed: int, vocab: int, *, order: int = 1, tied: bool = False, banned: float = 0.0, eos=None):
    """A random chain; ``tied``: logits on a coarse grid (equal rows and equal sequence log-probs);
    ``banned``: the fraction of impossible transitions (the first token always stays possible)."""
    rng = np.random.default_rng(seed)
    shape = (vocab,) * (order + 1)
    logits = rng.integers(0, 2, size=shape).astype(float) if tied else rng.normal(scale=2.0, size=shape)
    logits[(rng.random(shape) < banned) & (np.arange(vocab) > 0)] = -np.inf
    initial = np.zeros(vocab) if tied else rng.normal(size=vocab)
    return MarkovModel(logits, initial, order, eos_token_id=eos)


class SparseRows(CountingModel):
    """Offers ``next_logprobs_above`` from dense rows, a loose superset as a float32 pre-selection gives."""

    capabilities = Capabilities(sparse_rows=True)
    sparse_calls = 0

    def next_logprobs_above(self, prefixes, min_logprobs):
        self.sparse_calls += 1
        rows = self.next_logprobs(prefixes)
        finite = np.isfinite(rows)
        r, tok = np.nonzero(finite & (rows >= np.asarray(min_logprobs)[:, None] - 0.5))
        return r, tok, rows[r, tok], finite.sum(axis=1)


# ----------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("window", [1, 3, DEFAULT_STREAM_WINDOW])
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), vocab=st.integers(2, 5), max_len=st.integers(1, 4),
       kind=st.sampled_from(["markov", "order2", "tied", "uniform", "transformer"]),
       eos=st.booleans(), max_items=st.sampled_from([1, 2, 3, 7, 1000]))
def test_the_stream_is_the_brute_force_order(window, seed, vocab, max_len, kind, eos, max_items):
    # One item a pass re-walks the tree once per item: keep those cases small (each call is one prefix).
    assume(max_items >= 3 or vocab ** max_len <= 128)
    eos_id = vocab - 1 if eos else None
    if kind == "transformer":
        model = TinyTransformer(vocab, d_model=8, n_layers=1, seed=seed, eos_token_id=eos_id)
        prompt, max_len = [0], min(max_len, 3)
    elif kind == "uniform":
        model, prompt = MarkovModel(np.zeros((vocab, vocab)), np.zeros(vocab), eos_token_id=eos_id), []
    else:
        model = markov(seed, vocab, order=2 if kind == "order2" else 1, tied=kind == "tied", banned=0.2, eos=eos_id)
        prompt = [1]
    # batch_size=1: every row is computed alone, as brute force computes it (a batched float matmul may
    # differ in the last bits with the batch's composition).
    ar = AutoregressiveEnumerable(model, max_len=max_len, eos=eos_id, prompt=prompt, batch_size=1)
    expected = brute_force(model, max_len=max_len, eos=eos_id, prompt=prompt)
    assert list(ar.iter_ranked(max_items=max_items, window=window)) == expected
    assert ar.top_k(len(expected) + 1) == expected
    middle = len(expected) // 2
    head = itertools.islice(ar.iter_ranked(middle, max_items=max_items, window=window), 3)
    assert list(head) == [ar.unrank(j) for j in range(middle, min(middle + 3, len(expected)))]


def test_batched_stream_equals_the_index_bitwise():
    """Default batches on a model whose rows do not depend on the batch: bitwise the index's items."""
    model = markov(3, 6, order=2, banned=0.1)
    ar = AutoregressiveEnumerable(model, max_len=5, prompt=[2, 1], batch_size=64)
    expected = ar.top_k(10**5)
    assert len(expected) > 3000
    for max_items in (50, 999, 10**5):
        assert list(ar.iter_ranked(max_items=max_items)) == expected


@pytest.mark.parametrize("start", [0, 1, 5, 99, 100, 200, 625, 700])
def test_start_gives_the_suffix(start):
    ar = AutoregressiveEnumerable(MarkovModel.random(5, seed=1), max_len=4)
    everything = ar.top_k(625)
    assert list(ar.iter_ranked(start, max_items=40)) == everything[start:]


def test_ties_come_in_token_order_across_passes():
    ar = AutoregressiveEnumerable(MarkovModel(np.zeros((3, 3)), np.zeros(3)), max_len=4)
    assert [seq for seq, _ in ar.iter_ranked(max_items=2)] == list(itertools.product(range(3), repeat=4))
    assert len({lp for _, lp in ar.iter_ranked(max_items=2)}) == 1


def test_eos_without_a_cap_streams_the_index_order():
    logits = np.random.default_rng(5).normal(size=(4, 4))
    logits[:, 0] += 4.0                               # eos=0 likely: short sequences
    model = MarkovModel(logits, np.array([4.0, 0.0, 0.0, 0.0]), eos_token_id=0)
    ar = AutoregressiveEnumerable(model, eos=0)
    assert list(itertools.islice(ar.iter_ranked(max_items=7), 400)) == ar.top_k(400)


def test_a_finite_support_without_a_cap_ends():
    """eos without max_len, but the model ends every sequence within two tokens: the stream stops once a
    pass walks the whole positive-probability support."""
    logits = np.full((3, 3), -np.inf)
    logits[:, 0] = 0.0
    logits[0, 1] = 0.0
    model = MarkovModel(logits, np.array([0.0, 0.0, -np.inf]), eos_token_id=0)
    ar = AutoregressiveEnumerable(model, eos=0)
    assert list(ar.iter_ranked(max_items=1)) == ar.top_k(10) == [((0,), -math.log(2)), ((1, 0), -math.log(2))]


@pytest.mark.parametrize("pattern,eos,max_len", [("(7|8){3}", None, None), ("x(y|7){1,3}8", None, None),
                                                 ("[78]+x?", 6, 5), ("(xy|7)+", 6, 4)])
def test_constrained_stream_equals_the_index(pattern, eos, max_len):
    vocabulary = ["7", "8", "77", "x", "y", "xy", None]
    model = MarkovModel.random(7, seed=0, eos_token_id=6)
    ar = AutoregressiveEnumerable(model, prompt=[3], constraint=Regex(pattern, vocabulary=vocabulary), eos=eos,
                                  max_len=max_len)
    expected = ar.top_k(10**4)
    for max_items in (1, 3, 1000):
        assert list(ar.iter_ranked(max_items=max_items)) == expected


def test_sparse_rows_and_branch_cap_follow_the_index():
    model = markov(4, 6, order=2, banned=0.2)
    for kwargs in ({"max_len": 4}, {"eos": 2, "max_len": 4}):
        sparse = SparseRows(model)
        ar = AutoregressiveEnumerable(sparse, **kwargs)
        expected = ar.top_k(10**4)
        sparse.sparse_calls = 0
        assert list(ar.iter_ranked(max_items=9)) == expected
        assert sparse.sparse_calls > 0
        capped = AutoregressiveEnumerable(model, branch_cap=2, **kwargs)
        assert capped.capped and list(capped.iter_ranked(max_items=3)) == capped.top_k(10**4)


def test_progress_reports_each_pass():
    ar = AutoregressiveEnumerable(MarkovModel.random(5, seed=1), max_len=4)
    events: list[StreamProgress] = []
    assert sum(1 for _ in ar.iter_ranked(max_items=100, progress=events.append)) == 625
    assert events[-1].emitted == 625 and events[-1].floor_bits == math.inf
    assert [e.passes for e in events] == list(range(1, len(events) + 1))
    assert len(events) <= 625 // 100 + 4          # about one pass per max_items items
    assert all(a.forwards < b.forwards for a, b in zip(events, events[1:]))


# ----------------------------------------------------------------------------------------- Ray pool
@pytest.fixture(scope="module")
def cluster():
    """One local Ray instance for the module; its 8 logical CPUs hold a pool's actors (1 CPU each)."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=8, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


def test_stream_on_a_ray_pool_equals_the_local_stream_bitwise(cluster):
    """The window does not depend on the model: the same batches go to the pool, each call runs whole on
    one actor, so every row, hence every item, is bitwise the local model's (batched float matmuls
    included); a step's batches spread over both actors."""
    from speculum.distributed.ray_pool import RayPool

    tiny = partial(TinyTransformer, 12, d_model=16, n_layers=1, seed=3)
    streams = []
    with RayPool(tiny, workers=2) as pool:
        for model in (pool, tiny()):
            ar = AutoregressiveEnumerable(model, max_len=3, prompt=[1], batch_size=8)
            streams.append(list(ar.iter_ranked(max_items=400, window=4)))
        assert min(worker.calls for worker in pool.stats.workers) > 0, "both workers took part"
    assert len(streams[0]) == 12**3
    assert streams[0] == streams[1]


# -------------------------------------------------------------------------------------------- memory
def _peak(work) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_streaming_holds_far_less_than_the_whole_index():
    """65,536 items; the stream holds at most about 1.5 * 5,000 of them. Batches of 64 for both, so that
    the model's forward temporaries (the same for both) stay small next to the data."""
    model = TinyTransformer(16, d_model=16, n_layers=1, seed=0)

    def index(**kwargs):
        return AutoregressiveEnumerable(model, max_len=4, prompt=[1], batch_size=64, **kwargs)

    warm = index()                                    # lazy imports, off both measurements
    warm.count(-4.0)
    next(warm.iter_ranked(max_items=10))
    full = index()
    full_peak = _peak(lambda: full.count(-math.inf))
    assert full.count(-math.inf) == 16**4
    streamed = []

    def consume():
        for i, item in enumerate(index().iter_ranked(max_items=5_000)):
            if i % 997 == 0:
                streamed.append((i, item))
            last[0] = i

    last = [0]
    stream_peak = _peak(consume)
    assert last[0] == 16**4 - 1
    assert stream_peak < full_peak / 4, (stream_peak, full_peak)
    # The sampled items are the index's (a batched float matmul may move the last bits between batches).
    for i, (seq, lp) in streamed:
        got_seq, got_lp = full.unrank(i)
        assert seq == got_seq and abs(lp - got_lp) <= 1e-12


# ------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("call,match", [
    (lambda ar: ar.iter_ranked(-1), "start must be an integer >= 0"),
    (lambda ar: ar.iter_ranked(1.0), "start must be an integer"),
    (lambda ar: ar.iter_ranked(True), "start must be an integer"),
    (lambda ar: ar.iter_ranked(max_items=0), "max_items must be an integer >= 1"),
    (lambda ar: ar.iter_ranked(max_items=None), "max_items must be an integer"),
    (lambda ar: ar.iter_ranked(progress=3), "progress must be a callable"),
    (lambda ar: ar.iter_ranked(window=0), "window must be an integer >= 1"),
    (lambda ar: ar.iter_ranked(window=2.0), "window must be an integer"),
    (lambda ar: ar.iter_ranked(window=None), "window must be an integer"),
])
def test_bad_arguments_are_refused_on_the_call(call, match):
    model = CountingModel(MarkovModel.random(4, seed=0))
    ar = AutoregressiveEnumerable(model, max_len=3)
    with pytest.raises(InputError, match=match):
        call(ar)
    assert model.calls == 0


def test_string_mode_is_refused():
    vocabulary = ["7", "8", "77", "x", "y", "xy", None]
    ar = AutoregressiveEnumerable(MarkovModel.random(7, seed=0), constraint=Regex("(7|8){2}", vocabulary=vocabulary),
                                  strings=True)
    with pytest.raises(InputError, match="strings=True"):
        ar.iter_ranked()
