"""The KV-cached session of a Hugging Face model (:class:`HFSession`): one sequence's tokens, its
:class:`~speculum.models.hf.kv.cache.KVCache` and the rows of its last forward."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from ...validation import InputError
from ..base import check_token_ids
from .kv.cache import KVCache
from .kv.store import KVArena
from .logprobs import greedy_tokens, logprob_rows

if TYPE_CHECKING:
    from .model import HFModel

__all__ = ["HFSession"]


class HFSession:
    """Incremental decoding over one sequence with a KV cache (exact up to float precision).

    ``extend(tokens)`` is one forward over all tokens; ``rollback(n)`` trims the cache. Rows of the last
    ``extend`` are kept, so ``next_logprobs()`` after a rollback into them costs nothing. ``extend_greedy``
    returns only each row's greedy token; its rows are computed if ``next_logprobs`` asks for one. With
    ``defer=True`` (``HFModel.start_deferred``) the prompt is fed by the first forward instead of at once.
    With ``cache`` (a cache already holding every prompt token, as :meth:`sharing` builds) no forward
    runs, and the first ``next_logprobs`` recomputes the last position.

    The session runs its forwards through the model's public calls (``check_context``, ``check_length``,
    ``new_cache``, ``forward``); a packed forward of the model (``extend_sessions``) runs on the session's
    ``cache`` and hands the result back through :meth:`record_forward` / :meth:`record_prompt_fed`.
    """

    def __init__(self, model: HFModel, prompt: Sequence[int], *, defer: bool = False,
                 cache: KVCache | None = None) -> None:
        self.model = model
        self.tokens: list[int] = model.check_context(prompt, name="prompt")
        self._cache: KVCache = model.new_cache() if cache is None else cache
        # The last forward's rows: log-prob rows, or the logits they come from until one is asked for
        # (extend_greedy). rows[j] follows tokens[: self._rows_start + j + 1].
        self._rows: np.ndarray | torch.Tensor = np.zeros((0, model.vocab_size))
        self._rows_start = len(self.tokens)
        self.unfed = 0                                # the last `unfed` tokens are not in the cache yet
        if defer:
            self.unfed = len(self.tokens)
            return
        if cache is not None:
            return
        with torch.inference_mode():
            # Prefill: logits of the last position only (skips the vocabulary projection elsewhere).
            logits = model.forward(torch.tensor([self.tokens]), self._cache, keep=1)
        self._rows = logprob_rows(logits[0])
        self._rows_start = len(self.tokens) - 1

    @classmethod
    def sharing(cls, model: HFModel, source: Any) -> "HFSession | None":
        """A session of ``model`` on ``source``'s tokens that adopts its first layers' keys and values
        instead of a prefill (see :meth:`adopt_prefix_layers`); None when that is not possible."""
        cache = cls._prefix_cache(model, source)
        return None if cache is None else cls(model, source.tokens, cache=cache)

    def adopt_prefix_layers(self, source: Any) -> bool:
        """Take ``source``'s tokens and its KV cache for this model's layers (the first ones): exact for a
        draft that *is* the source model's first blocks (``truncated_draft``), whose keys and values for
        every consumed token equal the source's there. Replaces catching up with a forward. Returns False
        (and changes nothing) when the source's prompt is not all in its cache or the cache layout does not
        allow it; ``source`` itself is never changed."""
        cache = self._prefix_cache(self.model, source)
        if cache is None:
            return False
        self._cache = cache
        self.tokens, self.unfed = list(source.tokens), 0
        self._rows = np.zeros((0, self.model.vocab_size))  # no row known: next_logprobs recomputes
        self._rows_start = len(self.tokens)
        return True

    @staticmethod
    def _prefix_cache(model: HFModel, source: Any) -> KVCache | None:
        """A cache for ``model`` holding the first layers of ``source``'s cache, or None (see above)."""
        source_cache = getattr(source, "cache", None)
        if source_cache is None or getattr(source, "unfed", 0) or not getattr(source, "tokens", None):
            return None
        return source_cache.prefix_layers(int(model.config.num_hidden_layers), model.config)

    def fork(self) -> "HFSession":
        """A session on the same tokens holding the same keys and values without copying them: appends and
        rollbacks of either leave the other as it is (its cache's layers are shallow copies). The prompt
        must be fed (no ``unfed`` tokens)."""
        forked = self.sharing(self.model, self) if not self.unfed else None
        if forked is None:
            raise InputError("only a session whose prompt is fed, on a cache of its own, can be forked")
        return forked

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def cache(self) -> KVCache:
        """The session's keys and values (what a packed forward of the model extends)."""
        return self._cache

    def move_cache_into(self, store: KVArena) -> None:
        """Hold the same keys and values in a slot of ``store`` from now on (no change when already there)."""
        self._cache = self._cache.into_store(store)

    def next_logprobs(self) -> np.ndarray:
        """``(vocab,)`` log-probs of the next token after the current tokens."""
        if not self.tokens:
            raise InputError("the session is empty: extend it before asking for next-token log-probs")
        j = len(self.tokens) - 1 - self._rows_start
        if not 0 <= j < len(self._rows):  # rolled back past the kept rows: recompute the last position
            last = self.tokens[-1]
            self.rollback(1)
            return self.extend([last])[0]
        if isinstance(self._rows, torch.Tensor):
            self._rows = logprob_rows(self._rows)
        return self._rows[j]

    def extend(self, tokens: Sequence[int]) -> np.ndarray:
        """Consume ``tokens`` in ONE forward; ``(len(tokens), vocab)``: row j follows ``tokens[: j + 1]``."""
        tokens = check_token_ids(tokens, self.model.vocab_size, name="tokens")
        if not tokens:
            return np.zeros((0, self.model.vocab_size))
        return self._consume(tokens, keep=len(tokens))

    def extend_greedy(self, tokens: Sequence[int]) -> np.ndarray:
        """Consume ``tokens`` in ONE forward, as :meth:`extend`; ``(len(tokens),)`` int64: each row's greedy
        token, bitwise the argmax (lowest id on ties) of the row ``extend`` returns, without computing the
        rows (:func:`~speculum.models.hf.logprobs.greedy_tokens`): what greedy verification reads."""
        tokens = check_token_ids(tokens, self.model.vocab_size, name="tokens")
        if not tokens:
            return np.zeros(0, dtype=np.int64)
        return self._consume(tokens, keep=len(tokens), greedy=True)

    def advance(self, tokens: Sequence[int]) -> np.ndarray:
        """Consume ``tokens`` in one forward; ``(vocab,)`` log-probs after the LAST of them only.

        Same cache state as ``extend``, but the vocabulary projection runs at one position instead of
        ``len(tokens)``: a draft catching up on accepted tokens needs only that row, and for a small model
        with a large vocabulary (SmolLM2: 49152 × 576) the projection is most of a short forward."""
        tokens = check_token_ids(tokens, self.model.vocab_size, name="tokens")
        if not tokens:
            return self.next_logprobs()
        return self._consume(tokens, keep=1)[0]

    def unfed_tokens(self) -> list[int]:
        """The tokens of the deferred prompt not fed to the model yet."""
        return self.tokens[len(self.tokens) - self.unfed:] if self.unfed else []

    def feed(self, tokens: list[int]) -> list[int]:
        """What a forward extending this session by ``tokens`` reads: the tokens not fed yet, then ``tokens``."""
        return self.unfed_tokens() + tokens if self.unfed else tokens

    def feed_prompt(self, n: int) -> np.ndarray:
        """Feed the next ``n`` (at most) tokens of a deferred prompt in one forward; no rows (an empty
        ``(0, vocab)`` array). The rest of the prompt is fed by later forwards."""
        part = self.unfed_tokens()[:n]
        if part:
            with torch.inference_mode():
                self.model.forward(torch.tensor([part]), self._cache, keep=1)
        return self.record_prompt_fed(len(part))

    def record_prompt_fed(self, n: int) -> np.ndarray:
        """Record that a forward on :attr:`cache` fed the next ``n`` deferred prompt tokens and computed no
        rows; returns the empty ``(0, vocab)`` rows."""
        self.unfed -= n
        return np.zeros((0, self.model.vocab_size))

    def record_forward(self, tokens: list[int], logits: torch.Tensor, greedy: bool = False) -> np.ndarray:
        """Record that a forward on :attr:`cache` read ``feed(tokens)`` and returned ``logits (n, vocab)``
        for its last n positions; returns (and keeps) their ``(n, vocab)`` log-prob rows, or with ``greedy``
        their greedy tokens ``(n,)`` (:meth:`extend_greedy`), keeping the logits until a row is asked for."""
        self.tokens.extend(tokens)
        self.unfed = 0
        self._rows_start = len(self.tokens) - len(logits)
        if greedy:
            chosen = greedy_tokens(logits)
            self._rows = logits
            return chosen
        self._rows = logprob_rows(logits)
        return self._rows

    def _consume(self, tokens: list[int], keep: int, greedy: bool = False) -> np.ndarray:
        """One forward over ``feed(tokens)`` (checked, non-empty); keeps the rows of its last ``keep``
        positions and returns them (``greedy``: their greedy tokens)."""
        self.model.check_length(len(self.tokens) + len(tokens), name="the session")
        with torch.inference_mode():
            logits = self.model.forward(torch.tensor([self.feed(tokens)]), self._cache, keep=keep)
        return self.record_forward(tokens, logits[0], greedy=greedy)

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens by trimming the KV cache (no recomputation)."""
        if not 0 <= n <= len(self.tokens):
            raise InputError(f"rollback({n}) on a session of length {len(self.tokens)}")
        if n:
            unfed = min(n, self.unfed)            # tokens never fed leave without touching the cache
            if n > unfed and not self._cache.is_trimmable:
                raise InputError(f"the KV cache of {self.model.name} cannot forget tokens: its sessions do not "
                                 "roll back")
            self.unfed -= unfed
            if n > unfed:
                self._cache.trim(n - unfed)
            del self.tokens[-n:]
