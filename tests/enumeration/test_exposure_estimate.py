"""The sampled rank of a canary within a format against brute force over every member: the sampler's laws,
the estimator's bias, the 95% interval's coverage, in token mode and in string mode (a vocabulary that
spells many strings several ways), and ``method="auto"``'s choice between exact and sampled.

Models are order-2 Markov chains over digit tokens, peaked (logit scale 3) like a language model writing a
number; the format ``\\d{4}`` has 10^4 members, all scored here.
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from scipy.stats import chisquare

from speculum.enumeration import AutoregressiveEnumerable, Regex, estimate_rank, estimate_ranks
from speculum.enumeration.estimation.estimate import rank_from_sample
from speculum.enumeration.estimation.format_walk import FormatWalk, path_logprobs
from speculum.enumeration.estimation.sampling import FormatSample, sample_format
from speculum.models import MarkovModel
from speculum.validation import InputError

DIGITS = [str(d) for d in range(10)]
VOCAB = DIGITS + ["x", "y"]                           # token mode: one spelling per member
SPELLED = DIGITS + ["12", "34", "00", "x"]            # string mode: "1234" has four spellings
PROMPT = [10]
FORMAT = r"\d{4}"


def chain(vocab, seed=3):
    return MarkovModel.random(len(vocab), order=2, scale=3.0, seed=seed)


def token_truth(model, vocab, pattern=FORMAT, **support):
    """Every token sequence of the format with its exact log-prob, and each one's exact rank."""
    index = AutoregressiveEnumerable(model, prompt=PROMPT, constraint=Regex(pattern, vocabulary=vocab), **support)
    items = index.top_k(10 ** 6)
    return index, {seq: (rank, lp) for rank, (seq, lp) in enumerate(items)}


def string_truth(model, vocab):
    """Every string of the format with its probability over all its spellings (brute force), and its rank."""
    _, tokens = token_truth(model, vocab)
    mass: dict[str, list[float]] = {}
    for seq, (_, lp) in tokens.items():
        mass.setdefault("".join(vocab[t] for t in seq), []).append(lp)
    scored = sorted(((text, float(np.logaddexp.reduce(lps))) for text, lps in mass.items()),
                    key=lambda item: (-item[1], item[0].encode()))
    return {text: (rank, lp) for rank, (text, lp) in enumerate(scored)}


@pytest.fixture(scope="module")
def tokens_case():
    model = chain(VOCAB)
    index, truth = token_truth(model, VOCAB)
    return model, index, truth


@pytest.fixture(scope="module")
def strings_case():
    model = chain(SPELLED, seed=4)
    index = AutoregressiveEnumerable(model, prompt=PROMPT, constraint=Regex(FORMAT, vocabulary=SPELLED), strings=True)
    return model, index, string_truth(model, SPELLED)


