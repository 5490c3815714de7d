"""The model protocol every speculum component talks to.

A model maps token-id prefixes to natural-log next-token distributions (float64 NumPy rows normalised
over the vocabulary). Three entry points, each batched or incremental:

* ``next_logprobs(prefixes) -> (batch, vocab)`` — one batched call over many prefixes (enumeration);
* ``score_sequences(sequences, prompt) -> (batch,)`` — exact total log-prob by teacher forcing;
* ``start(prompt) -> Session`` — incremental decoding state (a KV cache for transformers) with
  ``extend`` / ``next_logprobs`` / ``rollback``, so decoding never re-feeds the whole sequence.

Inputs are validated where they enter (token ids in the vocabulary, finite logits) so that a bad value
fails with a message naming it instead of surfacing as a wrong answer far away.

Example:
    >>> import numpy as np
    >>> from speculum.models import MarkovModel
    >>> model = MarkovModel(np.zeros((3, 3)), np.zeros(3))
    >>> session = model.start([0])
    >>> rows = session.extend([1, 2])           # (2, vocab): after [0, 1] and after [0, 1, 2]
    >>> session.rollback(1); session.length
    2
"""
from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from ..validation import InputError
from .vocabulary import tokenizer_bytes

__all__ = [
    "Capabilities",
    "capabilities_of",
    "map_calls",
    "as_model",
    "AutoregressiveModel",
    "Session",
    "Proposer",
    "BaseModel",
    "RecomputeSession",
    "ForwardModel",
    "from_forward",
    "log_softmax",
    "check_token_id",
    "check_token_ids",
    "check_logits",
    "check_prompt",
    "Feed",
    "check_session_blocks",
    "common_prefix_length",
]


