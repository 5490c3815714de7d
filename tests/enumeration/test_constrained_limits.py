"""Constraints within bounds: a regex's automaton over characters within a state budget, the token automaton
built only as far as queries reach (and exactly the automaton a full build gives), code-point ranges written
with escapes, and one-line errors naming each limit."""
from __future__ import annotations

import re
from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from support.automaton_reference import full_build
from speculum.enumeration import AutoregressiveEnumerable, Regex
from speculum.models.base import BaseModel, RecomputeSession
from speculum.validation import InputError

BYTES = [bytes([b]) for b in range(256)]              # token b spells byte b: every UTF-8 text has one spelling
VOCAB = ["7", "8", "77", "x", "y", "xy", None]


def bpe_like(n: int, seed: int = 0) -> list[bytes | None]:
    """``n`` tokens: the 256 single bytes, short words (some cut inside a UTF-8 character, as byte-level BPE
    has), and a text-less eos last."""
    rng = np.random.default_rng(seed)
    alphabet = list(" abcdefghijklmnopqrstuvwxyz0123456789.,'") + ["é", "ü", "中", "文", "😀"]
    words = set(BYTES)
    while len(words) < n - 1:
        data = "".join(rng.choice(alphabet, size=int(rng.integers(1, 9)))).encode()
        if rng.random() < 0.05:
            data = data[:int(rng.integers(1, len(data) + 1))]
        words.add(data)
    return sorted(words) + [None]


# --------------------------------------------------------------------------- the character automaton
def test_an_exponential_regex_is_refused_naming_it_and_the_limit():
    """(a|b)*a(a|b){15} needs 2^16 states: refused at the budget, not determinised for minutes."""
    with pytest.raises(InputError) as caught:
        Regex(" (a|b)*a(a|b){15}", vocabulary=VOCAB).compile(vocab_size=len(VOCAB))
    message = str(caught.value)
    assert "\n" not in message and "' (a|b)*a(a|b){15}'" in message
    assert "needs more than 10,000 states (the limit)" in message


def test_the_state_budget_counts_the_automatons_states():
    """(a|b)*a(a|b){8} has 2^9 + 1 = 513 states: it compiles with a budget of 513 and not with 512."""
    from speculum.enumeration.formats.charfsm import compile_chars

    pattern = "(a|b)*a(a|b){8}"
    assert compile_chars(pattern, "regex", max_states=513).n_states == 513
    with pytest.raises(InputError, match="more than 512 states"):
        compile_chars(pattern, "regex", max_states=512)
    with pytest.raises(InputError, match="more than 100 states"):
        Regex(pattern, max_char_states=100)


@pytest.mark.parametrize("pattern", ["(a|b)*a(a|b){3}", "x(y|z){2,4}", "[^a]+b?", "(ab|a)*c", ".{0,7}", "é|ü{1,2}",
                                     "(?i)ab", "a{2}(b|c)*"])
def test_the_budgeted_determinisation_builds_interegulars_own_automaton(pattern):
    import interegular

    from speculum.enumeration.formats.charfsm import _BudgetedCrawl

    plain = interegular.parse_pattern(pattern).to_fsm()
    with _BudgetedCrawl(10_000):
        budgeted = interegular.parse_pattern(pattern).to_fsm()
    assert (budgeted.initial, budgeted.finals, budgeted.map) == (plain.initial, plain.finals, plain.map)


# --------------------------------------------------------------------------------- code-point ranges
@pytest.mark.parametrize("pattern", [r" [\u4e00-\u9fff]{2}", " [\u4e00-\u9fff]{2}"])
def test_a_code_point_range_compiles_written_as_escapes_or_characters(pattern):
    automaton = Regex(pattern, vocabulary=BYTES).compile(vocab_size=256)
    assert automaton.language_size() == 20992 ** 2
    assert automaton.walk(list(" 中文".encode())) in automaton.accepting_states()
    assert automaton.walk(list(" 中a".encode())) == -1


@pytest.mark.parametrize("pattern,member,size", [
    (r"\u002e", ".", 1),                       # an escaped metacharacter stays literal
    (r"\x2e", ".", 1),
    (r"\\u4e00", "\\u4e00", 1),                # an escaped backslash: no escape follows it
    (r"[\U0001F600-\U0001F60F]", "😀", 16),
    (r"\N{EM DASH}-", "—-", 1),
])
def test_escapes_stand_for_their_characters(pattern, member, size):
    automaton = Regex(pattern, vocabulary=BYTES).compile(vocab_size=256)
    assert automaton.language_size() == size
    assert automaton.walk(list(member.encode())) in automaton.accepting_states()


