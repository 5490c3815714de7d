"""The KV-cached session of a Hugging Face model (:class:`HFSession`), and the one formula of every
log-prob the PyTorch backend returns (:func:`_logprob_rows`)."""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from ..validation import InputError
from .base import check_token_ids
from .kv_arena import SlotCache

if TYPE_CHECKING:
    from .hf import HFModel

__all__ = ["HFSession"]


def _log_mass(logits: torch.Tensor) -> torch.Tensor:
    """``(n,)`` float64 log-sum-exp of ``(n, vocab)`` logits, rejecting NaN / +inf at the origin.

    float64 because float32 rows' mass drifts by ~1e-5, which downstream normalisation checks rightly
    reject. ``x.double() - _log_mass(x)`` is the formula of every log-prob this module returns
    (``next_logprobs``, ``next_logprobs_above``, ``score_sequences``), so they agree bitwise on one batch."""
    log_mass = torch.logsumexp(logits.double(), dim=-1)                     # (n,); NaN / inf propagate
    if not bool(torch.isfinite(log_mass).all()):
        raise InputError("the model produced NaN or infinite logits")
    return log_mass


def _logprob_rows(logits: torch.Tensor) -> np.ndarray:
    """``(n, vocab)`` logits (any float dtype) -> float64 NumPy log-probs (see ``_log_mass``)."""
    return (logits.double() - _log_mass(logits)[:, None]).numpy()


class HFSession:
    """Incremental decoding over one sequence with a KV cache (exact up to float precision).

    ``extend(tokens)`` is one forward over all tokens; ``rollback(n)`` crops the cache. Rows of the last
    ``extend`` are kept, so ``next_logprobs()`` after a rollback into them costs nothing. With
    ``defer=True`` (``HFModel.start_deferred``) the prompt is fed by the first forward instead of at once.
    """

    def __init__(self, model: HFModel, prompt: Sequence[int], *, defer: bool = False) -> None:
        self.model = model
        self.tokens: list[int] = model._context(prompt, name="prompt")
        self._cache = model._new_cache()
        self._rows = np.zeros((0, model.vocab_size))  # rows[j] follows tokens[: self._rows_start + j + 1]
        self._rows_start = len(self.tokens)
        self.unfed = 0                                # the last `unfed` tokens are not in the cache yet
        if defer:
            self.unfed = len(self.tokens)
            return
        with torch.inference_mode():
            # Prefill: logits of the last position only (skips the vocabulary projection elsewhere).
            logits = model._forward(torch.tensor([self.tokens]), self._cache, keep=1)
        self._rows = _logprob_rows(logits[0])
        self._rows_start = len(self.tokens) - 1

    @property
    def length(self) -> int:
        return len(self.tokens)

    def next_logprobs(self) -> np.ndarray:
        """``(vocab,)`` log-probs of the next token after the current tokens."""
        if not self.tokens:
            raise InputError("the session is empty: extend it before asking for next-token log-probs")
        j = len(self.tokens) - 1 - self._rows_start
        if not 0 <= j < len(self._rows):  # rolled back past the kept rows: recompute the last position
            last = self.tokens[-1]
            self.rollback(1)
            self.extend([last])
            j = len(self._rows) - 1
        return self._rows[j]

    def extend(self, tokens: Sequence[int]) -> np.ndarray:
        """Consume ``tokens`` in ONE forward; ``(len(tokens), vocab)``: row j follows ``tokens[: j + 1]``."""
        tokens = check_token_ids(tokens, self.model.vocab_size, name="tokens")
        if not tokens:
            return np.zeros((0, self.model.vocab_size))
        return self._consume(tokens, keep=len(tokens))

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
                self.model._forward(torch.tensor([part]), self._cache, keep=1)
        return self._fed_prompt(len(part))

    def _fed_prompt(self, n: int) -> np.ndarray:
        """Record that a forward fed the next ``n`` deferred prompt tokens (and computed no rows)."""
        self.unfed -= n
        return np.zeros((0, self.model.vocab_size))

    def _consumed(self, tokens: list[int], logits: torch.Tensor) -> np.ndarray:
        """Record a forward of ``feed(tokens)`` that returned ``logits (n, vocab)`` for its last n positions;
        their log-prob rows."""
        self.tokens.extend(tokens)
        self.unfed = 0
        self._rows = _logprob_rows(logits)
        self._rows_start = len(self.tokens) - len(self._rows)
        return self._rows

    def _consume(self, tokens: list[int], keep: int) -> np.ndarray:
        """One forward over ``feed(tokens)`` (checked, non-empty); keeps and returns the rows of its last
        ``keep`` positions."""
        self.model._check_length(len(self.tokens) + len(tokens), name="the session")
        with torch.inference_mode():
            logits = self.model._forward(torch.tensor([self.feed(tokens)]), self._cache, keep=keep)
        return self._consumed(tokens, logits[0])

    def adopt_prefix_layers(self, source: "HFSession") -> bool:
        """Take ``source``'s tokens and its KV cache for this model's layers (the first ones): exact for a
        draft that *is* the source model's first blocks (``truncated_draft``), whose keys and values for
        every consumed token equal the source's there. Replaces catching up with a forward. Returns False
        (and changes nothing) when the cache layout does not allow it."""
        source_cache = getattr(source, "_cache", None)
        count = int(self.model.config.num_hidden_layers)
        if getattr(source, "unfed", 0):
            return False                          # its cache does not hold its prompt yet
        if isinstance(source_cache, SlotCache):
            if source_cache.arena.layers < count or not source.tokens:
                return False
            self._cache = source_cache.to_dynamic(self.model.config, count)
        else:
            layers = getattr(source_cache, "layers", None)
            if not isinstance(layers, list) or len(layers) < count or not source.tokens:
                return False
            cache = self.model._new_cache()
            if not isinstance(getattr(cache, "layers", None), list):
                return False
            # Shallow copies: appending or cropping re-binds a copy's tensors and leaves the source's alone.
            cache.layers = [copy.copy(layer) for layer in layers[:count]]
            self._cache = cache
        self.tokens, self.unfed = list(source.tokens), 0
        self._rows = np.zeros((0, self.model.vocab_size))  # no row known: next_logprobs recomputes
        self._rows_start = len(self.tokens)
        return True

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens by cropping the KV cache (no recomputation)."""
        if not 0 <= n <= len(self.tokens):
            raise InputError(f"rollback({n}) on a session of length {len(self.tokens)}")
        if n:
            unfed = min(n, self.unfed)            # tokens never fed leave without touching the cache
            self.unfed -= unfed
            if n > unfed:
                self._cache.crop(-(n - unfed))
            del self.tokens[-n:]


# ------------------------------------------------------------------------------------------- helpers