# --------------------------------------------------------------------------------------------- checks
def log_softmax(logits: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable log-softmax in float64; ``-inf`` logits stay ``-inf`` (zero probability)."""
    logits = np.asarray(logits, dtype=np.float64)
    top = np.max(logits, axis=axis, keepdims=True)
    shifted = logits - top
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def check_logits(logits: np.ndarray, *, name: str = "logits") -> np.ndarray:
    """Reject NaN / +inf entries and rows with no finite entry; ``-inf`` (a banned token) is allowed."""
    logits = np.asarray(logits, dtype=np.float64)
    if np.isnan(logits).any():
        raise InputError(f"{name} contain NaN")
    if np.isposinf(logits).any():
        raise InputError(f"{name} contain +inf")
    if logits.size and not np.isfinite(logits).any(axis=-1).all():
        raise InputError(f"{name} have a row with no finite entry (every token has zero probability)")
    return logits


def _token_id(value: Any) -> int | None:
    """``value`` as a Python int if it is an integer (Python, NumPy or any ``__index__`` type), else None."""
    if type(value) is int:                       # the common case, first
        return value
    if isinstance(value, (bool, np.bool_)):      # True is an int to Python, never a token id
        return None
    try:
        return operator.index(value)             # NumPy integers; refuses floats, even 2.0, and text
    except TypeError:
        return None


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_token_id(token: Any, vocab_size: int, *, name: str = "token id") -> int:
    """Return one token id (an eos, a bos) as a Python int; ``ValueError`` naming ``name`` unless it is
    an integer in ``[0, vocab_size)``. Never coerces: 2.5, 2.0, True and "2" are refused.

    Example:
        >>> check_token_id(np.int64(3), 5, name="eos_token_id")
        3
        >>> check_token_id(2.5, 5, name="eos_token_id")
        Traceback (most recent call last):
        ...
        ValueError: eos_token_id must be an integer token id, got 2.5 (float)
    """
    value = _token_id(token)
    if value is None:
        raise InputError(f"{name} must be an integer token id, got {_describe(token)}")
    if not 0 <= value < vocab_size:
        raise InputError(f"{name} is {value}, outside the vocabulary [0, {vocab_size})")
    return value


def check_token_ids(tokens: Sequence[int], vocab_size: int, *, name: str = "token ids") -> list[int]:
    """Return ``tokens`` as a list of Python ints; ``ValueError`` naming ``name`` unless every one is an
    integer token id in ``[0, vocab_size)``.

    Accepted: a sequence of Python or NumPy integers, or a 1-D integer NumPy array. Nothing is coerced:
    text (a string prompt: call ``model.encode(text)`` first), floats (even integral ones), bools and
    nested sequences are refused, so a wrong input fails here instead of decoding something else.

    Example:
        >>> check_token_ids(np.array([1, 2]), 5)
        [1, 2]
        >>> check_token_ids("12", 5, name="prompt_ids")
        Traceback (most recent call last):
        ...
        ValueError: prompt_ids is text ('12'), not token ids: call model.encode(text) to get token ids
    """
    if isinstance(tokens, (str, bytes)):
        shown = tokens if len(tokens) <= 40 else tokens[:37] + "..."
        raise InputError(f"{name} is text ({shown!r}), not token ids: call model.encode(text) to get token ids")
    if isinstance(tokens, np.ndarray) and tokens.dtype.kind != "O":
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise InputError(f"{name} must be a 1-D array of integer token ids, got an array of shape "
                             f"{tokens.shape} and dtype {tokens.dtype}")
        ids = tokens.tolist()
    else:
        try:
            items = list(tokens)
        except TypeError:
            raise InputError(f"{name} must be a sequence of integer token ids, got {_describe(tokens)}") from None
        ids = []
        for position, item in enumerate(items):
            value = _token_id(item)
            if value is None:
                raise InputError(f"{name} must contain integer token ids only, got {_describe(item)} "
                                 f"at position {position}")
            ids.append(value)
    for t in ids:
        if not 0 <= t < vocab_size:
            raise InputError(f"{name} contain {t}, outside the vocabulary [0, {vocab_size})")
    return ids


def check_prompt(model: "AutoregressiveModel", prompt: Sequence[int], *, name: str = "prompt_ids") -> list[int]:
    """Validate a prompt; an empty one is replaced by the model's BOS, or rejected if it has none."""
    ids = check_token_ids(prompt, model.vocab_size, name=name)
    if not ids:
        bos = getattr(model, "bos_token_id", None)
        if bos is not None:
            return [int(bos)]
        if not getattr(model, "accepts_empty_prompt", False):
            raise InputError(f"{name} is empty and the model has no BOS token to start from")
    return ids


@dataclass(frozen=True)
class Feed:
    """One session's part of a packed ``extend_sessions`` call: extend ``session`` by ``tokens``; with
    ``Capabilities.deferred_prefill``, feed at most ``prompt_limit`` tokens of its deferred prompt (None: all
    of it, before ``tokens``); with ``Capabilities.greedy_tokens`` and ``greedy``, its result is each row's
    greedy token ``(n,)`` instead of the rows ``(n, vocab)``."""

    session: Any
    tokens: Sequence[int] = ()
    prompt_limit: int | None = None
    greedy: bool = False


def check_session_blocks(model: Any, session_type: type, feeds: Sequence[Any],
                         token_lists: Sequence[Sequence[int]] | None = None,
                         prompt_limits: Sequence[int | None] | None = None, *,
                         call: str = "extend_sessions") -> list[Feed]:
    """The arguments of ``model.extend_sessions`` (or of another ``call`` taking sessions and their tokens),
    checked, as :class:`Feed` records with token lists of ints: ``feeds`` holds Feed records, or (the
    parallel form) the sessions, with ``token_lists`` and optionally ``prompt_limits`` beside them. Every
    session is a distinct ``session_type`` session of ``model`` (its ``model`` attribute), every token in
    its vocabulary, every prompt limit a positive int or None. ``InputError`` naming what is wrong
    otherwise (in the form the caller used)."""
    if token_lists is None:
        records = list(feeds)
        for i, feed in enumerate(records):
            if not isinstance(feed, Feed):
                raise InputError(f"feeds[{i}] must be a Feed(session, tokens, prompt_limit), got "
                                 f"{type(feed).__name__} (or pass token_lists beside the sessions)")
            if not _is_prompt_limit(feed.prompt_limit):
                raise InputError(f"feeds[{i}].prompt_limit must be a positive int or None, got {feed.prompt_limit!r}")
            if feed.greedy and not capabilities_of(model).greedy_tokens:
                raise InputError(f"feeds[{i}].greedy asks for greedy tokens, which {type(model).__name__} does not "
                                 "offer (Capabilities.greedy_tokens)")
        names = [(f"feeds[{i}].session", f"feeds[{i}].tokens") for i in range(len(records))]
    else:
        sessions = list(feeds)
        if len(sessions) != len(token_lists):
            raise InputError(f"{call} got {len(sessions)} sessions and {len(token_lists)} token lists")
        limits = [None] * len(sessions) if prompt_limits is None else list(prompt_limits)
        if len(limits) != len(sessions) or not all(_is_prompt_limit(limit) for limit in limits):
            raise InputError(f"prompt_limits must hold one positive int or None per session, got {prompt_limits!r}")
        records = [Feed(session, tokens, limit) for session, tokens, limit in zip(sessions, token_lists, limits)]
        names = [(f"sessions[{i}]", f"token_lists[{i}]") for i in range(len(records))]
    if len({id(feed.session) for feed in records}) != len(records):
        raise InputError(f"a session appears twice in one {call} call")
    checked = []
    for feed, (session_name, tokens_name) in zip(records, names):
        if not isinstance(feed.session, session_type) or feed.session.model is not model:
            raise InputError(f"{session_name} is not a session of this model")
        tokens = check_token_ids(feed.tokens, model.vocab_size, name=tokens_name)
        checked.append(Feed(feed.session, tokens, feed.prompt_limit, bool(feed.greedy)))
    return checked


def _is_prompt_limit(limit: Any) -> bool:
    return limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1)


