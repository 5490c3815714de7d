"""Constraints: a format (``Regex``) or a label set (``Choices``) compiled to a token-level automaton.

An enumeration index with a constraint ranges only over the token sequences whose decoded text is a member
of the constraint's language. ``compile`` turns it into a :class:`~.automaton.TokenAutomaton`
(the tokens allowed next from each state); the prefix tree expands only allowed tokens, so prefixes off the
format cost no forward at all. Token bytes come from the model's tokenizer (byte-level BPE included) or from
``vocabulary=[token text by id]`` on the constraint.

Example:
    >>> vocab = ["7", "8", "77", "x", "y", "xy"]
    >>> automaton = Regex(r"7[78]", vocabulary=vocab).compile(vocab_size=6)
    >>> automaton.language_size(), automaton.walk([2]) in automaton.accepting_states()
    (2, True)
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ...models.vocabulary import token_bytes
from ...validation import InputError, check_int
from .automaton import MAX_TOKEN_MOVES, MAX_TOKEN_STATES, TokenAutomaton
from .charfsm import MAX_CHAR_STATES, compile_chars

__all__ = ["Regex", "Choices", "TokenAutomaton", "compile_for"]

class _Constraint:
    """What ``Regex`` and ``Choices`` share: compiling against a model's vocabulary (cached per model)."""

    vocabulary: tuple | None

    def regex(self) -> str:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def char_budget(self) -> int:
        """The most states the constraint's automaton over characters may have."""
        return MAX_CHAR_STATES

    def compile(self, model: Any = None, *, vocab_size: int | None = None, exclude: Sequence[int] = (),
                max_states: int = MAX_TOKEN_STATES, max_moves: int = MAX_TOKEN_MOVES) -> "TokenAutomaton":
        """The token automaton of this constraint over ``model``'s vocabulary (or over ``vocabulary`` with
        ``vocab_size`` tokens). ``exclude``: token ids never allowed (the eos an index ends sequences with);
        ``max_states`` / ``max_moves``: its budget (:class:`~.automaton.TokenAutomaton`).
        Raises ``InputError`` for an invalid pattern, an empty language, or one no token sequence spells."""
        if self.vocabulary is not None:
            size = vocab_size if vocab_size is not None else (model.vocab_size if model is not None else len(self.vocabulary))
            pieces = token_bytes(_Sized(int(size)), vocabulary=self.vocabulary)
        else:
            if model is None:
                raise InputError("compiling a constraint needs a model (its tokenizer) or vocabulary=[...]")
            pieces = token_bytes(model)
        return TokenAutomaton.build(self.regex(), pieces, exclude=exclude, description=self.describe(),
                                    max_char_states=self.char_budget(), max_states=max_states, max_moves=max_moves)


def compile_for(constraint, model: Any, *, eos: int | None) -> "TokenAutomaton | None":
    """``constraint`` (``Regex`` / ``Choices`` / a ``TokenAutomaton`` / None) compiled for ``model``, with
    ``eos`` (which ends the sequences of an index) never allowed inside a member. Compilations are cached
    per model and constraint: the token walk over a large vocabulary is the expensive part."""
    if constraint is None or isinstance(constraint, TokenAutomaton):
        return constraint
    if not isinstance(constraint, _Constraint):
        raise InputError(f"constraint must be Regex(...) or Choices([...]), got {type(constraint).__name__}")
    exclude = () if eos is None else (int(eos),)
    try:
        cache = model.__dict__.setdefault("_speculum_automata", {})
    except AttributeError:          # a model without a __dict__: no cache
        cache = {}
    key = (constraint, exclude)
    if key not in cache:
        cache[key] = constraint.compile(model, vocab_size=int(model.vocab_size), exclude=exclude)
    return cache[key]


class _Sized:
    """A stand-in model for ``token_bytes(..., vocabulary=...)``: only the vocabulary size."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size


def _check_vocabulary(vocabulary) -> tuple | None:
    if vocabulary is None:
        return None
    if isinstance(vocabulary, (str, bytes)) or not isinstance(vocabulary, Iterable):
        raise InputError("vocabulary must be a sequence of token texts (str, bytes or None), one per token id")
    return tuple(vocabulary)


@dataclass(frozen=True)
class Regex(_Constraint):
    """The strings matching ``pattern`` in full (Python ``re`` syntax without anchors, lookarounds,
    back-references or unicode property classes; ``\\d`` and ``\\w`` are ASCII; ``\\uXXXX`` escapes and
    code-point ranges such as ``[\\u4e00-\\u9fff]`` are plain characters).

    The pattern is checked and its automaton over characters built here, without a model: ``InputError``
    for a syntax error, an unsupported construct, or an automaton of more than ``max_char_states`` states
    (default :data:`~.charfsm.MAX_CHAR_STATES`).

    Example: ``Regex(r" \\d{4}-\\d{4}")`` — a space, four digits, a dash, four digits."""

    pattern: str
    vocabulary: tuple | None = field(default=None, repr=False)
    max_char_states: int = field(default=MAX_CHAR_STATES, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise InputError(f"pattern must be a str, got {type(self.pattern).__name__}")
        if not self.pattern:
            raise InputError("the regex is empty")
        object.__setattr__(self, "vocabulary", _check_vocabulary(self.vocabulary))
        object.__setattr__(self, "max_char_states", check_int(self.max_char_states, "max_char_states", minimum=1))
        compile_chars(self.pattern, self.describe(), max_states=self.max_char_states)   # cached for compile()

    def char_budget(self) -> int:
        return self.max_char_states

    def regex(self) -> str:
        return self.pattern

    def describe(self) -> str:
        return f"regex {self.pattern!r}"


@dataclass(frozen=True)
class Choices(_Constraint):
    """Exactly the given strings (a label set). Duplicates and empty strings are refused."""

    strings: tuple[str, ...]
    vocabulary: tuple | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.strings, str):
            raise InputError("choices must be a sequence of strings, not one string")
        strings = tuple(self.strings)
        if not strings:
            raise InputError("choices is empty")
        for s in strings:
            if not isinstance(s, str):
                raise InputError(f"every choice must be a str, got {type(s).__name__}")
            if not s:
                raise InputError("a choice is the empty string (it has no tokens to score)")
        if len(set(strings)) != len(strings):
            dup = next(s for s in strings if strings.count(s) > 1)
            raise InputError(f"choice {dup!r} appears more than once")
        object.__setattr__(self, "strings", strings)
        object.__setattr__(self, "vocabulary", _check_vocabulary(self.vocabulary))

    def char_budget(self) -> int:
        # The automaton of a label set is the trie of its labels: never more states than characters, plus one.
        return max(MAX_CHAR_STATES, sum(len(s) for s in self.strings) + 2)

    def regex(self) -> str:
        return "|".join(f"({re.escape(s)})" for s in self.strings)

    def describe(self) -> str:
        return f"{len(self.strings)} choices"