@pytest.mark.parametrize("pattern,message", [
    (r"\p{L}+", r"unicode property classes \(\\p\{...\}"),
    (r"[\P{Lu}]", r"unicode property classes"),
    (r"(a)\1", "unsupported"),
    (r"\u12", "incomplete escape"),
])
def test_what_is_unsupported_is_named(pattern, message):
    with pytest.raises(InputError, match=message):
        Regex(pattern)


# ------------------------------------------------------------------------------ the token automaton
class ZipfModel(BaseModel):
    """A cheap model over a large vocabulary: after token ``t``, eos has probability 0.3 and the rest follows
    Zipf's law (exponent 2) over the vocabulary rotated by a multiple of ``t``; a few tokens hold most of
    the mass, so an enumeration expands few prefixes."""

    def __init__(self, vocab_size: int, eos: int) -> None:
        self.vocab_size, self.eos_token_id = vocab_size, eos
        weights = 1.0 / np.arange(1, vocab_size + 1) ** 2
        self.base = np.log(0.7 * weights / weights.sum())

    def rows(self, tokens) -> np.ndarray:
        shift = 7919 * np.asarray(tokens)[:, None]
        rows = self.base[(np.arange(self.vocab_size)[None, :] + shift) % self.vocab_size]
        rows[:, self.eos_token_id] = np.logaddexp(rows[:, self.eos_token_id], np.log(0.3))
        return rows

    def next_logprobs(self, prefixes):
        return self.rows([prefix[-1] for prefix in prefixes])

    def start(self, prompt):
        return RecomputeSession(self, prompt, self.rows)


def test_a_wide_format_on_a_real_size_vocabulary_builds_only_what_top_k_reaches():
    """'.{0,50}' over 50,000 tokens with max_len=3: only the states of the expanded prefixes are built."""
    pieces = bpe_like(50_000)
    eos = len(pieces) - 1
    model = ZipfModel(len(pieces), eos)
    ar = AutoregressiveEnumerable(model, prompt=[0], constraint=Regex(".{0,50}", vocabulary=pieces), eos=True,
                                  max_len=3)
    items = ar.top_k(5)
    automaton = ar.support.constraint
    assert len(items) == 5 and all(seq[-1] == eos and len(seq) <= 3 for seq, _ in items)
    assert all(re.fullmatch(".{0,50}", automaton.text(seq[:-1]).decode(), re.S) for seq, _ in items)
    # The full build has every state named here (thousands), each with ~50,000 moves.
    assert automaton.built_states <= 250 and automaton.stored_moves <= 20 * len(pieces), automaton.built_states


def test_an_unbounded_wide_format_answers_top_k_and_counts_only_within_its_budget():
    """'.{0,1000}' with eos and no cap: top-k needs a few states; counting every sequence would need them
    all, which the move budget turns into a one-line error."""
    from speculum.enumeration.formats.automaton import AutomatonBudgetError

    pieces = bpe_like(5_000, seed=1)
    eos = len(pieces) - 1
    model = ZipfModel(len(pieces), eos)
    automaton = Regex(".{0,1000}", vocabulary=pieces).compile(model, exclude=[eos], max_moves=200 * len(pieces))
    ar = AutoregressiveEnumerable(model, prompt=[0], constraint=automaton, eos=eos)
    assert len(ar.top_k(3)) == 3 and automaton.built_states <= 250
    with pytest.raises(AutomatonBudgetError, match=r"more than [\d,]+ (states|token moves) .*max_") as caught:
        ar.support.size(len(pieces))
    assert "\n" not in str(caught.value) and "'.{0,1000}'" in str(caught.value)


def test_too_many_states_is_a_one_line_error():
    from speculum.enumeration.formats.automaton import AutomatonBudgetError

    automaton = Regex("[a-z]{0,40}", vocabulary=BYTES).compile(vocab_size=256, max_states=10)
    with pytest.raises(AutomatonBudgetError, match=r"more than 10 states .*max_states"):
        automaton.explore()