def common_prefix_length(*sequences: Sequence[int]) -> int:
    """Length of the longest prefix all ``sequences`` share (0 for none given). The usual case, a context
    that only grew, costs one C-level comparison per sequence.

    Example:
        >>> common_prefix_length([1, 2, 3], [1, 2, 4], [1, 2])
        2
    """
    if not sequences:
        return 0
    first = list(sequences[0])
    length = len(first)
    for other in sequences[1:]:
        other = list(other)
        n = min(length, len(other))
        if first[:n] != other[:n]:
            n = int(np.flatnonzero(np.asarray(first[:n]) != np.asarray(other[:n]))[0])
        length = n
    return length


# ------------------------------------------------------------------------------------------- protocol
@runtime_checkable
class Session(Protocol):
    """Incremental decoding state over one growing token sequence (a KV cache for transformers)."""

    length: int

    def next_logprobs(self) -> np.ndarray:  # (vocab,) after the current tokens
        ...

    def extend(self, tokens: Sequence[int]) -> np.ndarray:
        """Consume ``tokens``; row j of the ``(len(tokens), vocab)`` result follows ``tokens[:j+1]``."""
        ...

    def rollback(self, n: int) -> None:  # forget the last n tokens, cheaply
        ...

    # Optional: ``advance(tokens) -> (vocab,)`` consumes tokens like ``extend`` but returns only the row
    # after the last one (cheaper where the vocabulary projection is costly). A model whose sessions have
    # it declares ``Capabilities(session_advance=True)``; callers use ``extend(tokens)[-1]`` otherwise.


@runtime_checkable
class AutoregressiveModel(Protocol):
    vocab_size: int

    def next_logprobs(self, prefixes: Sequence[Sequence[int]]) -> np.ndarray:  # (batch, vocab)
        ...

    def score_sequences(self, sequences: Sequence[Sequence[int]], prompt: Sequence[int] = ()) -> np.ndarray:
        ...  # (batch,)

    def start(self, prompt: Sequence[int]) -> Session:
        ...


@runtime_checkable
class Proposer(Protocol):
    """A draft that proposes fixed tokens with no honest distribution (prompt lookup, n-gram argmax).

    Verified by the point-mass rule (a proposal of fixed tokens is a point-mass draft distribution), which
    keeps the output exactly the target's whatever the proposal.

    Optional: ``propose_with_match(context, max_tokens) -> (tokens, evidence)`` proposes first and says
    how good the proposal looks — an int match length (bucketed on a log scale) or any hashable key —
    so that ``gamma="auto"`` learns acceptance per situation and picks γ after seeing it. The loop calls
    it with ``max_tokens=1`` to read the evidence, then again with the chosen γ, so the evidence must not
    depend on ``max_tokens`` and the first token must be the same."""

    def propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
        ...


