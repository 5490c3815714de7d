"""Exact reference models: sessions agree with recomputation from scratch, batching agrees with sessions,
rows are normalised, and bad inputs fail with a message naming the argument."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.models import NGramModel, TinyTransformer
from speculum.models.reference.tiny_transformer import _gelu, _layer_norm

VOCAB = 11
ATOL = 1e-10


# --------------------------------------------------------------------------- TinyTransformer reference
def naive_rows(model: TinyTransformer, tokens: list[int]) -> np.ndarray:
    """(T, V) log-probs of ``tokens`` by an independent, loop-based forward with no cache and no batching."""
    w = model.weights
    H, dh = model.n_heads, model.d_model // model.n_heads
    x = [w.token_embedding[t] + w.position_embedding[i] for i, t in enumerate(tokens)]
    for layer in w.layers:
        h = [_layer_norm(v, layer.ln1_gain, layer.ln1_bias) for v in x]
        queries = [v @ layer.w_query for v in h]
        keys = [v @ layer.w_key for v in h]
        values = [v @ layer.w_value for v in h]
        new_x = []
        for i in range(len(tokens)):
            mixed = np.zeros(model.d_model)
            for head in range(H):
                cols = slice(head * dh, (head + 1) * dh)
                scores = np.array([queries[i][cols] @ keys[j][cols] / np.sqrt(dh) for j in range(i + 1)])
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                mixed[cols] = sum(weights[j] * values[j][cols] for j in range(i + 1))
            y = x[i] + mixed @ layer.w_attn_out
            g = _layer_norm(y, layer.ln2_gain, layer.ln2_bias)
            new_x.append(y + _gelu(g @ layer.w_mlp_in + layer.b_mlp_in) @ layer.w_mlp_out + layer.b_mlp_out)
        x = new_x
    logits = np.array([model.logit_scale * (_layer_norm(v, w.lnf_gain, w.lnf_bias) @ w.head) for v in x])
    top = logits.max(axis=1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))


@pytest.fixture(scope="module")
def tiny() -> TinyTransformer:
    return TinyTransformer(VOCAB, d_model=8, n_layers=2, seed=5, n_heads=2, max_len=24)


tokens_st = st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=5)
ops_st = st.lists(st.one_of(st.tuples(st.just("extend"), tokens_st), st.tuples(st.just("rollback"), st.integers(0, 6))),
                  min_size=1, max_size=8)


@settings(max_examples=40, deadline=None)
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4), ops=ops_st)
def test_transformer_session_matches_recompute_through_extend_rollback(tiny, prompt, ops):
    session = tiny.start(prompt)
    assert np.allclose(session.next_logprobs(), naive_rows(tiny, prompt)[-1], atol=ATOL, rtol=0)
    for op, arg in ops:
        if op == "extend" and session.length + len(arg) > tiny.max_len:
            before = list(session.tokens)
            with pytest.raises(ValueError, match="max_len"):
                session.extend(arg)           # refused before any work: the session is unchanged
            assert session.tokens == before
            full = naive_rows(tiny, session.tokens)
        elif op == "extend":
            rows = session.extend(arg)
            full = naive_rows(tiny, session.tokens)
            assert rows.shape == (len(arg), VOCAB)
            if arg:
                assert np.allclose(rows, full[-len(arg):], atol=ATOL, rtol=0)
        else:
            n = min(arg, session.length - 1)  # keep one token so next_logprobs is defined
            session.rollback(n)
            full = naive_rows(tiny, session.tokens)
        assert session.length == len(session.tokens)
        assert np.allclose(session.next_logprobs(), full[-1], atol=ATOL, rtol=0)


def test_transformer_batched_next_logprobs_equal_session_rows(tiny):
    rng = np.random.default_rng(0)
    prefixes = [list(rng.integers(0, VOCAB, size=rng.integers(1, 7))) for _ in range(25)]  # ragged, with repeats
    batched = tiny.next_logprobs(prefixes)
    assert batched.shape == (25, VOCAB)
    for prefix, row in zip(prefixes, batched):
        assert np.allclose(row, tiny.start(prefix).next_logprobs(), atol=ATOL, rtol=0)
    assert np.allclose(np.exp(batched).sum(axis=1), 1.0, atol=1e-12)
    assert tiny.next_logprobs([]).shape == (0, VOCAB)


def test_transformer_score_sequences_is_sum_of_session_rows(tiny):
    rng = np.random.default_rng(1)
    prompt = [3, 1]
    sequences = [list(rng.integers(0, VOCAB, size=rng.integers(0, 6))) for _ in range(20)]
    scores = tiny.score_sequences(sequences, prompt=prompt)
    for seq, score in zip(sequences, scores):
        session = tiny.start(prompt)
        rows = np.vstack([session.next_logprobs()[None], session.extend(seq)])[: len(seq)]
        assert score == pytest.approx(float(rows[np.arange(len(seq)), seq].sum()), abs=ATOL)
    assert scores[[len(s) == 0 for s in sequences]].tolist() == [0.0] * sum(len(s) == 0 for s in sequences)


def test_transformer_perturbed_zero_is_identical_and_noise_is_correlated(tiny):
    prefixes = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    assert np.array_equal(tiny.perturbed(0.0, seed=3).next_logprobs(prefixes), tiny.next_logprobs(prefixes))
    rng = np.random.default_rng(2)
    many = [list(rng.integers(0, VOCAB, size=5)) for _ in range(200)]
    target = tiny.next_logprobs(many)
    near, far = tiny.perturbed(0.1, seed=3).next_logprobs(many), tiny.perturbed(2.0, seed=3).next_logprobs(many)
    assert not np.allclose(near, target)
    tv_near = 0.5 * np.abs(np.exp(near) - np.exp(target)).sum(axis=1).mean()
    tv_far = 0.5 * np.abs(np.exp(far) - np.exp(target)).sum(axis=1).mean()
    assert tv_near < tv_far
    # a different seed gives a different model; the same seed the same one
    assert not np.allclose(TinyTransformer(VOCAB, d_model=8, seed=6, max_len=24).next_logprobs(prefixes),
                           tiny.next_logprobs(prefixes))


def test_transformer_variants_stay_consistent():
    tied = TinyTransformer(VOCAB, d_model=12, n_layers=3, n_heads=3, tie_embeddings=True, seed=1, max_len=16)
    for model in (tied, tied.truncated(1), tied.truncated(0)):
        tokens = [1, 5, 2, 9, 0]
        session = model.start(tokens[:2])
        assert np.allclose(session.extend(tokens[2:]), naive_rows(model, tokens)[2:], atol=ATOL, rtol=0)
    assert tied.truncated(1).n_layers == 1 and tied.n_layers == 3


def test_transformer_default_logit_scale_gives_peaked_rows():
    model = TinyTransformer(64, seed=0)
    rng = np.random.default_rng(0)
    rows = model.next_logprobs([list(rng.integers(0, 64, size=8)) for _ in range(100)])
    median_top = float(np.median(np.exp(rows.max(axis=1))))
    assert 0.2 < median_top < 0.75


def test_transformer_bad_inputs_raise(tiny):
    with pytest.raises(ValueError, match="prompt"):
        tiny.start([])  # no BOS
    with pytest.raises(ValueError, match="prompt"):
        tiny.start([VOCAB])
    with pytest.raises(ValueError, match="max_len"):
        tiny.start([0] * 25)
    session = tiny.start([1] * 20)
    with pytest.raises(ValueError, match="max_len"):
        session.extend([1] * 5)
    assert session.length == 20  # a refused extend leaves the session untouched
    with pytest.raises(ValueError, match="tokens"):
        session.extend([-1])
    with pytest.raises(ValueError, match="rollback"):
        session.rollback(21)
    with pytest.raises(ValueError, match="rollback"):
        session.rollback(-1)
    with pytest.raises(ValueError, match="prefix"):
        tiny.next_logprobs([[]])
    with pytest.raises(ValueError, match="prompt"):
        tiny.score_sequences([[1]])
    with pytest.raises(ValueError, match="n_heads"):
        TinyTransformer(VOCAB, d_model=10, n_heads=3)
    with pytest.raises(ValueError, match="noise"):
        tiny.perturbed(-1.0)
    with pytest.raises(ValueError, match="n_layers"):
        tiny.truncated(3)


def test_transformer_bos_replaces_empty_prompt():
    model = TinyTransformer(VOCAB, d_model=8, seed=2, bos_token_id=0, max_len=16)
    assert model.start([]).tokens == [0]
    assert np.allclose(model.next_logprobs([[]]), model.next_logprobs([[0]]), atol=0)
    assert model.score_sequences([[3, 4]])[0] == pytest.approx(model.score_sequences([[3, 4]], prompt=[0])[0])


# ------------------------------------------------------------------------------------------- NGramModel
def brute_ngram_logprob(sequences, n, vocab, smoothing, concentration, prefix, token) -> float:
    """log P(token | prefix) straight from the interpolated formula, recounting the corpus every call."""
    from collections import Counter

    pair, context_total, distinct = Counter(), Counter(), {}
    for seq in sequences:
        for i, w in enumerate(seq):
            for k in range(min(n - 1, i) + 1):
                h = tuple(seq[i - k:i])
                pair[h, w] += 1
                context_total[h] += 1
                distinct.setdefault(h, set()).add(w)
    history = tuple(prefix[max(0, len(prefix) - n + 1):]) if n > 1 else ()
    prob = 1.0 / vocab
    for k in range(len(history) + 1):
        h = history[len(history) - k:]
        if context_total[h] == 0:
            continue
        alpha = len(distinct[h]) if smoothing == "witten-bell" else concentration
        prob = (pair[h, token] + alpha * prob) / (context_total[h] + alpha)
    return float(np.log(prob))


corpus_st = st.lists(st.lists(st.integers(0, 5), max_size=12), min_size=0, max_size=4)


@settings(max_examples=30, deadline=None)
@given(corpus=corpus_st, n=st.integers(1, 4), smoothing=st.sampled_from(["witten-bell", "dirichlet"]),
       prefix=st.lists(st.integers(0, 5), max_size=5))
def test_ngram_rows_equal_the_formula_and_are_normalised(corpus, n, smoothing, prefix):
    model = NGramModel.fit(corpus, n, 6, smoothing=smoothing, concentration=0.7)
    row = model.next_logprobs([prefix])[0]
    expected = [brute_ngram_logprob(corpus, n, 6, smoothing, 0.7, prefix, w) for w in range(6)]
    assert np.allclose(row, expected, atol=ATOL, rtol=0)
    assert np.isfinite(row).all()
    assert np.exp(row).sum() == pytest.approx(1.0, abs=1e-12)


@pytest.fixture(scope="module")
def ngram() -> NGramModel:
    rng = np.random.default_rng(0)
    return NGramModel.fit([list(rng.integers(0, VOCAB, size=40)) for _ in range(5)], n=3, vocab_size=VOCAB)


@settings(max_examples=30, deadline=None)
@given(prompt=tokens_st, ops=ops_st)
def test_ngram_session_matches_batched_rows_through_extend_rollback(ngram, prompt, ops):
    session = ngram.start(prompt)
    for op, arg in ops:
        if op == "extend":
            rows = session.extend(arg)
            first = session.length - len(arg)
            expected = ngram.next_logprobs([session.tokens[: first + j + 1] for j in range(len(arg))])
            assert np.allclose(rows, expected.reshape(len(arg), VOCAB), atol=ATOL, rtol=0)
        else:
            session.rollback(min(arg, session.length))
        assert np.allclose(session.next_logprobs(), ngram.next_logprobs([session.tokens])[0], atol=ATOL, rtol=0)


def test_ngram_score_sequences_is_sum_of_session_rows(ngram):
    rng = np.random.default_rng(3)
    for prompt in ([], [4, 2, 7]):
        sequences = [list(rng.integers(0, VOCAB, size=rng.integers(0, 7))) for _ in range(15)]
        scores = ngram.score_sequences(sequences, prompt=prompt)
        for seq, score in zip(sequences, scores):
            session = ngram.start(prompt)
            rows = np.vstack([session.next_logprobs()[None], session.extend(seq)])[: len(seq)]
            assert score == pytest.approx(float(rows[np.arange(len(seq)), seq].sum()), abs=ATOL)


def test_ngram_update_is_incremental_and_invalidates_rows():
    rng = np.random.default_rng(4)
    seq = list(rng.integers(0, VOCAB, size=30))
    prefixes = [seq[:i] for i in range(0, 30, 3)]
    whole = NGramModel.fit([seq], 3, VOCAB)
    online = NGramModel.fit([seq[:12]], 3, VOCAB, max_cached_rows=4)
    session = online.start(seq[:5])
    before = session.next_logprobs()
    online.next_logprobs(prefixes)  # fill (and overflow) the row cache
    online.update(seq, start=12)  # the new tokens, with their earlier context
    assert np.allclose(online.next_logprobs(prefixes), whole.next_logprobs(prefixes), atol=ATOL, rtol=0)
    assert not np.allclose(session.next_logprobs(), before)  # rows follow the updated counts
    assert np.allclose(session.next_logprobs(), whole.start(seq[:5]).next_logprobs(), atol=ATOL, rtol=0)


def test_ngram_bad_inputs_raise(ngram):
    with pytest.raises(ValueError, match="n must"):
        NGramModel(0, VOCAB)
    with pytest.raises(ValueError, match="smoothing"):
        NGramModel(2, VOCAB, smoothing="kneser")
    with pytest.raises(ValueError, match="concentration"):
        NGramModel(2, VOCAB, smoothing="dirichlet", concentration=0.0)
    with pytest.raises(ValueError, match="sequence"):
        NGramModel.fit([[0, VOCAB]], 2, VOCAB)
    with pytest.raises(ValueError, match="prefix"):
        ngram.next_logprobs([[-1]])
    with pytest.raises(ValueError, match="start"):
        ngram.update([1, 2], start=3)
    with pytest.raises(ValueError, match="rollback"):
        ngram.start([1]).rollback(2)
