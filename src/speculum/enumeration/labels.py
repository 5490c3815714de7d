"""Scoring a label set: every choice's exact log-prob, rank and share of the set, in one pass over a trie.

An evaluator asking "which of these labels does the model prefer, and how strongly" would otherwise send
one teacher-forcing request per label, re-running every prefix the labels share. Here all the labels'
token sequences go into one prefix trie; the trie is walked level by level, and at each depth every
*internal* node (a prefix that some longer label continues) is forwarded once, in batched
``next_logprobs`` calls. Each child's step log-prob is read from its parent's row, so a label costs only the
prefixes no other label has already paid for, and leaves cost nothing.

Guarantee (exact): ``log_probs`` are the model's own ``log p(tokens | prompt)``, the same numbers one
teacher-forcing request per choice gives up to float rounding that depends on batch composition; ``ranks``
and ``log_mass`` (the log of the set's total probability) follow exactly from them.

Example:
    >>> from speculum.enumeration import Choices
    >>> from speculum.models import MarkovModel
    >>> vocab = ["7", "8", "77", "x", "y", "xy", None]
    >>> model = MarkovModel.random(7, seed=0, eos_token_id=6)
    >>> scores = score_choices(model, Choices(["77", "78", "xy"], vocabulary=vocab), prompt=[3])
    >>> scores.tokens                      # greedy longest match over the vocabulary
    ((2,), (0, 1), (5,))
    >>> scores.forwards                    # the prompt itself, and prompt + (0,) that "78" continues
    2
    >>> scores.best(), scores.rank_of("xy")
    ('77', 2)
    >>> bool(abs(scores.distribution.sum() - 1) < 1e-12), scores.best() == scores.choices[int(scores.ranks.argmin())]
    (True, True)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..models.base import as_model, check_logits, check_prompt, check_token_id, check_token_ids
from ..models.vocabulary import token_bytes
from ..validation import InputError, check_int
from .formats.constraint import Choices
from .enumerable import AutoregressiveEnumerable, eos_token_of
from .index.strings import StringIndex

__all__ = ["ChoiceScores", "ScoringProgress", "score_choices"]


@dataclass(frozen=True)
class ScoringProgress:
    """Where scoring a label set stands: ``forwards`` of the ``total`` trie prefixes it forwards are done."""

    forwards: int
    total: int


@dataclass(frozen=True, eq=False)
class ChoiceScores:
    """Every choice of a label set scored exactly (see :func:`score_choices`).

    ``choices``: as given. ``tokens``: the token sequence scored for each choice (eos appended in eos mode).
    ``log_probs``: ``(n,)`` exact ``log p(tokens | prompt)`` in nats. ``ranks``: ``(n,)`` 0 for the most
    probable; equal log-probs rank in input order. ``log_mass``: log of the set's total probability.
    ``forwards``: prefixes sent to the model (positions past the prompt). Arrays are read-only; two results
    compare by identity (they hold arrays).
    """

    choices: tuple[str, ...]
    tokens: tuple[tuple[int, ...], ...]
    log_probs: np.ndarray
    ranks: np.ndarray
    log_mass: float
    forwards: int

    @property
    def distribution(self) -> np.ndarray:
        """``(n,)`` probabilities normalised over the set (sums to 1). ``InputError`` when every choice has
        zero probability: there is then no distribution over the set."""
        if self.log_mass == -math.inf:
            raise InputError("every choice has zero probability: there is no distribution over the set")
        weights = np.exp(self.log_probs - float(self.log_probs.max()))
        return weights / math.fsum(weights.tolist())

    def _position(self, choice: str) -> int:
        if isinstance(choice, str):
            try:
                return self.choices.index(choice)
            except ValueError:
                pass
        raise InputError(f"{choice!r} is not one of the {len(self.choices)} choices")

    def rank_of(self, choice: str) -> int:
        """The rank of ``choice`` (0: the most probable). ``InputError`` for a string not in the set."""
        return int(self.ranks[self._position(choice)])

    def log_prob_of(self, choice: str) -> float:
        """The exact log-prob of ``choice``. ``InputError`` for a string not in the set."""
        return float(self.log_probs[self._position(choice)])

    def best(self) -> str:
        """The most probable choice (the first in input order among equals)."""
        return self.choices[int(np.argmin(self.ranks))]

    def as_dict(self) -> dict:
        """A JSON-ready dict: per choice ``{choice, tokens, log_prob, rank, probability}`` in input order,
        ``log_mass`` and ``forwards``. A log-prob of ``-inf`` (zero probability) is written as None, and so
        is every probability when the whole set has zero probability."""
        probabilities = self.distribution.tolist() if self.log_mass > -math.inf else [None] * len(self.choices)
        return {
            "choices": [
                {"choice": choice, "tokens": list(tokens), "log_prob": _finite_or_none(lp), "rank": int(rank),
                 "probability": probability}
                for choice, tokens, lp, rank, probability in zip(
                    self.choices, self.tokens, self.log_probs.tolist(), self.ranks.tolist(), probabilities)
            ],
            "log_mass": _finite_or_none(self.log_mass),
            "forwards": self.forwards,
        }


def score_choices(model: Any, choices: Sequence[str] | Choices, *, prompt: Sequence[int] = (),
                  eos: int | bool | None = None, tokenize: Callable[[str], Sequence[int]] | None = None,
                  batch_size: int = 64, all_tokenizations: bool = False,
                  progress: Callable[[ScoringProgress], None] | None = None) -> ChoiceScores:
    """Score every choice of a label set after ``prompt``: exact log-probs, ranks and the set's mass.

    Args:
        model: a protocol model (or a compatibility-API model, adapted by ``as_model``).
        choices: the labels, a sequence of distinct non-empty strings or a ``Choices`` object.
        prompt: token ids before each choice (empty: the model's BOS if it needs one).
        eos: None, a token id, or True (the model's ``eos_token_id``): each choice is followed by eos, so its
            log-prob is that the model says exactly this label and stops.
        tokenize: ``text -> token ids``. Without it: the model's tokenizer (a Hugging Face tokenizer or a
            llama.cpp model's, no special tokens added), else a greedy longest match over the
            ``vocabulary`` of the ``Choices`` object (backtracking where the longest piece leads nowhere).
        batch_size: prefixes per batched ``next_logprobs`` call.
        all_tokenizations: score each string over every token sequence that spells it (the exact string
            probability; needs token texts: the model's tokenizer or ``Choices(..., vocabulary=...)``).
            ``tokens`` then holds each string's first tokenization in lexicographic order, and
            ``forwards`` the positions teacher-forced: the summed length of every tokenization scored.
            Without ``eos`` a set where one choice is a prefix of another is refused, as by every
            constrained index (pass ``eos``).
        progress: called with a :class:`ScoringProgress` after every batch of trie prefixes (not with
            ``all_tokenizations``, whose index has its own ``progress``).

    Returns a :class:`ChoiceScores`. Exact: each log-prob is the model's own, the float sum of its step
    log-probs in order (a teacher-forcing request per choice gives the same up to float rounding of batch
    composition); ranks are exact, ties in input order; ``log_mass`` is their log-sum-exp (``math.fsum``).
    The trie path forwards each distinct internal trie node once (``forwards``), never a leaf.
    """
    model = as_model(model, name="model")
    constraint = choices if isinstance(choices, Choices) else _as_choices(choices)
    prompt = check_prompt(model, prompt, name="prompt")
    eos = _eos(model, eos)
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    if tokenize is not None and not callable(tokenize):
        raise InputError(f"tokenize must be a callable text -> token ids, got {type(tokenize).__name__}")
    if progress is not None and not callable(progress):
        raise InputError(f"progress must be a callable receiving ScoringProgress events, got {type(progress).__name__}")
    if all_tokenizations:
        if tokenize is not None:
            raise InputError("tokenize= does not apply with all_tokenizations=True: every tokenization is scored")
        return _score_strings(model, constraint, prompt, eos, batch_size)
    spell = _tokenizer(model, constraint, tokenize, eos)
    tokens = []
    for text, spelled in zip(constraint.strings, spell(constraint.strings)):
        ids = check_token_ids(spelled, model.vocab_size, name=f"the tokens of choice {text!r}")
        if not ids:
            raise InputError(f"choice {text!r} tokenizes to no tokens")
        tokens.append(tuple(ids) + (() if eos is None else (eos,)))
    log_probs, forwards = _score_trie(model, prompt, tokens, batch_size, progress)
    return _result(constraint.strings, tuple(tokens), log_probs, forwards)


# ------------------------------------------------------------------------------------------- inputs
def _as_choices(choices: Any) -> Choices:
    """A plain sequence checked by ``Choices`` itself, so a duplicate or an empty string fails alike."""
    if isinstance(choices, str):
        return Choices(choices)                  # refuses one string with its own message
    try:
        return Choices(tuple(choices))
    except TypeError:
        raise InputError(f"choices must be a sequence of strings, got {type(choices).__name__}") from None


def _eos(model, eos) -> int | None:
    if eos is None or eos is False:
        return None
    if eos is True:
        eos = eos_token_of(model)
    return check_token_id(eos, model.vocab_size, name="eos")


def _tokenizer(model, constraint: Choices, tokenize, eos: int | None
               ) -> Callable[[Sequence[str]], list[Sequence[int]]]:
    """How the choices become token ids (all at once): ``tokenize``, the model's tokenizer, or the vocabulary."""
    if tokenize is not None:
        return lambda texts: [tokenize(text) for text in texts]
    try:
        tokenizer = model.tokenizer
    except AttributeError:                       # a protocol model need not carry a tokenizer
        tokenizer = None
    if tokenizer is not None:
        # One batched call: a fast tokenizer's per-call overhead dominates on short labels.
        return lambda texts: tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    if constraint.vocabulary is not None:
        speller = _VocabularySpeller(model, constraint.vocabulary, exclude=eos)
        return lambda texts: [speller(text) for text in texts]
    raise InputError(f"{type(model).__name__} has no tokenizer: pass tokenize= or Choices(..., vocabulary=[...])")


class _VocabularySpeller:
    """Token ids of a text by greedy longest match over the token texts; where the longest piece leads to
    a dead end it backtracks to shorter ones, so only an unspellable text is refused. Among tokens with the
    same text the lowest id is used; ``exclude`` (the eos) is never used."""

    def __init__(self, model, vocabulary, *, exclude: int | None) -> None:
        self.by_bytes: dict[bytes, int] = {}
        for token, piece in enumerate(token_bytes(model, vocabulary=vocabulary)):
            if piece and token != exclude:
                self.by_bytes.setdefault(piece, token)
        if not self.by_bytes:
            raise InputError("the vocabulary has no token with text: no choice can be spelled")
        self.longest = max(len(piece) for piece in self.by_bytes)

    def __call__(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        dead: set[int] = set()                   # positions from which the rest cannot be spelled

        def spell(position: int) -> list[int] | None:
            if position == len(data):
                return []
            if position in dead:
                return None
            for size in range(min(self.longest, len(data) - position), 0, -1):
                token = self.by_bytes.get(data[position:position + size])
                if token is not None:
                    rest = spell(position + size)
                    if rest is not None:
                        return [token] + rest
            dead.add(position)
            return None

        # Depth is at most the text's byte length; labels are short, so recursion is fine.
        ids = spell(0)
        if ids is None:
            raise InputError(f"choice {text!r} cannot be spelled with the vocabulary's token texts")
        return ids


# ------------------------------------------------------------------------------------------ scoring
def _score_trie(model, prompt: list[int], sequences: list[tuple[int, ...]], batch_size: int,
                progress: Callable[[ScoringProgress], None] | None = None) -> tuple[np.ndarray, int]:
    """``(n,)`` exact log-probs of ``sequences`` after ``prompt``, forwarding each internal node of their
    prefix trie once (level by level, ``batch_size`` per call), and the number of prefixes forwarded."""
    steps: dict[tuple[int, ...], float] = {}     # trie node -> log p(its last token | its parent)
    levels = []
    for depth in range(max(len(seq) for seq in sequences)):
        children: dict[tuple[int, ...], set[int]] = {}
        for seq in sequences:
            if len(seq) > depth:
                children.setdefault(seq[:depth], set()).add(seq[depth])
        levels.append(children)
    total, forwards = sum(len(children) for children in levels), 0
    for children in levels:
        # Sorted: neighbouring prefixes share more (a prefix-reusing backend evaluates less).
        nodes = sorted(children)
        for start in range(0, len(nodes), batch_size):
            batch = nodes[start:start + batch_size]
            rows = _rows(model, [prompt + list(node) for node in batch])
            forwards += len(batch)
            for node, row in zip(batch, rows):
                for token in children[node]:
                    steps[node + (token,)] = float(row[token])
            if progress is not None:
                progress(ScoringProgress(forwards=forwards, total=total))
    log_probs = np.empty(len(sequences))
    for i, seq in enumerate(sequences):
        total = 0.0
        for length in range(1, len(seq) + 1):
            total += steps[seq[:length]]
        log_probs[i] = total
    return log_probs, forwards


def _rows(model, prefixes: list[list[int]]) -> np.ndarray:
    """The model's rows for ``prefixes``, in its own dtype (only the entries read become Python floats)."""
    rows = np.asarray(model.next_logprobs(prefixes))
    if rows.shape != (len(prefixes), model.vocab_size):
        raise InputError(f"next_logprobs returned shape {rows.shape} for {len(prefixes)} prefixes; expected "
                         f"({len(prefixes)}, {model.vocab_size})")
    # One pass for check_logits' three: a row's maximum is NaN or +inf iff it holds one, and -inf iff it
    # has no finite entry. Only a failing batch runs the full check, which names the fault.
    if len(rows) and not np.isfinite(rows.max(axis=1)).all():
        check_logits(rows, name="the model's next-token log-probs")
    return rows


def _score_strings(model, constraint: Choices, prompt: list[int], eos: int | None, batch_size: int
                   ) -> ChoiceScores:
    """Each choice's exact string probability: the sum over every token sequence that spells it."""
    enumerable = AutoregressiveEnumerable(model, prompt=prompt, constraint=constraint, eos=eos,
                                          batch_size=batch_size)
    strings = StringIndex(enumerable.seek_index())
    spelled = [strings.tokenizations(text) for text in constraint.strings]
    for text, sequences in zip(constraint.strings, spelled):
        if not sequences:
            raise InputError(f"choice {text!r} cannot be spelled by any token sequence of this vocabulary")
    log_probs = strings.score(constraint.strings)
    forwards = sum(len(seq) for sequences in spelled for seq in sequences)
    return _result(constraint.strings, tuple(sequences[0] for sequences in spelled), log_probs, forwards)


def _result(choices: tuple[str, ...], tokens: tuple[tuple[int, ...], ...], log_probs: np.ndarray,
            forwards: int) -> ChoiceScores:
    log_probs = np.array(log_probs, dtype=np.float64)
    # Stable sort of the negated log-probs: equal log-probs keep input order.
    order = np.argsort(-log_probs, kind="stable")
    ranks = np.empty(len(log_probs), dtype=np.int64)
    ranks[order] = np.arange(len(log_probs))
    log_probs.setflags(write=False)
    ranks.setflags(write=False)
    return ChoiceScores(choices=tuple(choices), tokens=tokens, log_probs=log_probs, ranks=ranks,
                        log_mass=_logsumexp(log_probs), forwards=int(forwards))


def _logsumexp(values: np.ndarray) -> float:
    top = float(values.max())
    if top == -math.inf:
        return -math.inf
    return top + math.log(math.fsum(np.exp(values - top).tolist()))


def _finite_or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None