# ------------------------------------------------------------------------------------- capabilities
@dataclass(frozen=True)
class Capabilities:
    """What a model offers beyond the protocol, declared once by the model; algorithms read this
    declaration instead of probing for methods.

    ``sparse_rows``: ``next_logprobs_above(prefixes, min_logprobs) -> (row, token, logprob, finite)``, every
    entry of ``next_logprobs`` at or above a per-prefix floor with the same values, and each row's count
    of finite entries (enumeration then never builds ``(batch, vocab)`` float64 rows).
    ``session_advance``: its sessions offer ``advance(tokens) -> (vocab,)``, ``extend`` returning only the
    last row (cheaper where the vocabulary projection is costly).
    ``shares_prefix_cache``: ``start_sharing(source_session)`` starts a session on the cache of a session of
    ``prefix_of`` (a model whose computation this one's is a prefix of, such as its first K layers), or
    returns None when it cannot.
    ``batched_extend``: ``extend_sessions(feeds) -> [rows]``, the ``extend`` of several of its sessions
    (each by its own tokens, one :class:`Feed` each; ``extend_sessions(sessions, token_lists)`` is the same
    call in parallel lists) in one forward, each result equal to that session's own ``extend`` (the
    decoding scheduler then verifies many generations' blocks in one call).
    ``deferred_prefill``: ``start_deferred(prompt)`` returns a session after ``prompt`` whose prompt is
    consumed by its first forward (``extend``, ``advance``, ``next_logprobs`` or a packed
    ``extend_sessions``) rather than at once, with the same rows; a scheduler packs a new generation's
    prompt into the forward that verifies the others' blocks. Such a session says how many prompt tokens
    it has not fed (``unfed``), and a feed's ``prompt_limit`` (``extend_sessions(..., prompt_limits)``)
    can feed a part of them (a long prompt over several forwards).
    ``invariant_extend``: ``extend_rows(sessions, token_lists) -> [rows]``, each session extended by the
    prompt tokens it has not fed (``start_deferred``) and then its tokens, with a row for every token read,
    in as few forwards as it can; BATCH-INVARIANT: each session's rows are bitwise those the same call gives
    it alone. Its sessions offer ``fork()`` (the same state, shared until either changes). A prompt scorer
    then packs several prompts into one forward and still answers each as if alone.
    ``prefix_levels``: ``start_levels(prompt) -> level``, ``extend_level(level, parents, tokens) -> (level,
    rows)`` and ``level_capacity(length) -> nodes``: a breadth-first walk over a tree of continuations that
    keeps each level's keys and values, so that a node's row costs one token's forward on its parent's
    cache (``rows``: ``(nodes, vocab)`` float64 log-probs after each parent node extended by its token;
    the root level holds ``prompt`` less its last token, which a first extension of node 0 feeds). Rows
    equal ``next_logprobs``' up to float rounding of other batch shapes.
    ``canonical_rows``: each log-prob row is bitwise the same however its session's tokens were fed (whole,
    in blocks, one at a time, deferred, packed with other sessions by ``extend_sessions``): a function of
    the tokens up to it alone. Greedy speculative output then equals plain greedy output bit for bit, and
    a scheduler's packed verification gives every generation its solo greedy output.
    ``normalised_rows``: every log-prob row it returns is normalised, without NaN or +inf, checked where it
    is computed (a NaN or +inf logit raises there): the decoding loop then checks only the rows' shape,
    not their mass again (a pass of ``exp`` over the vocabulary a verified row).
    ``greedy_tokens``: its sessions offer ``extend_greedy(tokens) -> (n,)`` int64, and ``extend_sessions``
    honours ``Feed.greedy``: each row's greedy token, bitwise the argmax (lowest id on ties) of the row
    ``extend`` returns, without computing the rows (greedy verification reads nothing else of them).
    ``interruptible_rows``: ``interruptible(check)`` is a context within which ``extend_rows`` (on the calling
    thread) stops between two layers once ``check()`` is True, raising
    :class:`~speculum.models.interruption.Interrupted` with every session as before the call; a call that
    is not stopped computes what it computes outside the context.
    ``independent_sessions`` (default True): each session keeps its own state, so several can advance in
    turn. False (llama.cpp's single resident KV cache: switching sessions re-evaluates the context): the
    serving engine and ``generate_batch`` run one generation at a time.
    ``parallel_calls`` (default 1): how many batched calls the model runs at once. Above 1 (a pool of
    replicas, :class:`~speculum.distributed.ray_pool.RayPool`) it offers ``map_calls(method, calls) -> results``,
    which runs ``getattr(model, method)(*args)`` for every ``args`` in ``calls`` concurrently, results in
    order; callers with independent batches (a level of the enumeration tree) submit that many together.
    """

    sparse_rows: bool = False
    session_advance: bool = False
    shares_prefix_cache: bool = False
    batched_extend: bool = False
    deferred_prefill: bool = False
    canonical_rows: bool = False
    invariant_extend: bool = False
    prefix_levels: bool = False
    normalised_rows: bool = False
    greedy_tokens: bool = False
    interruptible_rows: bool = False
    independent_sessions: bool = True
    parallel_calls: int = 1