def canaries(truth, count, seed):
    """Half uniformly random members (deep ranks), half drawn from the model (shallow ones)."""
    rng = np.random.default_rng(seed)
    members = list(truth)
    lps = np.array([truth[m][1] for m in members])
    weights = np.exp(lps - np.logaddexp.reduce(lps))
    picks = list(rng.choice(len(members), count // 2, replace=False))
    picks += list(rng.choice(len(members), count - count // 2, p=weights))
    return [members[i] for i in picks]


# --------------------------------------------------------------------------------------------- the laws
@pytest.mark.parametrize("pattern,support", [(FORMAT, {}), ("[0-3x]{1,4}", {"eos": 11, "max_len": 3}),
                                             ("x[0-2]{1,3}y", {})])
def test_both_laws_sum_to_one_over_the_support_and_draws_record_them(pattern, support):
    """Each stratum's law is a distribution over exactly the support (a length cap included), and every
    draw carries its own path's laws."""
    model = chain(VOCAB)
    index, truth = token_truth(model, VOCAB, pattern, **support)
    walk = FormatWalk(model, index.support, PROMPT, 64)
    members = list(truth)
    sample = sample_format(model, Regex(pattern, vocabulary=VOCAB), prompt=PROMPT, samples=300, seed=2,
                           strata={1: 0.25, 0.5: 0.25, 0.25: 0.25, 0: 0.25}, **support)
    target, laws = path_logprobs(walk, members, sample.tilts)
    assert sample.tilts == (1.0, 0.5, 0.25, 0.0)
    assert np.allclose(target, [truth[m][1] for m in members], atol=1e-12)
    for law in laws.T:
        assert math.isclose(np.exp(np.logaddexp.reduce(law)), 1.0, rel_tol=1e-9)
    by_member = {m: (t, row) for m, t, row in zip(members, target, laws)}
    for item, recorded_target, recorded_laws in zip(sample.items, sample.target_logprob, sample.stratum_logprob):
        assert np.isclose(recorded_target, by_member[item][0], atol=1e-12)
        assert np.allclose(recorded_laws, by_member[item][1], atol=1e-12)
    counts = np.array(sample.stratum_sizes)
    mixture = np.logaddexp.reduce(laws + np.log(counts / 300), axis=1)
    assert math.isclose(np.exp(np.logaddexp.reduce(mixture)), 1.0, rel_tol=1e-9)
    # The tilted laws lie between the model's and the uniform one: tilting flattens the model's law.
    spread = [float(np.std(np.exp(law))) for law in laws.T]
    assert spread == sorted(spread, reverse=True)


def test_draws_follow_their_stratum_laws(tokens_case):
    """Chi-square goodness of fit of each stratum's draws to its law (bins of expected count >= 5)."""
    model, index, truth = tokens_case
    members = list(truth)
    sample = sample_format(model, Regex(FORMAT, vocabulary=VOCAB), prompt=PROMPT, samples=40_000, seed=5,
                           index=index, strata={1: 0.3, 0.4: 0.4, 0: 0.3})
    _, laws = path_logprobs(FormatWalk(model, index.support, PROMPT, 512), members, sample.tilts)
    for stratum, law in enumerate(laws.T):
        counts = Counter(item for item, s in zip(sample.items, sample.stratum) if s == stratum)
        observed = np.array([counts.get(m, 0) for m in members], dtype=float)
        expected = np.exp(law) * observed.sum()
        order = np.argsort(expected)                      # pool the rarest members into bins of >= 5
        _, bins = np.unique(np.cumsum(expected[order]) // 5.0, return_inverse=True)
        pooled_obs = np.bincount(bins, weights=observed[order])
        pooled_exp = np.bincount(bins, weights=expected[order])
        assert chisquare(pooled_obs, pooled_exp * pooled_obs.sum() / pooled_exp.sum()).pvalue > 1e-3


def test_the_same_seed_draws_the_same_set_whatever_the_batch(tokens_case):
    model, index, _ = tokens_case
    first = sample_format(model, Regex(FORMAT, vocabulary=VOCAB), prompt=PROMPT, samples=200, seed=9, batch_size=7)
    again = sample_format(model, Regex(FORMAT, vocabulary=VOCAB), prompt=PROMPT, samples=200, seed=9, index=index)
    other = sample_format(model, Regex(FORMAT, vocabulary=VOCAB), prompt=PROMPT, samples=200, seed=10, index=index)
    assert first.items == again.items and np.array_equal(first.proposal_logprob, again.proposal_logprob)
    assert first.items != other.items


def test_merged_sets_keep_exact_laws_and_an_unbiased_estimate(tokens_case):
    """Two sets of other sizes and shares pooled: each draw's law is the balance mixture over the pooled
    counts, and estimates from merged sets stay unbiased."""
    model, index, truth = tokens_case
    constraint = Regex(FORMAT, vocabulary=VOCAB)
    first = sample_format(model, constraint, prompt=PROMPT, samples=40, seed=1, index=index, uniform_share=0.5)
    second = sample_format(model, constraint, prompt=PROMPT, samples=60, seed=2, index=index, uniform_share=0.2)
    both = first.merged(second)
    assert both.stratum_sizes == (20 + 48, 20 + 12) and both.items == first.items + second.items
    expected = np.logaddexp(np.log(68 / 100) + both.model_logprob, np.log(32 / 100) + both.uniform_logprob)
    assert np.allclose(both.proposal_logprob, expected)
    item = next(m for m, (rank, _) in truth.items() if rank == 3_000)
    estimates = [rank_from_sample(
        sample_format(model, constraint, prompt=PROMPT, samples=64, seed=2 * k, index=index, uniform_share=0.25)
        .merged(sample_format(model, constraint, prompt=PROMPT, samples=32, seed=2 * k + 1, index=index,
                              uniform_share=0.5)),
        item, truth[item][1]).rank for k in range(200)]
    spread = np.std(estimates, ddof=1) / math.sqrt(len(estimates))
    assert abs(np.mean(estimates) - 3_000) <= 4 * spread and spread > 0
    with pytest.raises(InputError, match="can be merged"):
        first.merged(sample_format(model, constraint, prompt=[11], samples=10, uniform_share=0.5))
    with pytest.raises(InputError, match="same strata"):
        first.merged(sample_format(model, constraint, prompt=PROMPT, samples=16, index=index, strata={1: .5, .5: .5}))


# ------------------------------------------------------------------------------------- the estimator
@pytest.mark.parametrize("which", [0, 30, 400, 5_000, 9_000])
def test_the_estimate_is_unbiased(tokens_case, which):
    """Mean of 300 independent estimates within 4 standard errors of the true rank, shallow to deep."""
    model, index, truth = tokens_case
    item = next(m for m, (rank, _) in truth.items() if rank == which)
    estimates = np.array([rank_from_sample(sample_format(model, Regex(FORMAT, vocabulary=VOCAB), prompt=PROMPT,
                                                         samples=128, seed=1000 + k, index=index),
                                           item, truth[item][1]).rank for k in range(300)])
    spread = estimates.std(ddof=1) / math.sqrt(len(estimates))
    assert abs(estimates.mean() - which) <= 4 * spread + 1e-9
    if which:
        assert spread > 0                                 # the test could fail: the estimates do vary


def coverage(model, index, truth, constraint, *, count, samples, strings=False):
    """Each canary ranked from its own draws (seed k): the share of 95% intervals that cover the true rank,
    over all canaries and over those of rank > 0 (a rank-0 canary has no member before it, so its estimate
    is 0 and its interval [0, ...] covers whatever the draws: counting them alone would inflate the share),
    and the median |error| in bits."""
    covered, errors = [], []
    ranks = []
    for k, item in enumerate(canaries(truth, count, seed=77)):
        rank, lp = truth[item]
        sample = sample_format(model, constraint, prompt=PROMPT, samples=samples, seed=k, index=index, strings=strings)
        guess = rank_from_sample(sample, item, lp)
        covered.append(guess.ci_lo <= rank <= guess.ci_hi)
        errors.append(abs(math.log2(guess.rank + 1) - math.log2(rank + 1)))
        ranks.append(rank)
    covered, deeper = np.array(covered), np.array(ranks) > 0
    assert deeper.sum() >= 0.8 * count                  # the share below is not carried by rank-0 canaries
    return float(covered.mean()), float(covered[deeper].mean()), float(np.median(errors))


def test_the_95_percent_interval_covers_the_true_rank(tokens_case):
    """200 canaries, each with its own draws (fixed seeds): coverage between 88% and 99%, over all of them
    and over those of rank > 0 (an interval systematically too wide fails the upper bound)."""
    model, index, truth = tokens_case
    share, deeper, median_error = coverage(model, index, truth, Regex(FORMAT, vocabulary=VOCAB), count=200,
                                           samples=512)
    assert 0.88 <= share <= 0.99 and 0.88 <= deeper <= 0.99
    assert median_error < 0.15


@pytest.mark.parametrize("strings", [False, True])
def test_a_draw_of_the_item_is_never_counted_before_it(tokens_case, strings_case, strings):
    """The item's log-prob (teacher forcing) and its draws' (next-token rows) differ by float rounding on a
    float32 model (2e-5 nats on SmolLM2): draws of the item itself stay out of the rank and of the sure
    lower bound ``seen_before``, whichever way the rounding goes."""
    model, index, truth = strings_case if strings else tokens_case
    constraint = Regex(FORMAT, vocabulary=SPELLED if strings else VOCAB)
    sample = sample_format(model, constraint, prompt=PROMPT, samples=512, seed=4, index=index, strings=strings)
    lps = np.sort([lp for _, lp in truth.values()])
    checked = 0
    for item, (rank, lp) in sorted(truth.items(), key=lambda kv: kv[1][0])[1:40]:
        gap = np.abs(lps - lp)
        if item not in sample.items or np.sort(gap)[1] < 1e-3:
            continue                        # not drawn, or another member within the rounding below
        exact = rank_from_sample(sample, item, lp)
        for rounded in (lp - 1e-4, lp + 1e-4):
            guess = rank_from_sample(sample, item, rounded)
            assert guess.seen_before == exact.seen_before <= rank
            assert guess.rank == pytest.approx(exact.rank) and guess.hits == exact.hits
        checked += 1
    assert checked >= 10


def test_the_certified_bracket_leaves_the_item_out_by_identity(tokens_case):
    """A stored item whose scored log-prob is off its stored one by float rounding: its own leaf is not
    counted above it, so the certified bracket still holds its rank."""
    from speculum.enumeration.estimation.exposure import _rank_bracket

    model, _, truth = tokens_case
    index = AutoregressiveEnumerable(model, prompt=PROMPT, constraint=Regex(FORMAT, vocabulary=VOCAB))
    seek = index.seek_index()
    by_rank = {rank: item for item, (rank, _) in truth.items()}
    index.rank(by_rank[80])                             # stores every member down to rank 80
    lps = np.array([lp for _, lp in truth.values()])
    checked = 0
    for rank in range(1, 60):
        item, lp = by_rank[rank], truth[by_rank[rank]][1]
        if np.sort(np.abs(lps - lp))[1] < 1e-3:
            continue                                    # another member within the rounding
        assert seek.find(item) is not None
        for rounded in (lp - 1e-4, lp, lp + 1e-4):
            lo, hi = _rank_bracket(index, seek, item, rounded, strings=False)
            assert lo <= rank <= hi
        checked += 1
    assert checked >= 10


def test_string_mode_counts_each_string_once_and_covers(strings_case):
    """Strings spelled several ways: the string law sums to one over the strings, the estimate of a string
    rank is unbiased and its interval covers."""
    model, index, truth = strings_case
    constraint = Regex(FORMAT, vocabulary=SPELLED)
    sample = sample_format(model, constraint, prompt=PROMPT, samples=400, seed=3, index=index, strings=True)
    for text, lp in zip(sample.items, sample.target_logprob):
        assert lp == pytest.approx(truth[text][1], abs=1e-9)
    assert any(len(index.queries.tokenizations(text)) > 1 for text in sample.items)
    laws = dict(zip(sample.items, sample.proposal_logprob))
    spelled = [text for text in truth if "12" in text or "34" in text or "00" in text]
    assert spelled and any(text in laws for text in spelled)
    item = next(text for text, (rank, _) in truth.items() if rank == 700)
    estimates = [rank_from_sample(sample_format(model, constraint, prompt=PROMPT, samples=128, seed=500 + k,
                                                index=index, strings=True), item, truth[item][1]).rank
                 for k in range(150)]
    spread = np.std(estimates, ddof=1) / math.sqrt(len(estimates))
    assert abs(np.mean(estimates) - 700) <= 4 * spread and spread > 0
    share, deeper, _ = coverage(model, index, truth, constraint, count=200, samples=256, strings=True)
    assert 0.88 <= share <= 0.99 and 0.88 <= deeper <= 0.99


def test_the_string_law_sums_to_one_over_strings(strings_case):
    model, index, truth = strings_case
    walk = FormatWalk(model, index.support, PROMPT, 512)
    members = {}
    for text in truth:
        for seq in index.queries.tokenizations(text):
            members[seq] = text
    _, laws = path_logprobs(walk, list(members), (1.0, 0.3, 0.0))
    for law in laws.T:
        assert math.isclose(np.exp(np.logaddexp.reduce(law)), 1.0, rel_tol=1e-9)


# ------------------------------------------------------------------------- the conditional last step
def test_siblings_hold_every_member_one_last_token_away_with_exact_laws(tokens_case):
    """Each draw of a fixed-length format keeps the 10 members sharing its prefix, with their exact
    log-probs and every stratum's law of them, and its own stratum's step law (summing to 1)."""
    model, index, truth = tokens_case
    sample = sample_format(model, Regex(FORMAT, vocabulary=VOCAB), prompt=PROMPT, samples=200, seed=3, index=index,
                           strata={1: 0.5, 0.5: 0.25, 0: 0.25})
    siblings = sample.siblings
    assert siblings.present.all() and siblings.token.shape == (200, 10)
    members = sorted({x[:-1] + (int(t),) for x, row in zip(sample.items, siblings.token) for t in row})
    _, laws = path_logprobs(FormatWalk(model, index.support, PROMPT, 512), members, sample.tilts)
    law_of = dict(zip(members, laws))
    for i, x in enumerate(sample.items):
        tokens = siblings.token[i].tolist()
        for t, lp, row in zip(tokens, siblings.target[i], siblings.laws[i]):
            assert np.isclose(lp, truth[x[:-1] + (t,)][1], atol=1e-12)
            assert np.allclose(row, law_of[x[:-1] + (t,)], atol=1e-12)
        assert math.isclose(np.exp(siblings.own[i]).sum(), 1.0, rel_tol=1e-9)
        assert np.allclose(siblings.laws[i, tokens.index(x[-1])], sample.stratum_logprob[i], atol=1e-12)


def test_the_conditional_term_is_unbiased_and_no_noisier_than_the_drawn_token(tokens_case):
    """The same draws estimated with and without their siblings: both unbiased; the conditional estimate's
    spread over 200 seeds is below the plain one's (Rao-Blackwell)."""
    import dataclasses

    model, index, truth = tokens_case
    item = next(m for m, (rank, _) in truth.items() if rank == 1_500)
    with_siblings, plain = [], []
    for k in range(200):
        sample = sample_format(model, Regex(FORMAT, vocabulary=VOCAB), prompt=PROMPT, samples=96, seed=500 + k,
                               index=index)
        with_siblings.append(rank_from_sample(sample, item, truth[item][1]).rank)
        plain.append(rank_from_sample(dataclasses.replace(sample, siblings=None), item, truth[item][1]).rank)
    for estimates in (np.array(with_siblings), np.array(plain)):
        spread = estimates.std(ddof=1) / math.sqrt(len(estimates))
        assert abs(estimates.mean() - 1_500) <= 4 * spread and spread > 0
    assert np.std(with_siblings) < 0.9 * np.std(plain)


def test_the_set_grows_until_every_interval_is_narrow_enough(tokens_case):
    model, index, truth = tokens_case
    by_rank = {rank: item for item, (rank, _) in truth.items()}
    items = [by_rank[r] for r in (700, 2_500, 6_000)]
    constraint = Regex(FORMAT, vocabulary=VOCAB)
    first = estimate_ranks(model, items, constraint=constraint, prompt=PROMPT, method="sampled", samples=128, seed=2)
    grown = estimate_ranks(model, items, constraint=constraint, prompt=PROMPT, method="sampled", samples=128, seed=2,
                           target_bits=0.1, max_samples=20_000)
    half = [(r.exposure_interval[1] - r.exposure_interval[0]) / 2 for r in grown]
    assert max((r.exposure_interval[1] - r.exposure_interval[0]) / 2 for r in first) > 0.1
    assert max(half) <= 0.1 and 128 < grown[0].samples <= 20_000
    assert len({r.samples for r in grown}) == 1
    capped = estimate_ranks(model, items, constraint=constraint, prompt=PROMPT, method="sampled", samples=128, seed=2,
                            target_bits=0.001, max_samples=300)
    assert capped[0].samples == 300
    with pytest.raises(InputError, match="target_bits"):
        estimate_ranks(model, items, constraint=constraint, prompt=PROMPT, target_bits=0)


# ------------------------------------------------------------------------------------ method="auto"
def test_auto_is_exact_when_cheap_and_sampled_beyond_with_the_bracket_beside(tokens_case):
    model, _, truth = tokens_case
    constraint = Regex(FORMAT, vocabulary=VOCAB)
    by_rank = {rank: item for item, (rank, _) in truth.items()}
    items = [by_rank[r] for r in (0, 3, 40, 2_000, 7_000, 9_999)]
    reports = estimate_ranks(model, items, constraint=constraint, prompt=PROMPT, samples=2_000, seed=1,
                             max_forwards=50)
    methods = [r.method for r in reports]
    assert methods[0] == "exact" and methods[-1] == "sampled"
    for item, report in zip(items, reports):
        rank = truth[item][0]
        assert report.rank_lo <= rank <= report.rank_hi               # the certified bracket, always sound
        assert report.rank_lo <= report.ci_lo <= report.ci_hi <= report.rank_hi
        low, high = report.exposure_interval
        assert low <= report.exposure_bits <= high
        if report.method == "exact":
            assert report.rank == rank and report.samples == 0
        else:
            assert report.samples == 2_000 and report.ci_lo <= report.estimate <= report.ci_hi
            assert abs(math.log2(report.estimate + 1) - math.log2(rank + 1)) < 0.5
    default = estimate_rank(model, items[-1], constraint=constraint, prompt=PROMPT)
    assert default.method == "sampled" and default.samples == 4096


def test_auto_gives_up_at_once_an_exact_attempt_predicted_past_its_budget(tokens_case):
    """A deep canary: auto stops deepening as soon as the index's growth predicts its budget cannot reach the
    canary, where method="exact" spends the whole budget on a bracket; a shallow one is still exact."""
    model, _, truth = tokens_case
    constraint = Regex(FORMAT, vocabulary=VOCAB)
    by_rank = {rank: item for item, (rank, _) in truth.items()}
    spent = {}
    for method in ("auto", "exact"):
        index = AutoregressiveEnumerable(model, prompt=PROMPT, constraint=constraint)
        [report] = estimate_ranks(model, [by_rank[9_000]], constraint=constraint, prompt=PROMPT, index=index,
                                  method=method, max_forwards=300, **({"samples": 256} if method == "auto" else {}))
        spent[method] = index.seek_index().forwards
        assert report.method == ("sampled" if method == "auto" else "bracket")
    assert spent["exact"] >= 300 > 4 * spent["auto"]
    [shallow] = estimate_ranks(model, [by_rank[2]], constraint=constraint, prompt=PROMPT, samples=256,
                               max_forwards=300)
    assert shallow.method == "exact" and shallow.rank == 2


def test_exact_method_keeps_the_exact_or_bracket_answer(tokens_case):
    model, _, truth = tokens_case
    item = next(m for m, (rank, _) in truth.items() if rank == 5_000)
    options = dict(constraint=Regex(FORMAT, vocabulary=VOCAB), prompt=PROMPT)
    bracket = estimate_rank(model, item, method="exact", max_forwards=0, **options)
    assert bracket.method == "bracket" and (bracket.ci_lo, bracket.ci_hi) == (bracket.rank_lo, bracket.rank_hi)
    assert estimate_rank(model, item, max_forwards=0, **options).method == "bracket"     # no samples asked
    assert estimate_rank(model, item, method="exact", max_forwards=10 ** 6, **options).rank == 5_000


def test_many_canaries_share_one_set_of_draws(tokens_case, monkeypatch):
    import speculum.enumeration.estimation.exposure as exposure

    model, index, truth = tokens_case
    calls = []
    draw = exposure.sample_format
    monkeypatch.setattr(exposure, "sample_format", lambda *a, **k: calls.append(1) or draw(*a, **k))
    items = canaries(truth, 20, seed=1)
    reports = estimate_ranks(model, items, constraint=Regex(FORMAT, vocabulary=VOCAB), prompt=PROMPT,
                             method="sampled", samples=600, max_forwards=0)
    assert len(calls) == 1 and all(r.method == "sampled" for r in reports)
    given = sample_format(model, Regex(FORMAT, vocabulary=VOCAB), prompt=PROMPT, samples=600, index=index)
    again = estimate_ranks(model, items, constraint=Regex(FORMAT, vocabulary=VOCAB), prompt=PROMPT, sample=given,
                           method="sampled", max_forwards=0)
    assert len(calls) == 1
    assert [r.estimate for r in again] == [r.estimate for r in reports]


# ------------------------------------------------------------------------------------------- errors
def test_bad_input_is_named(tokens_case):
    model, index, truth = tokens_case
    constraint = Regex(FORMAT, vocabulary=VOCAB)
    item = next(iter(truth))
    with pytest.raises(InputError, match="method must be one of"):
        estimate_rank(model, item, constraint=constraint, prompt=PROMPT, method="fast")
    with pytest.raises(InputError, match="give a constraint"):
        estimate_rank(model, item, prompt=PROMPT, method="sampled")
    with pytest.raises(InputError, match="never samples"):
        estimate_rank(model, item, constraint=constraint, prompt=PROMPT, method="exact", samples=10)
    other = sample_format(model, constraint, prompt=[11], samples=16)
    with pytest.raises(InputError, match="another format"):
        estimate_rank(model, item, constraint=constraint, prompt=PROMPT, sample=other)
    with pytest.raises(InputError, match="not a member"):
        estimate_rank(model, (1, 2, 3), constraint=constraint, prompt=PROMPT, method="sampled", samples=10)
    with pytest.raises(InputError, match="pass max_len"):
        sample_format(model, Regex(r"\d+", vocabulary=VOCAB), prompt=PROMPT, eos=11, samples=16)
    with pytest.raises(InputError, match="samples must be"):
        sample_format(model, constraint, prompt=PROMPT, samples=1)
    with pytest.raises(InputError, match="another format"):
        sample_format(model, Regex(r"\d{3}", vocabulary=VOCAB), prompt=PROMPT, samples=16, index=index)
    with pytest.raises(InputError, match="fewer than two draws"):
        sample_format(model, constraint, prompt=PROMPT, samples=3, uniform_share=0.2)
    with pytest.raises(InputError, match="fewer than two draws"):
        sample_format(model, constraint, prompt=PROMPT, samples=10, strata={1: 0.1, 0: 0.9})
    with pytest.raises(InputError, match="tilt must be"):
        sample_format(model, constraint, prompt=PROMPT, samples=64, strata={1.5: 0.5, 0: 0.5})
    with pytest.raises(InputError, match="not both"):
        sample_format(model, constraint, prompt=PROMPT, samples=64, strata={1: 1.0}, uniform_share=0.5)
    with pytest.raises(InputError, match="positive share"):
        sample_format(model, constraint, prompt=PROMPT, samples=64, strata={1: 0.0})
    assert isinstance(other, FormatSample)


def test_unconstrained_exact_method_skips_the_envelope():
    model = MarkovModel.random(6, seed=2)
    seq = [3, 1, 4, 1]
    everything = AutoregressiveEnumerable(model, max_len=4, prompt=[0])
    report = estimate_rank(model, seq, prompt=[0], method="exact", exact_limit=0)
    assert report.method == "exact" and report.rank == everything.rank(seq)
    assert (report.ci_lo, report.ci_hi) == (report.rank, report.rank)
    assert estimate_rank(model, seq, prompt=[0], exact_limit=0).method == "envelope"


# ------------------------------------------------------------------------------------- the real model
@pytest.mark.slow
@pytest.mark.llm
def test_sampled_ranks_on_smollm2_cover_the_exact_ones():
    """SmolLM2 after "My PIN is", " \\d{3}" (1,000 members, one spelling each): the exact index ranks them
    all; four sets of 2,048 draws each estimate 30 canaries' ranks, and the intervals cover them (the
    canaries of one set share its draws, so their misses go together: coverage is pooled over sets)."""
    pytest.importorskip("torch")
    import speculum

    model = speculum.load_model()
    prompt = model.encode("My PIN is", chat=False)
    constraint = Regex(r" \d{3}")
    index = AutoregressiveEnumerable(model, prompt=prompt, constraint=constraint)
    truth = {seq: (rank, lp) for rank, (seq, lp) in enumerate(index.top_k(1000))}
    assert len(truth) == 1000
    members = list(truth)
    picks = np.random.default_rng(0).choice(len(members), 30, replace=False)
    covered, errors = 0, []
    for seed in range(4):
        sample = sample_format(model, constraint, prompt=prompt, samples=2048, seed=seed, index=index)
        for i in picks:
            rank, lp = truth[members[i]]
            guess = rank_from_sample(sample, members[i], lp)
            covered += guess.ci_lo <= rank <= guess.ci_hi
            errors.append(abs(math.log2(guess.rank + 1) - math.log2(rank + 1)))
    assert covered >= 0.85 * 120 and np.median(errors) < 0.1


@pytest.mark.parametrize("module", ["speculum.enumeration.estimation.sampling",
                                    "speculum.enumeration.estimation.estimate",
                                    "speculum.enumeration.estimation.exposure"])
def test_the_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted and not result.failed
