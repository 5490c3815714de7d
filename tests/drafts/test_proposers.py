"""Fixed-token proposers: PromptLookup equals a brute-force scan through growing, truncated and replaced
contexts; NGramProposer is the greedy continuation of its n-gram model (and learns online when asked)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.decoding.plan import MatchingProposer
from speculum.models import NGramModel, NGramProposer, PromptLookup, Proposer
from speculum.validation import InputError


def brute_prompt_lookup(context, max_ngram, min_ngram, num_pred_tokens, max_tokens, max_agreement=32,
                        with_match=False):
    """Scan every n from long to short; among the earlier starts of the tail n-gram take the one whose
    preceding tokens agree longest with the context's (ties: the earliest); copy with overlap."""
    budget = min(num_pred_tokens, max_tokens)
    result = ([], 0)
    for n in range(max_ngram, min_ngram - 1, -1) if budget else ():
        tail = context[len(context) - n:]
        best, best_agreement = None, -1
        for start in range(0, len(context) - n):
            if len(tail) == n and context[start:start + n] == tail:
                agreement = n
                while (agreement < max_agreement and start - (agreement - n) - 1 >= 0
                       and context[start - (agreement - n) - 1] == context[len(context) - agreement - 1]):
                    agreement += 1
                if agreement > best_agreement:
                    best, best_agreement = start, agreement
        if best is not None:
            extended = list(context)
            for k in range(budget):
                extended.append(extended[best + n + k])
            result = (extended[len(context):], best_agreement)
            break
    return result if with_match else result[0]


edit_st = st.one_of(
    st.tuples(st.just("grow"), st.lists(st.integers(0, 3), max_size=8)),
    st.tuples(st.just("truncate"), st.integers(0, 10)),
    st.tuples(st.just("replace"), st.lists(st.integers(0, 3), max_size=15)),
)


@settings(max_examples=150, deadline=None)
@given(max_ngram=st.integers(1, 4), data=st.data(), edits=st.lists(edit_st, min_size=1, max_size=10),
       num_pred_tokens=st.integers(1, 5))
def test_prompt_lookup_equals_brute_force_through_edits(max_ngram, data, edits, num_pred_tokens):
    min_ngram = data.draw(st.integers(1, max_ngram))
    lookup = PromptLookup(max_ngram, min_ngram, num_pred_tokens, max_agreement=max_ngram + 2)
    context: list[int] = []
    for kind, arg in edits:
        if kind == "grow":
            context = context + arg
        elif kind == "truncate":
            context = context[: max(0, len(context) - arg)]
        else:
            context = list(arg)
        max_tokens = data.draw(st.integers(0, 6))
        expected = brute_prompt_lookup(context, max_ngram, min_ngram, num_pred_tokens, max_tokens,
                                       max_agreement=max_ngram + 2, with_match=True)
        assert lookup.propose_with_match(context, max_tokens) == expected


@settings(max_examples=50, deadline=None)
@given(contexts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), min_size=2, max_size=4),
       max_ngram=st.integers(1, 3), num_pred_tokens=st.integers(1, 4))
def test_a_generation_s_own_prompt_lookup_proposes_what_the_shared_one_does(contexts, max_ngram, num_pred_tokens):
    """``per_generation`` gives an object of the same settings and an empty index of its own: taking turns
    with other contexts on one shared object or each on its own, every proposal is the brute-force one."""
    shared = PromptLookup(max_ngram=max_ngram, num_pred_tokens=num_pred_tokens, vocab_size=4)
    own = [shared.per_generation() for _ in contexts]
    assert all(o is not shared and o.indexed == 0 for o in own) and len({id(o) for o in own}) == len(own)
    for step in range(1, 21):                        # each context grows a token at a time, in turns
        for context, mine in zip(contexts, own):
            prefix = context[:step]
            want = brute_prompt_lookup(prefix, max_ngram, 1, num_pred_tokens, 3, with_match=True)
            assert shared.propose_with_match(prefix, 3) == mine.propose_with_match(prefix, 3) == want


def test_prompt_lookup_prefers_longer_and_better_agreeing_matches():
    lookup = PromptLookup(max_ngram=2, min_ngram=1, num_pred_tokens=3)
    # tail (7, 1): only "7 1" at 0..1 matches with n=2, although "1" alone occurs more recently.
    assert lookup.propose([7, 1, 2, 3, 1, 9, 7, 1], 3) == [2, 3, 1]
    # n=1: "1" occurs at 1 and 4; neither agrees further back, so the earliest (the "source") wins.
    assert lookup.propose_with_match([4, 1, 5, 6, 1, 8, 3, 1], 2) == ([5, 6], 1)
    # ...unless a later one agrees longer: "3 1" at 5..6 matches the tail's "3 1".
    assert PromptLookup(max_ngram=1).propose_with_match([4, 1, 5, 3, 1, 8, 3, 1], 2) == ([8, 3], 2)
    assert lookup.propose([1, 2, 3], 3) == []
    assert lookup.propose(np.array([5, 6, 5]), 3) == [6, 5, 6]  # arrays accepted, Python ints returned
    assert all(type(t) is int for t in lookup.propose(np.array([5, 6, 5]), 3))
    # A repeating pattern is continued periodically (an overlapping copy), not cut at the context's end.
    assert lookup.propose([1, 2, 1, 2, 1, 2], 3) == [1, 2, 1]