def capabilities_of(model: Any) -> Capabilities:
    """The model's declared :class:`Capabilities` (none for an object that declares nothing)."""
    declared = getattr(model, "capabilities", None)
    return declared if isinstance(declared, Capabilities) else Capabilities()


def map_calls(model: Any, method: str, calls: Sequence[tuple]) -> list[Any]:
    """``[getattr(model, method)(*args) for args in calls]``, run concurrently by a model that declares
    ``parallel_calls > 1`` (each result is the same call's result either way)."""
    if capabilities_of(model).parallel_calls > 1:
        return model.map_calls(method, calls)
    return [getattr(model, method)(*args) for args in calls]


def as_model(obj: Any, *, name: str = "model") -> "AutoregressiveModel":
    """Adapt ``obj`` to the protocol once, where it enters: a protocol model (``start``, ``next_logprobs``,
    ``vocab_size``) is returned unchanged, a compatibility-API model with only
    ``forward(ids[1, T]) -> logits[1, T, V]`` is wrapped in :class:`ForwardModel`; anything else is a
    ``ValueError`` naming ``name``."""
    if hasattr(obj, "start") and hasattr(obj, "next_logprobs") and hasattr(obj, "vocab_size"):
        return obj
    if callable(getattr(obj, "forward", None)):
        return ForwardModel(obj)
    raise InputError(f"{name} must be a model (start, next_logprobs, vocab_size) or a compatibility-API model with "
                     f"forward(ids[1, T]) -> logits[1, T, V], got {type(obj).__name__}")


# ----------------------------------------------------------------------------------------- base class
class BaseModel(ABC):
    """Convenience base: subclasses implement ``start``; batched calls default to one session each.

    Backends with real batching (Hugging Face, TinyTransformer) override ``next_logprobs`` and
    ``score_sequences``; one that spells its tokens itself (llama.cpp) overrides ``token_bytes``.
    Attributes every model may set: ``bos_token_id``, ``eos_token_id``,
    ``accepts_empty_prompt`` (an initial distribution exists without BOS), ``max_context``, ``tokenizer``,
    ``capabilities`` (see :class:`Capabilities`) and ``prefix_of`` (with ``shares_prefix_cache``).
    """

    capabilities: Capabilities = Capabilities()
    prefix_of: Any = None
    vocab_size: int
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    accepts_empty_prompt: bool = False
    max_context: int | None = None
    tokenizer: Any = None

    @abstractmethod
    def start(self, prompt: Sequence[int]) -> Session:
        """Begin an incremental session after ``prompt``."""

    def next_logprobs(self, prefixes: Sequence[Sequence[int]]) -> np.ndarray:
        """``(batch, vocab)`` exact next-token log-probs for each prefix."""
        rows = [self.start(prefix).next_logprobs() for prefix in prefixes]
        return np.stack(rows) if rows else np.zeros((0, self.vocab_size))

    def score_sequences(self, sequences: Sequence[Sequence[int]], prompt: Sequence[int] = ()) -> np.ndarray:
        """``(batch,)`` exact total log p(sequence | prompt), by teacher forcing."""
        prompt = check_token_ids(prompt, self.vocab_size, name="prompt")
        out = np.empty(len(sequences))
        for b, seq in enumerate(sequences):
            seq = check_token_ids(seq, self.vocab_size, name="sequence")
            if not seq:
                out[b] = 0.0
                continue
            session = self.start(prompt)
            first = session.next_logprobs()
            rows = session.extend(seq[:-1]) if len(seq) > 1 else np.zeros((0, self.vocab_size))
            rows = np.vstack([first[None, :], rows])
            out[b] = float(rows[np.arange(len(seq)), seq].sum())
        return out

    def token_bytes(self) -> list[bytes | None]:
        """``(vocab_size,)`` the bytes each token id adds to the decoded text, None for a token that adds
        none, as the model's ``tokenizer`` spells them (:func:`~speculum.models.vocabulary.tokenizer_bytes`).
        ``InputError`` for a model without a tokenizer, such as the reference models. Read on every call;
        :func:`speculum.models.vocabulary.token_bytes` caches it per model."""
        name = getattr(self, "name", None) or type(self).__name__
        return tokenizer_bytes(self.tokenizer, self.vocab_size, name=str(name))


