"""Exact enumeration of a model's continuations in descending probability.

``AutoregressiveEnumerable`` answers, for the continuations of a prompt (every length-``max_len``
continuation, or only those ending in ``eos``): the k best, the i-th best, a sequence's rank, how many are
at least so probable, the k-th best's log-prob, and the mass above a threshold. All of them agree exactly
with brute-force sorting by exact log-probability, ties broken lexicographically by token ids.

How (see ``index/tree.py`` and ``index/histogram.py``): a prefix tree of the live prefixes within a
log-prob budget is built breadth first with batched forwards; its complete sequences are grouped by a fine
bucket of their exact information, with cumulative counts. A query bisects the counts to the one bucket
(the *band*) that holds its answer and sorts only that band by the exact key. When a query needs sequences
below the budget the tree is extended in place (never rebuilt), and queries inside the built budget run no
forward at all.

Example:
    >>> from speculum.models import MarkovModel
    >>> ar = AutoregressiveEnumerable(MarkovModel.random(5, seed=1), max_len=4)
    >>> seq, logprob = ar.unrank(10)
    >>> ar.rank(seq), ar.count(logprob) >= 11
    (10, True)
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, Sequence

import numpy as np

from ..models.base import as_model, check_prompt
from ..validation import InputError, check_int, check_number, check_optional_int
from .index.histogram import DEFAULT_WIDTH_BITS
from .index.seek_index import (DEFAULT_BATCH_SIZE, DEFAULT_BEAM_FORWARDS, DEFAULT_MAX_BAND, DEFAULT_MAX_NODES,
                               DEFAULT_RESERVE_BITS, BandTooLargeError, ForwardBudgetError, IndexBudgetError,
                               SeekIndex)
from .formats.constraint import compile_for
from .index.strings import DEFAULT_MAX_TOKENIZATIONS, StringIndex
from .index.stream import DEFAULT_STREAM_ITEMS, DEFAULT_STREAM_WINDOW, StreamProgress, ranked_stream
from .index.support import Support, SupportAttributes
from .index.tree import BuildProgress

__all__ = ["AutoregressiveEnumerable", "SeekIndex", "BandTooLargeError", "IndexBudgetError", "ForwardBudgetError",
           "BuildProgress",
           "StreamProgress", "DEFAULT_MAX_BAND", "DEFAULT_MAX_NODES"]


def eos_token_of(model) -> int:
    """The model's own eos id, for ``eos=True`` (``BaseModel`` declares ``eos_token_id``, None for none)."""
    try:
        eos = model.eos_token_id
    except AttributeError:
        eos = None
    if eos is None:
        raise InputError("eos=True but the model has no eos_token_id")
    return eos