def test_prompt_lookup_long_context_stays_exact():
    rng = np.random.default_rng(0)
    context = rng.integers(0, 50, size=3000).tolist()
    lookup = PromptLookup(max_ngram=3, num_pred_tokens=5)
    for length in range(2000, 3000, 7):
        if length % 5 == 0:
            length -= 3  # simulate a rollback of rejected tokens between calls
        assert lookup.propose(context[:length], 5) == brute_prompt_lookup(context[:length], 3, 1, 5, 5)


def test_proposers_satisfy_protocol_and_validate():
    model = NGramModel(2, vocab_size=5)
    assert isinstance(PromptLookup(), Proposer) and isinstance(NGramProposer(model), Proposer)
    assert PromptLookup().vocab_size is None and NGramProposer(model).vocab_size == 5
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="num_pred_tokens"):
        PromptLookup(num_pred_tokens=0)
    with pytest.raises(ValueError, match="max_tokens"):
        PromptLookup().propose([1, 2], -1)
    with pytest.raises(ValueError, match="context"):
        PromptLookup(vocab_size=5).propose([1, 5], 2)
    with pytest.raises(ValueError, match="model"):
        NGramProposer(object())
    with pytest.raises(ValueError, match="min_context"):
        NGramProposer(model, min_context=2)
    with pytest.raises(ValueError, match="tokens"):
        NGramProposer(model).propose([7], 2)
    # Nothing is coerced: a float or a bool where a count is expected is refused, naming the argument.
    for bad in (dict(max_ngram=2.0), dict(num_pred_tokens=True), dict(max_agreement=1)):
        with pytest.raises(InputError, match=next(iter(bad))):
            PromptLookup(**bad)
    with pytest.raises(InputError, match="max_tokens"):
        PromptLookup().propose([1, 2], 1.5)
    assert isinstance(PromptLookup(), MatchingProposer) and isinstance(NGramProposer(model), MatchingProposer)


def greedy_reference(model: NGramModel, context: list[int], k: int) -> list[int]:
    out: list[int] = []
    for _ in range(k):
        out.append(int(np.argmax(model.next_logprobs([context + out])[0])))
    return out


@settings(max_examples=40, deadline=None)
@given(corpus=st.lists(st.lists(st.integers(0, 5), max_size=15), max_size=3), n=st.integers(1, 4),
       context=st.lists(st.integers(0, 5), max_size=8), max_tokens=st.integers(0, 6))
def test_ngram_proposer_is_the_greedy_continuation(corpus, n, context, max_tokens):
    model = NGramModel.fit(corpus, n, 6)
    proposal = NGramProposer(model, num_pred_tokens=4).propose(context, max_tokens)
    assert proposal == greedy_reference(model, context, min(4, max_tokens))


def test_ngram_proposer_learns_the_context_online():
    rng = np.random.default_rng(1)
    text = rng.integers(0, 8, size=60).tolist()
    draft = NGramProposer(NGramModel(3, vocab_size=8), num_pred_tokens=3, learn=True)
    counted = 0
    for length in (10, 25, 22, 40, 60):  # grows, rolls back (nothing is uncounted), grows again
        proposal = draft.propose(text[:length], 3)
        counted = max(counted, length)
        assert proposal == greedy_reference(NGramModel.fit([text[:counted]], 3, 8), text[:length], 3)
    # an unseen context with min_context=2 proposes nothing rather than guessing from unigrams
    strict = NGramProposer(NGramModel.fit([[0, 1, 2, 3]], 3, 8), min_context=2)
    assert strict.propose([5, 6], 4) == []
    assert strict.propose([0, 1], 4) == [2, 3]


def test_ngram_proposer_reports_the_evidence_behind_its_first_token():
    model = NGramModel.fit([[1, 2, 3, 1, 2, 3, 1, 2, 4]], n=3, vocab_size=6)
    proposer = NGramProposer(model, num_pred_tokens=3)
    tokens, (order, quarter) = proposer.propose_with_match([1, 2], 3)
    assert tokens == proposer.propose([1, 2], 3)
    assert order == model.context_order([1, 2]) == 2
    assert quarter == min(int(4 * model.next_probabilities([1, 2]).max()), 3)
    # No seen context and min_context=1: no proposal, no evidence.
    assert NGramProposer(model, min_context=1).propose_with_match([5, 5], 3) == ([], (0, 0))


def test_proposers_can_be_copied_and_pickled_despite_their_lock():
    import copy
    import pickle

    lookup = PromptLookup(max_ngram=2)
    context = [1, 2, 3, 1, 2, 4, 1, 2]
    expected = lookup.propose(context, 3)
    for clone in (copy.deepcopy(lookup), pickle.loads(pickle.dumps(lookup))):
        assert clone.propose(context, 3) == expected and clone._lock is not lookup._lock
    learner = NGramProposer(NGramModel(3, vocab_size=5), learn=True)
    assert copy.deepcopy(learner).propose(context, 3) == learner.propose(context, 3)
