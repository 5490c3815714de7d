"""Which continuations an index enumerates: one object that every part of enumeration asks.

A :class:`Support` is either every sequence of exactly ``max_len`` tokens (``eos`` None), or every sequence
that ends in ``eos`` and contains it only there, of at most ``max_len`` tokens (``max_len`` None: of any
length). With a ``constraint`` (a :class:`~speculum.enumeration.formats.automaton.TokenAutomaton`) only the token
sequences whose text is a member of its language count: complete when the automaton accepts (then
followed by ``eos`` when one is given), ``max_len`` being only a cap on the number of tokens. The prefix tree asks it which prefixes grow and which sequences are complete, the indexes ask it
whether a sequence belongs and how many sequences exist, and rescoring compares two of them with ``==``.

Example:
    >>> support = Support(max_len=3, eos=2)
    >>> support.size(vocab_size=3), support.contains((0, 1, 2)), support.contains((2, 2))
    (7, True, False)
    >>> support.describe()
    'continuations ending in eos=2, of at most 3 tokens'
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ...models.base import check_token_id, check_token_ids
from ...validation import InputError, check_optional_int

if TYPE_CHECKING:
    from ..formats.automaton import TokenAutomaton

__all__ = ["Support", "SupportAttributes"]


@dataclass(frozen=True)
class Support:
    """Every ``max_len``-token sequence (``eos`` None), or every sequence ending in its only ``eos`` of at
    most ``max_len`` tokens (``max_len`` None: no cap). The token ids range over the model's vocabulary."""

    max_len: int | None = None
    eos: int | None = None
    constraint: "TokenAutomaton | None" = None

    def __post_init__(self) -> None:
        if self.max_len is None and self.eos is None and self.constraint is None:
            raise InputError("give max_len (fixed-length continuations) or eos (continuations ending in eos)")
        # Canonical Python ints, so that two equal supports compare (and hash) equal.
        object.__setattr__(self, "max_len", check_optional_int(self.max_len, "max_len", minimum=1))
        object.__setattr__(self, "eos", check_optional_int(self.eos, "eos", minimum=0))
        constraint = self.constraint
        if constraint is not None and self.eos is None and constraint.accepting[0] and not len(constraint.tokens[0]):
            raise InputError(f"the {constraint.description} matches only the empty string, which has no tokens; "
                             "pass eos=True to score stopping right away")
        if constraint is not None and self.eos is None and not constraint.prefix_free():
            example = constraint.prefix_example()
            which = f" ({example[0]!r} and {example[1]!r})" if example else ""
            raise InputError(f"a member of the {constraint.description} is a proper prefix of another{which}: "
                             "without eos the longer one could never be told apart; pass eos=True")

    @classmethod
    def for_model(cls, *, max_len: int | None, eos: int | None, vocab_size: int,
                  constraint: "TokenAutomaton | None" = None) -> "Support":
        """The support with ``eos`` checked against the model's vocabulary (an ``InputError`` naming it)."""
        if eos is not None:
            eos = check_token_id(eos, vocab_size, name="eos")
        if constraint is not None and constraint.vocab_size != vocab_size:
            raise InputError(f"the constraint was compiled for {constraint.vocab_size} tokens; the model has "
                             f"{vocab_size}")
        return cls(max_len=max_len, eos=eos, constraint=constraint)

    def expandable(self, depth: int) -> bool:
        """Whether a prefix of ``depth`` tokens that is not complete may still grow inside the support."""
        return self.max_len is None or depth < self.max_len

    def forces_eos(self, depth: int) -> bool:
        """Whether only eos may follow a prefix of ``depth`` tokens (the last position under the cap)."""
        return self.eos is not None and self.max_len is not None and depth + 1 == self.max_len

    def is_complete(self, length: int, last_tokens: np.ndarray, states: np.ndarray | None = None) -> np.ndarray:
        """Element-wise: whether a sequence of ``length`` tokens ending in each of ``last_tokens`` (reaching
        automaton ``states`` under a constraint) is a support sequence, given that the prefix before its last
        token is a live prefix of the support."""
        last_tokens = np.asarray(last_tokens)
        if self.eos is not None:
            return last_tokens == self.eos
        if self.constraint is not None:
            return self.constraint.accepting[np.asarray(states)]
        return np.full(last_tokens.shape, length == self.max_len)

    def allowed(self, rows: np.ndarray, states: np.ndarray | None) -> np.ndarray:
        """``(c, V)`` next-token rows with every token the constraint forbids after ``states`` at ``-inf``
        (the rows themselves without a constraint)."""
        return self.allowed_with_mass(rows, states)[0]

    def allowed_with_mass(self, rows: np.ndarray, states: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """``allowed(rows, states)`` and ``(c,)`` the log of each row's allowed probability (None without a
        constraint)."""
        if self.constraint is None:
            return rows, None
        return self.constraint.mask(rows, states, eos=self.eos)

    def advance(self, states: np.ndarray | None, tokens: np.ndarray) -> np.ndarray | None:
        """Automaton states after ``tokens`` (eos keeps its state); None without a constraint."""
        if self.constraint is None:
            return None
        tokens = np.asarray(tokens)
        out = self.constraint.advance(states, tokens)
        if self.eos is not None:
            out = np.where(tokens == self.eos, np.asarray(states), out).astype(np.int32)
        return out

    def horizon(self, default: int) -> int:
        """The longest sequence length to consider: ``max_len`` or the constraint's longest sequence, or
        ``default`` for an unbounded support."""
        if self.constraint is not None:
            longest = self.constraint.longest_path()
            if longest is not None:
                longest += 1 if self.eos is not None else 0
                return longest if self.max_len is None else min(longest, self.max_len)
        return self.max_len if self.max_len is not None else default

    def size(self, vocab_size: int) -> int | None:
        """Exact number of support sequences over a vocabulary of ``vocab_size`` tokens (whatever their
        probability), or None when the support is infinite (eos-terminated without a cap).

        Fixed length: ``V ** max_len``. Eos-terminated: ``l - 1`` non-eos tokens then eos, for every length
        ``l <= max_len``: ``sum((V - 1) ** (l - 1))``. Constrained: the accepted token sequences."""
        if self.constraint is not None:
            return self.constraint.sequence_count(self.max_len, eos=self.eos is not None)
        if self.eos is None:
            return vocab_size ** self.max_len
        if self.max_len is None:
            return None
        return sum((vocab_size - 1) ** (length - 1) for length in range(1, self.max_len + 1))

    def contains(self, sequence: Sequence[int]) -> bool:
        """Whether ``sequence`` (token ids) is a support sequence."""
        return self._off_support(tuple(sequence), "sequence") is None

    def check(self, sequence: Sequence[int], vocab_size: int, *, name: str = "sequence") -> tuple[int, ...]:
        """``sequence`` as a tuple of ints; ``InputError`` naming ``name`` and the reason unless it consists
        of token ids in ``[0, vocab_size)`` and is a support sequence."""
        seq = tuple(check_token_ids(sequence, vocab_size, name=name))
        reason = self._off_support(seq, name)
        if reason is not None:
            raise InputError(reason)
        return seq

    def describe(self) -> str:
        """The support in words, for messages."""
        if self.constraint is not None:
            cap = "" if self.max_len is None else f", of at most {self.max_len} tokens"
            end = "" if self.eos is None else f", followed by eos={self.eos}"
            return f"token sequences spelling the {self.constraint.description}{end}{cap}"
        if self.eos is None:
            return f"length-{self.max_len} continuations"
        cap = "" if self.max_len is None else f", of at most {self.max_len} tokens"
        return f"continuations ending in eos={self.eos}{cap}"

    def _off_support(self, seq: tuple[int, ...], name: str) -> str | None:
        """Why ``seq`` is not a support sequence, or None when it is."""
        if self.constraint is not None:
            return self._off_constraint(seq, name)
        if self.eos is None:
            if len(seq) != self.max_len:
                return f"{name} has length {len(seq)}; the support is length-{self.max_len} sequences"
            return None
        if not seq or seq[-1] != self.eos or self.eos in seq[:-1]:
            return f"{name} is off the support: it must end in eos={self.eos} and contain it once"
        if self.max_len is not None and len(seq) > self.max_len:
            return f"{name} has length {len(seq)} > max_len={self.max_len}"
        return None


    def _off_constraint(self, seq: tuple[int, ...], name: str) -> str | None:
        if self.max_len is not None and len(seq) > self.max_len:
            return f"{name} has length {len(seq)} > max_len={self.max_len}"
        body = seq
        if self.eos is not None:
            if not seq or seq[-1] != self.eos:
                return f"{name} must end in eos={self.eos}"
            body = seq[:-1]
        state = self.constraint.walk(body)
        if state < 0 or not self.constraint.accepting[state]:
            text = self.constraint.text([t for t in body if 0 <= t < self.constraint.vocab_size])
            return f"{name} spells {text.decode('utf-8', 'replace')!r}, not a member of the {self.constraint.description}"
        return None


class SupportAttributes:
    """``max_len`` and ``eos`` of an index, read from its ``support`` (one spelling for every index)."""

    support: Support

    @property
    def max_len(self) -> int | None:
        return self.support.max_len

    @property
    def eos(self) -> int | None:
        return self.support.eos