# Characters the random vocabularies spell, one to four UTF-8 bytes each, and the bytes they are made of.
CHARS = ["a", "b", "c", "x", "y", " ", "1", "é", "ü", "中", "文", "😀"]
CHAR_BYTES = sorted({b for char in CHARS for b in char.encode()})
PATTERNS = ["[a-c]{1,3}", "a(b|c)*x", "(é|ab)+ ?", "[\u4e00-\u9fff]x?", ".{0,3}", "[^a]b", "x|xy|xyz", "(ab)*c",
            r"\d{2}", "é{2}|ü", " [à-ÿ]{1,2}", "😀|中文", "[a😀]{2,3}", "(a|b)*a(a|b)"]


@st.composite
def vocabularies(draw):
    """Tokens of one to three characters, some cut inside a character, some bytes alone; sometimes every
    ASCII byte and every byte of those characters a token of its own (as in byte-level BPE)."""
    words = draw(st.lists(st.lists(st.sampled_from(CHARS), min_size=1, max_size=3), min_size=1, max_size=25))
    pieces = {"".join(word).encode() for word in words}
    pieces |= {piece[:draw(st.integers(1, len(piece)))] for piece in list(pieces)[:draw(st.integers(0, 5))]}
    pieces |= {bytes([b]) for b in draw(st.lists(st.integers(0, 255), max_size=8))}
    if draw(st.booleans()):
        pieces |= {bytes([b]) for b in list(range(0x80)) + CHAR_BYTES}
    return sorted(pieces) + [None]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=vocabularies(), pattern=st.sampled_from(PATTERNS))
def test_the_automaton_built_on_demand_is_the_full_build(pieces, pattern):
    """Same states, same moves from every state, same accepting states (up to numbering), the same global
    answers, and the same refusal when nothing can be spelled."""
    from speculum.enumeration.formats.automaton import TokenAutomaton
    from speculum.enumeration.formats.charfsm import compile_chars

    reference = full_build(compile_chars(pattern, "regex"), pieces)
    if reference is None:
        with pytest.raises(InputError, match="no token sequence|matches no string"):
            TokenAutomaton.build(pattern, pieces)
        return
    automaton = TokenAutomaton.build(pattern, pieces)
    accepting, moves = reference
    pair, queue = {0: 0}, deque([0])              # my state -> the reference's, breadth first
    while queue:
        mine = queue.popleft()
        theirs = pair[mine]
        tokens, targets = automaton.moves(mine)
        assert tokens.tolist() == [t for t, _ in moves[theirs]]
        assert bool(automaton.accepting[mine]) == accepting[theirs]
        for target, (_, expected) in zip(targets.tolist(), moves[theirs]):
            if target not in pair:
                pair[target] = expected
                queue.append(target)
            assert pair[target] == expected
    assert automaton.n_states == len(moves) and sorted(pair.values()) == list(range(len(moves)))
    assert automaton.prefix_free() == (not any(a and m for a, m in zip(accepting, moves)))
    assert automaton.longest_path() == _longest(accepting, moves)
    assert automaton.sequence_count(4, eos=False) == _count(accepting, moves, 4)


def _longest(accepting: list[bool], moves: list[list[tuple[int, int]]]) -> int | None:
    """Most tokens of an accepted sequence (None on a cycle: every state is live and reachable)."""
    indegree = [0] * len(moves)
    for edges in moves:
        for _, target in edges:
            indegree[target] += 1
    order, ready = [], [s for s in range(len(moves)) if not indegree[s]]
    while ready:
        state = ready.pop()
        order.append(state)
        for _, target in moves[state]:
            indegree[target] -= 1
            if not indegree[target]:
                ready.append(target)
    if len(order) < len(moves):
        return None
    depth = {0: 0}
    for state in order:
        for _, target in moves[state]:
            if state in depth:
                depth[target] = max(depth.get(target, 0), depth[state] + 1)
    return max(depth[s] for s in range(len(moves)) if accepting[s])


def _count(accepting: list[bool], moves: list[list[tuple[int, int]]], steps: int) -> int:
    counts, total = {0: 1}, int(accepting[0])
    for _ in range(steps):
        nxt: dict[int, int] = {}
        for state, count in counts.items():
            for _, target in moves[state]:
                nxt[target] = nxt.get(target, 0) + count
        counts = nxt
        total += sum(c for s, c in counts.items() if accepting[s])
    return total