class RecomputeSession:
    """A session for models without incremental state: keeps every row it has computed.

    ``full_logprobs(tokens) -> (len(tokens), vocab)`` recomputes a whole sequence; rows already computed
    are cached, so ``rollback`` is free and ``extend`` costs one full forward.
    """

    def __init__(self, model: "BaseModel", prompt: Sequence[int], full_logprobs) -> None:
        self.model = model
        self._full = full_logprobs
        self.tokens: list[int] = check_token_ids(prompt, model.vocab_size, name="prompt")
        self._rows = self._full(self.tokens) if self.tokens else np.zeros((0, model.vocab_size))

    @property
    def length(self) -> int:
        return len(self.tokens)

    def next_logprobs(self) -> np.ndarray:
        if not self.tokens:
            raise InputError("the session is empty: this model needs at least one prompt token")
        return self._rows[-1]

    def extend(self, tokens: Sequence[int]) -> np.ndarray:
        tokens = check_token_ids(tokens, self.model.vocab_size, name="tokens")
        if not tokens:
            return np.zeros((0, self.model.vocab_size))
        self.tokens.extend(tokens)
        self._rows = self._full(self.tokens)
        return self._rows[-len(tokens):]

    def rollback(self, n: int) -> None:
        if not 0 <= n <= len(self.tokens):
            raise InputError(f"rollback({n}) on a session of length {len(self.tokens)}")
        if n:
            del self.tokens[-n:]
            self._rows = self._rows[: len(self.tokens)]


class ForwardModel(BaseModel):
    """Adapter for compatibility-API models, which only have ``forward(np.ndarray[1, T]) -> logits[1, T, V]``."""

    def __init__(self, obj: Any, vocab_size: int | None = None) -> None:
        if not callable(getattr(obj, "forward", None)):
            raise InputError("from_forward() needs an object with a forward(ids[1, T]) -> logits[1, T, V] method")
        self.inner = obj
        if vocab_size is None:
            vocab_size = getattr(obj, "vocab_size", None)
        if vocab_size is None:
            # Probe once with a single token to learn the vocabulary size.
            vocab_size = int(np.asarray(obj.forward(np.zeros((1, 1), dtype=np.int64))).shape[-1])
        self.vocab_size = int(vocab_size)
        self.eos_token_id = getattr(obj, "eos_token_id", None)
        self.bos_token_id = getattr(obj, "bos_token_id", None)

    def _full_logprobs(self, tokens: Sequence[int]) -> np.ndarray:
        logits = np.asarray(self.inner.forward(np.asarray([list(tokens)], dtype=np.int64)))
        if logits.ndim != 3 or logits.shape[0] != 1 or logits.shape[1] != len(tokens):
            raise InputError(f"forward() returned shape {logits.shape}, expected (1, {len(tokens)}, vocab)")
        if logits.shape[-1] != self.vocab_size:
            raise InputError(f"forward() returned vocab size {logits.shape[-1]}, expected {self.vocab_size}")
        return log_softmax(check_logits(logits[0], name="forward() logits"))

    def start(self, prompt: Sequence[int]) -> RecomputeSession:
        return RecomputeSession(self, prompt, self._full_logprobs)


def from_forward(obj: Any, vocab_size: int | None = None) -> AutoregressiveModel:
    """Adapt ``obj`` to the protocol: returns it unchanged if it already is a protocol model.

    Example:
        >>> class Uniform:
        ...     def forward(self, ids): return np.zeros(ids.shape + (4,))
        >>> from_forward(Uniform()).vocab_size
        4
    """
    if hasattr(obj, "start") and hasattr(obj, "next_logprobs") and hasattr(obj, "vocab_size"):
        return obj
    return ForwardModel(obj, vocab_size)