class AutoregressiveEnumerable(SupportAttributes):
    """A model's continuations of ``prompt``, enumerable in exact descending probability.

    Args:
        model: any protocol model (or an object with ``forward(ids[1, T]) -> logits[1, T, V]``, adapted by
            ``as_model``).
        max_len: fixed length of every continuation; with ``eos``, only a cap on the length.
        eos: end-of-sequence id (``True``: the model's ``eos_token_id``); the support is then only the
            continuations ending in eos, of any length within the probability budget.
        prompt: token ids before the continuation (empty: the model's BOS if it needs one).
        branch_cap: follow only the top-``branch_cap`` tokens of each prefix (a sub-support; the dropped
            probability is bounded, see ``SeekIndex.count_bracket`` / ``mass_above``).
        batch_size: prefixes per batched ``next_logprobs`` call.
        width_bits: bucket width of the count index (a speed/memory knob; the order is exact at any width).
        reserve_bits: each expanded prefix also keeps children this far below the budget, so deepening by
            up to this much forwards no prefix twice.
        max_band: most sequences one query may sort exactly before raising ``BandTooLargeError``.
        max_nodes: most prefix-tree nodes the index may store (about 60 bytes each at the peak of a
            build): a query that needs more certified sequences is refused up front, and a build that
            reaches it stops with ``IndexBudgetError``, leaving the index usable for smaller queries.
        max_beam_forwards: most forwards a small beam search may spend to find real sequences that aim a
            query's first budget (0: never); it changes what is forwarded, never an answer.
        max_forwards: most prefixes the index may forward in all (None: no limit; also settable later as
            ``seek_index().max_forwards``): a query that would pass it raises ``ForwardBudgetError`` before
            forwarding the batch that would, so the count never passes it; under it, answers and forwards are
            those of an unlimited index.
        progress: callable receiving ``BuildProgress`` events (the library draws nothing itself; the CLI's
            ``speculum.cli.progress.index_bar()`` is such a callable drawing a tqdm bar).
        constraint: ``Regex(...)`` / ``Choices(...)`` (or a compiled ``TokenAutomaton``): only the token
            sequences whose text is a member of its language are enumerated (followed by ``eos`` when
            given; ``max_len`` is then a cap). Off-format prefixes are never forwarded. Each item is a token
            sequence scored by log p(exactly these tokens).
        strings: items are the constraint's strings (text), each scored over all its tokenizations (at most
            ``max_tokenizations`` per string): exact order and log-probs, see :class:`StringIndex`.

    Every query (``top_k``, ``unrank``, ``slice``, ``rank``, ``count``, ``threshold``, ``mass_above``) is
    exact and delegates to the persistent ``seek_index()``; ``unrank(rank(s)) == s`` for every ``s``.
    The enumerated sequences are ``support`` (a :class:`~speculum.enumeration.Support`, also read as
    ``max_len`` and ``eos``); an :class:`~speculum.enumeration.EnumerationIndex`.

    Example:
        >>> from speculum.models import MarkovModel
        >>> ar = AutoregressiveEnumerable(MarkovModel.random(4, seed=0), max_len=3)
        >>> [seq for seq, _ in ar.top_k(2)] == [ar.unrank(0)[0], ar.unrank(1)[0]]
        True
    """

    def __init__(self, model, *, max_len: int | None = None, eos: int | bool | None = None,
                 prompt: Sequence[int] = (), branch_cap: int | None = None,
                 batch_size: int = DEFAULT_BATCH_SIZE, width_bits: float = DEFAULT_WIDTH_BITS,
                 reserve_bits: float = DEFAULT_RESERVE_BITS, max_band: int = DEFAULT_MAX_BAND,
                 max_nodes: int = DEFAULT_MAX_NODES, max_beam_forwards: int = DEFAULT_BEAM_FORWARDS,
                 progress: Callable[[BuildProgress], None] | None = None, constraint=None,
                 strings: bool = False, max_tokenizations: int = DEFAULT_MAX_TOKENIZATIONS,
                 max_forwards: int | None = None) -> None:
        model = as_model(model, name="model")
        if eos is True:
            eos = eos_token_of(model)
        if eos is False:
            eos = None
        automaton = compile_for(constraint, model, eos=eos)
        support = Support.for_model(max_len=max_len, eos=eos, vocab_size=model.vocab_size, constraint=automaton)
        branch_cap = check_optional_int(branch_cap, "branch_cap", minimum=1)
        batch_size = check_int(batch_size, "batch_size", minimum=1)
        max_band = check_int(max_band, "max_band", minimum=1)
        max_nodes = check_int(max_nodes, "max_nodes", minimum=1)
        max_beam_forwards = check_int(max_beam_forwards, "max_beam_forwards", minimum=0)
        max_forwards = check_optional_int(max_forwards, "max_forwards", minimum=0)
        width_bits = check_number(width_bits, "width_bits", above=0)
        reserve_bits = check_number(reserve_bits, "reserve_bits", minimum=0)
        if progress is False:
            progress = None
        if progress is not None and not callable(progress):
            raise InputError("progress must be a callable receiving BuildProgress events, or None (for a bar, "
                             "pass speculum.cli.progress.index_bar())")
        prompt = check_prompt(model, prompt, name="prompt")
        self.model = model
        self._index = SeekIndex(model, support=support, prompt=prompt, branch_cap=branch_cap,
                                batch_size=batch_size, width_bits=width_bits, reserve_bits=reserve_bits,
                                max_band=max_band, max_nodes=max_nodes, max_beam_forwards=max_beam_forwards,
                                progress=progress)
        self._index.max_forwards = max_forwards
        self.vocab_size, self.support, self.prompt = self._index.vocab_size, support, self._index.prompt
        self.order_error = 0.0
        self.strings = bool(strings)
        if self.strings:
            if automaton is None:
                raise InputError("strings=True needs a constraint (Regex or Choices): items are its strings")
            self._queries = StringIndex(self._index, max_tokenizations_per_string=max_tokenizations)
        else:
            self._queries = self._index

    def seek_index(self) -> SeekIndex:
        """The persistent index behind every query (built lazily, deepened in place)."""
        return self._index

    @property
    def complete(self) -> bool:
        return self._index.complete

    @property
    def capped(self) -> bool:
        return self._index.capped

    @property
    def queries(self):
        """What answers the queries: the :class:`SeekIndex` over token sequences, or in string mode the
        :class:`~speculum.enumeration.index.strings.StringIndex` over it."""
        return self._queries

    def top_k(self, k: int) -> list[tuple[tuple[int, ...], float]]:
        """The ``k`` most probable continuations with exact log-probs, descending. Exact."""
        return self._queries.top_k(k)

    def unrank(self, i: int) -> tuple[tuple[int, ...], float]:
        """The ``i``-th most probable continuation (0-based) and its exact log-prob. Exact."""
        return self._queries.unrank(i)

    def iter_ranked(self, start: int = 0, *, max_items: int = DEFAULT_STREAM_ITEMS,
                    window: int = DEFAULT_STREAM_WINDOW, progress: Callable[[StreamProgress], None] | None = None
                    ) -> Iterator[tuple[tuple[int, ...], float]]:
        """Stream ``(tokens, log_prob)`` for ranks ``start, start + 1, ...`` to the end of the support, in
        memory bounded by ``max_items`` instead of the whole index. Exact.

        Guarantee: the items and log-probs of ``unrank(start)``, ``unrank(start + 1)``, ... in that order
        (bitwise, for a model whose rows do not depend on which prefixes share a batch; see
        :mod:`speculum.enumeration.index.stream`). Memory: about ``1.5 * max_items`` items as arrays plus the
        depth-first stack of one pass; the index is neither built nor used. Cost in forwards: passes that
        each re-walk every prefix above their floor, about one pass per ``max_items`` items streamed; the
        items before ``start`` are walked, only not yielded. A support that is infinite (``eos`` without
        ``max_len``) streams without end. Under ``branch_cap`` it streams the same capped sub-support.
        ``window``: batches forwarded a step through one ``map_calls``, so that a model serving calls in
        parallel computes them at once (a ``RayPool`` of ``N`` workers: choose ``window >= 2 * N``); one
        step's rows grow with it, and batches formed before the pruning bound rises may walk a few prefixes
        more. It does not depend on the model: the batches, hence the rows and items, are the same on a
        pool as on the local model. ``progress``: a callable receiving a ``StreamProgress`` after each
        pass. Not offered with ``strings=True`` (``InputError``). Arguments are checked on the call.

        Example:
            >>> from speculum.models import MarkovModel
            >>> ar = AutoregressiveEnumerable(MarkovModel.random(4, seed=0), max_len=3)
            >>> stream = ar.iter_ranked(max_items=10)
            >>> [next(stream) for _ in range(3)] == ar.top_k(3)
            True
        """
        start = check_int(start, "start", minimum=0)
        max_items = check_int(max_items, "max_items", minimum=1)
        window = check_int(window, "window", minimum=1)
        if self.strings:
            raise InputError("iter_ranked streams token sequences; with strings=True use top_k / slice")
        index = self._index
        return ranked_stream(self.model, support=self.support, prompt=self.prompt, start=start,
                             max_items=max_items, batch_size=index.tree.batch_size, branch_cap=index.branch_cap,
                             window=window, progress=progress)

    def slice(self, start: int, k: int) -> list[tuple[tuple[int, ...], float]]:
        """Ranks ``start .. start+k-1``. Exact."""
        return self._queries.slice(start, k)

    def rank(self, seq: Sequence[int]) -> int:
        """Number of continuations before ``seq`` (more probable, or tied and lexicographically smaller). Exact."""
        return self._queries.rank(seq)

    def count(self, min_log_prob: float) -> int:
        """Number of continuations with ``log p >= min_log_prob``. Exact."""
        return self._queries.count(min_log_prob)

    def size(self) -> int | float:
        """Number of items: the strings of the constraint's language (``math.inf`` when infinite), or the
        support's sequences without a constraint (``math.inf`` for an uncapped eos support). Exact."""
        if self.support.constraint is not None:
            return self.support.constraint.language_size()
        size = self.support.size(self.vocab_size)
        return math.inf if size is None else size

    def mass(self, *, tolerance: float = 1e-3, max_forwards: int | None = None) -> tuple[float, float]:
        """Sound ``(lo, hi)`` bracket on the total probability of the support (with a constraint: that the
        model spells a member of the language), deepened until ``hi - lo <= tolerance * hi`` or
        ``max_forwards`` prefixes were forwarded. Certified."""
        return self._index.mass(tolerance=tolerance, max_forwards=max_forwards)

    def count_bracket(self, min_log_prob: float) -> tuple[int, int]:
        """Sound bracket on ``count`` over the uncapped support (equal ends without ``branch_cap``). Certified."""
        return self._index.count_bracket(min_log_prob)

    def threshold(self, k: int) -> float:
        """Log-prob of the ``k``-th most probable continuation (``k >= 1``). Exact."""
        return self._queries.threshold(k)

    def mass_above(self, min_log_prob: float) -> tuple[float, float]:
        """Sound ``(lo, hi)`` bracket on the probability of continuations with ``log p >= min_log_prob``. Certified."""
        return self._queries.mass_above(min_log_prob)

    def score_sequences(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
        """``(batch,)`` exact log p(continuation | prompt), batched teacher forcing."""
        return self._index.score_sequences(sequences)
