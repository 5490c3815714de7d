"""Any local Hugging Face causal language model as a speculum protocol model (PyTorch).

* ``HFModel.from_pretrained(path)`` reads a local model directory (never the hub: ``local_files_only``).
* ``model.start(prompt)`` returns an ``HFSession`` holding a KV cache (:mod:`~speculum.models.hf.kv.cache`);
  ``extend`` runs ONE forward over all new tokens (the verification pass of speculative decoding) and
  ``rollback`` trims the cache, so a rejected draft tail costs nothing to undo.
* ``extend_sessions(feeds)`` extends many sessions in one packed forward, their caches moved into one KV
  store (:mod:`~speculum.models.hf.kv.store`).
* ``next_logprobs(prefixes)`` evaluates many prefixes in a few batched forwards: their longest common
  prefix (usually the prompt) is encoded once and reused across calls, and the distinct suffixes are
  walked as a trie, one batched forward per depth, so a token shared by many prefixes is encoded once.
* ``next_logprobs_above(prefixes, min_logprobs)`` is the sparse form enumeration uses (an optional
  protocol hook): only the tokens at or above a per-prefix log-prob, with the same float64 values.
* ``score_sequences(sequences, prompt)`` teacher-forces all sequences in right-padded batches on top of
  the prompt's shared cache. Right padding needs no attention mask: under causal attention a real
  position never sees the padding that follows it.

Precision: the forward runs in the model's dtype (float32 by default; a bfloat16 Llama multiplies its
bfloat16 weights in the fused forward with float32 activations, see ``forward/fused.py``); logits are
log-softmaxed in float64 by torch and returned as float64 NumPy rows (normalised to ~1e-15). Batched verification uses
different matrix shapes from one-token decoding, so two logits closer than ~1e-6 may swap order between
the two (floating-point sums depend on their order); in float32 this is rare enough that greedy
speculative output matches plain greedy decoding in the tests, but it is not a bitwise guarantee, and it
is not expected to hold in bfloat16.

Example:
    >>> model = HFModel.from_pretrained("path/to/model")            # doctest: +SKIP
    >>> session = model.start(model.encode("Hello"))                 # doctest: +SKIP
    >>> rows = session.extend([42, 7]); session.rollback(1)          # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

import numpy as np
import torch

from ...validation import InputError
from ..base import (BaseModel, Capabilities, Feed, check_prompt, check_session_blocks, check_token_ids,
                    common_prefix_length)
from ..cpu import default_threads
from ..interruption import Interrupted
from ..memory.allocator import trim_heap
from ..vocabulary import hf_token_bytes
from .forward.fused import FusedForward, release_block_weights, unsupported_reason
from .forward.packed import RowInvariantForward
from .forward.prefix_levels import trie_forward
from .kernels.gguf_groups import GroupedWeight, attach_groups
from .kernels.onednn import prepack_linears
from .kv.cache import KVCache, OwnCache
from .kv.store import KVArena
from .logprobs import entries_at_least, finite_counts, log_mass, logprob_rows
from .precision import activations_quantised, parse_dtype, prepare_module, q8_refusal, warn_if_slow
from .session import HFSession
from .threads import governed_threads

__all__ = ["HFModel", "HFSession", "parse_dtype"]

# Bytes of KV cache and of float32 logits one batched chunk may hold; bounds memory for huge batches.
KV_BUDGET_BYTES = 256 * 2**20
LOGITS_BUDGET_BYTES = 256 * 2**20
# Bytes the KV store of packed decoding may take: every slot is as long as the longest session, so one
# long session among many would otherwise cost slots x its length.
ARENA_BUDGET_BYTES = 1024 * 2**20
# Shared-prefix caches kept between batched calls: enumeration alternates between the prompt and the prompt
# plus one first token, so a few cover it.
_SHARED_CACHES = 4


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (transformers' messages span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class HFModel(BaseModel):
    """A Hugging Face causal LM behind the speculum protocol (exact up to the model's float precision).

    Args:
        module: a transformers ``*ForCausalLM`` module (any ``torch.nn.Module`` with the same forward:
            ``module(input_ids=, cache=, use_cache=True, logits_to_keep=)``).
        tokenizer: the matching transformers tokenizer, or None.
        name: a label for messages and benchmarks.
        prepack: the CPU fast path for float32 models, same results to float32 rounding, one more copy
            of the weights. Llama, Mistral, Qwen2, Qwen3 and Gemma 3 models run the fused forward of
            :mod:`speculum.models.hf.forward.fused`; other models run their float32 ``nn.Linear`` layers
            through pre-packed oneDNN weights (:mod:`speculum.models.hf.kernels.onednn`). False keeps
            transformers' forward with PyTorch's default kernels.
        groups: the GGUF weight groups the float32 weights were expanded from
            (:func:`~speculum.models.hf.kernels.gguf_groups.read_groups`): with ``prepack``, the fused forward
            multiplies by them instead of the expanded weights (:mod:`speculum.models.hf.kernels.gguf_groups`).

    Attributes: ``vocab_size`` (width of the logits), ``max_context`` (from the config),
    ``eos_token_id``, ``bos_token_id``, ``tokenizer``, ``module``, ``config``, ``dtype``,
    ``fused_forward`` (the fused forward is in use), ``fused`` (that forward, or None),
    ``prepacked_layers`` (Linear layers packed), ``grouped_layers`` (Linear layers multiplied by their weight groups),
    ``capabilities`` (packed forwards of many sessions only with the fused forward).

    Its sessions (:class:`~speculum.models.hf.session.HFSession`) run through the public calls
    :meth:`check_context`, :meth:`check_length`, :meth:`new_cache` and :meth:`forward`.
    """

    def __init__(self, module: torch.nn.Module, tokenizer: Any = None, *, name: str = "hf-model",
                 prepack: bool = True, groups: dict[str, GroupedWeight] | None = None) -> None:
        self.module = module.eval()
        self.config = module.config
        self.tokenizer = tokenizer
        self.name = name
        self.dtype = next(module.parameters()).dtype
        # Layers whose weights are GGUF groups multiply by the groups (fewer bytes a step, same weights).
        self.grouped_layers = attach_groups(module, groups) if prepack and groups else 0
        quantised = activations_quantised(module)
        if quantised:           # q8 runs on the fused forward and the groups alone: nothing to fall back on
            reason = q8_refusal(module) if prepack else "q8 runs on the fused forward: prepack=False has none"
            if reason is not None:
                raise InputError(reason)
        # The fused forward packs its own (fused) weights, so per-layer packing would only add a third copy.
        self._fused = FusedForward.build(module) if prepack else None
        if quantised and self._fused is None:
            raise InputError(f"q8 runs on the fused forward, which does not run {name} "
                             f"({unsupported_reason(module) or 'its load-time check disagrees'})")
        # Declared once, here: many sessions in one forward needs the fused forward's packed variant.
        self.capabilities = Capabilities(sparse_rows=True, session_advance=True, shares_prefix_cache=True,
                                         batched_extend=self._fused is not None,
                                         deferred_prefill=self._fused is not None, invariant_extend=True,
                                         prefix_levels=True,
                                         canonical_rows=self._fused is not None and self._fused.canonical_rows,
                                         interruptible_rows=self._stoppable(), normalised_rows=True,
                                         greedy_tokens=True)
        self._rows_forward = RowInvariantForward(self._fused) if self._fused is not None else None
        self.prepacked_layers = prepack_linears(module) if prepack and self._fused is None else 0
        head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
        self.vocab_size = int(getattr(head, "out_features", 0) or self.config.vocab_size)
        if tokenizer is not None and len(tokenizer) > self.vocab_size:
            raise InputError(
                f"tokenizer of {name} has {len(tokenizer)} tokens but the model's logits only "
                f"{self.vocab_size}: they do not belong together"
            )
        self.max_context = getattr(self.config, "max_position_embeddings", None)
        self.eos_token_id = _first_id(getattr(tokenizer, "eos_token_id", None), self.config.eos_token_id)
        self.bos_token_id = _first_id(getattr(tokenizer, "bos_token_id", None), self.config.bos_token_id)
        # Prefix caches shared by the rows of a batched call (the prompt, a common first token), by tokens.
        self._shared_caches: dict[tuple[int, ...], OwnCache] = {}
        # Forwards on the cores other processes leave free, where the rows ignore the thread count.
        self._threads = governed_threads(torch.get_num_threads(), self._probe_rows) if self._fused else None
        layers, kv_heads, head_dim = _kv_geometry(self.config)
        # The sessions' KV store for packed forwards (it holds no memory until a session moves in).
        # Its keys and values in the forward's activation dtype: float32 in the fused forward, whatever the weights.
        kv_dtype = torch.float32 if self._fused is not None else self.dtype
        # The compiled forward reads each session's keys within its length only: its store needs no zeros, and
        # uninitialised memory costs only the pages written, so it starts at a server's 8 slots of 512 tokens
        # (no growth, which copies the store, in a typical burst of requests).
        compiled = self._fused is not None and self._fused.row_ops is not None
        sizes = {"fill": None, "first_slots": 8, "first_capacity": 512} if compiled else {}
        self._arena = KVArena(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=kv_dtype, **sizes)
        self._kv_bytes_per_token = self._arena.bytes_for(1, 1)

    @property
    def fused_forward(self) -> bool:
        """True when forwards run the fused forward (:mod:`speculum.models.hf.forward.fused`)."""
        return self._fused is not None

    @property
    def fused(self) -> FusedForward | None:
        """The fused forward in use (:class:`~speculum.models.hf.forward.fused.FusedForward`: its
        blocks, their products and the head), for inspection; None where :attr:`fused_forward` is False."""
        return self._fused

    def release_unfused_weights(self) -> int:
        """Give back the module's own copies of the block weights the fused forward holds packed (a
        server's resident memory: one copy of each weight, not two); returns the bytes given back, 0
        without a fused forward. Every call of this model is unchanged; drafts derived from it (twins,
        ``layers:K``) must be made before, and are refused after."""
        if self._fused is None:
            return 0
        released = release_block_weights(self.module)
        trim_heap()
        return released

    # ------------------------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, dtype: str | torch.dtype = "float32", threads: int | None = None,
        prepack: bool = True, groups: dict[str, GroupedWeight] | None = None,
    ) -> "HFModel":
        """Load a local model directory (config + weights + tokenizer); never contacts a model hub.

        Raises FileNotFoundError when ``path`` is not a directory with a ``config.json``.

        Example:
            >>> model = HFModel.from_pretrained("~/models/SmolLM2-135M-Instruct")   # doctest: +SKIP
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: loaded with the first model

        parse_dtype(dtype)
        if isinstance(dtype, str):
            warn_if_slow(dtype)
        folder = Path(path).expanduser()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"no Hugging Face model directory at {str(path)!r} (config.json missing)")
        from transformers.utils import logging as hf_logging  # heavy: loaded with the first model

        torch.set_num_threads(threads or default_threads())
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a local load takes about a second: no per-tensor bar
        # transformers reports a broken directory (bad JSON, missing or truncated weights, an unknown
        # architecture) as OSError / ValueError / KeyError from deep inside: name the folder in one line.
        try:
            module = AutoModelForCausalLM.from_pretrained(
                folder, dtype=parse_dtype(dtype), local_files_only=True
            )
            module = prepare_module(module, dtype)
        except (OSError, ValueError, KeyError) as exc:
            raise InputError(f"cannot load a model from {folder}: {_one_line(exc)}") from exc
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        # A weights-only directory works on token ids; a tokenizer file that fails to load is an error
        # (swallowing it would surface later as a misleading "has no tokenizer").
        tokenizer = None
        if any((folder / name).is_file() for name in _TOKENIZER_FILES):
            try:
                tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise InputError(f"cannot load the tokenizer in {folder}: {_one_line(exc)}") from exc
        return cls(module, tokenizer, name=folder.name, prepack=prepack, groups=groups)

    # ------------------------------------------------------------------------------------ text helpers
    def encode(self, text: str, *, chat: bool | None = None) -> list[int]:
        """Token ids of ``text``; ``chat`` (default: when the tokenizer has a chat template) wraps it as a
        user turn with the generation prompt appended, as instruct models expect."""
        if self.tokenizer is None:
            raise InputError(f"{self.name} has no tokenizer: pass token ids instead of text")
        if chat is None:
            chat = bool(getattr(self.tokenizer, "chat_template", None))
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise InputError(f"the tokenizer of {self.name} has no chat template: use raw prompts")
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        return [int(t) for t in ids]

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` (special tokens skipped)."""
        if self.tokenizer is None:
            raise InputError(f"{self.name} has no tokenizer")
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def token_bytes(self) -> list[bytes | None]:
        """``(vocab_size,)`` the bytes each token id adds to the decoded text, None for a token that adds
        none (special tokens, ids past the tokenizer's end), read from the transformers tokenizer
        (:func:`~speculum.models.vocabulary.hf_token_bytes`): exact for byte-level and SentencePiece-style
        decoders. ``InputError`` without a tokenizer. Read on every call;
        :func:`speculum.models.vocabulary.token_bytes` caches it per model."""
        return hf_token_bytes(self.tokenizer, self.vocab_size, name=self.name)

    # ------------------------------------------------------------------------------------ protocol
    def start_sharing(self, source: HFSession) -> HFSession | None:
        """A session on ``source``'s tokens that reuses its KV cache instead of a prefill, for a model that
        is ``source``'s model truncated to its first blocks (see :meth:`HFSession.sharing`); None when the
        cache layout does not allow it."""
        return HFSession.sharing(self, source)

    def start(self, prompt: Sequence[int]) -> "HFSession":
        """A KV-cached session after ``prompt`` (an empty prompt starts from BOS). Exact."""
        return HFSession(self, prompt)

    def start_deferred(self, prompt: Sequence[int]) -> "HFSession":
        """A session after ``prompt`` whose prompt is fed by its first forward (``Capabilities.deferred_prefill``):
        ``extend_sessions`` then packs a new generation's prompt into the forward that verifies the others'
        blocks. Exact: the same rows as :meth:`start`'s session, up to float rounding."""
        return HFSession(self, prompt, defer=True)

    def extend_sessions(self, feeds: Sequence[Feed] | Sequence[HFSession],
                        token_lists: Sequence[Sequence[int]] | None = None,
                        prompt_limits: Sequence[int | None] | None = None) -> list[np.ndarray]:
        """Each feed's ``session.extend(tokens)`` in one packed forward (``Capabilities.batched_extend``),
        rows in the order of ``feeds``: the decoding scheduler verifies the blocks of many generations with
        it. Without the fused forward, one forward per session.

        ``feeds``: :class:`~speculum.models.base.Feed` records, or the sessions with ``token_lists`` (and
        ``prompt_limits``) beside them. A session with a deferred prompt (:meth:`start_deferred`) feeds it
        first. A feed's ``prompt_limit`` (``Capabilities.deferred_prefill``): feed at most that many of its
        session's deferred prompt tokens; a session fed only part of its prompt must have no tokens of its
        own and gets no rows (a long prompt is fed over several packed forwards, so the running generations
        keep advancing). A feed with ``greedy`` (``Capabilities.greedy_tokens``) gets its rows' greedy tokens
        ``(n,)``, as its session's ``extend_greedy`` would. Exact: each session's rows and state are those of
        its own ``extend``, up to float rounding (``docs/backends.md``)."""
        feeds = check_session_blocks(self, HFSession, feeds, token_lists, prompt_limits)
        part = [feed.prompt_limit is not None and feed.prompt_limit < feed.session.unfed for feed in feeds]
        if any(p and feed.tokens for p, feed in zip(part, feeds)):
            raise InputError("a session fed only part of its deferred prompt cannot take tokens of its own")
        if self._fused is None or any(not feed.tokens and not p for feed, p in zip(feeds, part)):
            return [feed.session.feed_prompt(feed.prompt_limit) if p
                    else feed.session.extend_greedy(feed.tokens) if feed.greedy else feed.session.extend(feed.tokens)
                    for feed, p in zip(feeds, part)]
        for feed in feeds:
            self.check_length(len(feed.session.tokens) + len(feed.tokens), name="the session")
        sessions = [feed.session for feed in feeds]
        self._into_store(sessions, max(len(feed.session.tokens) + len(feed.tokens) for feed in feeds))
        reads = [feed.session.unfed_tokens()[:feed.prompt_limit] if p else feed.session.feed(feed.tokens)
                 for feed, p in zip(feeds, part)]
        self.govern_threads()
        with torch.inference_mode():        # the head runs on the rows of the sessions' own tokens only
            logits = self._fused.forward_packed(reads, [session.cache for session in sessions],
                                                keep=[len(feed.tokens) for feed in feeds])
        return [feed.session.record_prompt_fed(len(read)) if p
                else feed.session.record_forward(feed.tokens, rows, greedy=feed.greedy)
                for feed, read, rows, p in zip(feeds, reads, logits, part)]

    @property
    def kv_store(self) -> Any:
        """The KV store (:class:`~speculum.models.hf.kv.store.KVArena`) whose slots the model's decoding
        sessions share: what it holds, for inspection (``in_use``, ``slots``, ``capacity``)."""
        return self._arena

    def prepare_packing(self) -> bool:
        """Run the check that packed forwards keep each sequence's rows (:mod:`~speculum.models.hf.forward.packed`)
        now rather than at the first :meth:`extend_rows` (a server calls it before its first request); True
        where sequences are packed into shared forwards."""
        return self._rows_forward is not None and self._rows_forward.packs

    def extend_rows(self, sessions: Sequence[HFSession], token_lists: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Each session extended by its unfed prompt tokens, then its tokens, with ``(read, vocab)`` log-prob
        rows for every token read (``Capabilities.invariant_extend``), packed into shared forwards where the
        fused forward's kernels allow (:mod:`~speculum.models.hf.forward.packed`), else one forward each.

        BATCH-INVARIANT: each session's rows are bitwise those this call gives it alone; relative to the
        model, exact to float32 rounding (the fused forward's)."""
        feeds = check_session_blocks(self, HFSession, sessions, token_lists, call="extend_rows")
        for i, feed in enumerate(feeds):
            self.check_length(len(feed.session.tokens) + len(feed.tokens), name=f"sessions[{i}]")
        reads = [feed.session.feed(feed.tokens) for feed in feeds]
        if not all(reads):
            raise InputError("every session needs a token to read (its unfed prompt or tokens of its own)")
        caches = [feed.session.cache for feed in feeds]
        self.govern_threads()
        with torch.inference_mode():
            if self._rows_forward is not None:
                lengths = [cache.length for cache in caches]
                try:
                    with self._fused.interruption.armed():
                        logits = self._rows_forward(reads, caches)
                except Interrupted:     # the sessions record nothing; their caches forget the layers written
                    for cache, length in zip(caches, lengths):
                        cache.cut_to(length)
                    raise
            else:
                logits = [self.forward(torch.tensor([read]), cache)[0] for read, cache in zip(reads, caches)]
        return [feed.session.record_forward(feed.tokens, rows) for feed, rows in zip(feeds, logits)]

    def interruptible(self, check: Callable[[], bool]) -> ContextManager[None]:
        """A context within which :meth:`extend_rows` on this thread stops between two layers once ``check()``
        is True (``Capabilities.interruptible_rows``): it raises
        :class:`~speculum.models.interruption.Interrupted` with every session as before the call. A call that
        is not stopped gives the rows it gives outside the context. A model that cannot stop (no fused
        forward, or layers with a sliding window, whose caches forget keys for good) never does.

        Example:
            >>> with model.interruptible(lambda: queue_has_work()):        # doctest: +SKIP
            ...     rows = model.extend_rows(sessions, token_lists)
        """
        if not self.capabilities.interruptible_rows:
            return contextlib.nullcontext()
        return self._fused.interruption.requested(check)

    def _stoppable(self) -> bool:
        """Whether a packed forward can stop between layers and be undone: a fused forward whose layers all
        attend to every key (a sliding-window layer's cache drops keys it could not get back)."""
        return self._fused is not None and all(window is None for window in self._fused.windows)

    def _into_store(self, sessions: Sequence[HFSession], length: int) -> None:
        """Move the sessions' caches into the model's KV store (:mod:`~speculum.models.hf.kv.store`), where
        the packed forward attends once per layer for all of them, while the store stays within
        ``ARENA_BUDGET_BYTES`` with every slot ``length`` tokens long; beyond it they keep caches of their own
        (the packed forward then attends per session)."""
        arena = self._arena
        with arena.lock:
            joining = sum(session.cache.store is not arena for session in sessions)
            slots = max(arena.slots, arena.in_use + joining)
            if arena.bytes_for(slots, max(arena.capacity, length)) > ARENA_BUDGET_BYTES:
                return
            for session in sessions:
                session.move_cache_into(arena)

    @torch.inference_mode()
    def next_logprobs(self, prefixes: Sequence[Sequence[int]]) -> np.ndarray:
        """``(batch, vocab)`` next-token log-probs after each prefix, in a few batched forwards.

        Exact up to float precision (batch shapes may perturb logits by ~1e-6). The common prefix is
        encoded once (and kept for the next call); distinct suffixes share their common tokens (a trie
        walked one depth per forward), in chunks that bound memory.

        Example:
            >>> model.next_logprobs([prompt + [5], prompt + [9]]).shape       # doctest: +SKIP
            (2, 49152)
        """
        contexts = [self.check_context(prefix, name=f"prefixes[{i}]") for i, prefix in enumerate(prefixes)]
        out = np.empty((len(contexts), self.vocab_size))

        def fill(rows: list[int], logits: torch.Tensor) -> None:
            out[rows] = logprob_rows(logits)

        self._walk_prefixes(contexts, fill)
        return out

    def start_levels(self, prompt: Sequence[int]) -> OwnCache:
        """The root level of a walk over continuations of ``prompt`` (``Capabilities.prefix_levels``): one
        node holding ``prompt`` less its last token, which the first ``extend_level`` feeds."""
        prompt = self.check_context(prompt, name="prompt")
        return self._cache_for(prompt[:-1])

    @torch.inference_mode()
    def extend_level(self, level: OwnCache, parents: Sequence[int], tokens: Sequence[int]
                     ) -> tuple[OwnCache, np.ndarray]:
        """``(level, rows)``: the nodes ``parents[i]`` of ``level`` extended by ``tokens[i]``, as a new level
        (``level`` untouched), and ``(nodes, vocab)`` log-probs after each: one forward of one token a node.
        Exact up to float rounding (batch shapes may perturb logits by ~1e-6, as in ``next_logprobs``)."""
        tokens = check_token_ids(tokens, self.vocab_size, name="tokens")
        if len(parents) != len(tokens) or not tokens:
            raise InputError(f"extend_level needs one parent for each token: {len(parents)} parents, "
                             f"{len(tokens)} tokens")
        cache, logits = self._level_step(level, list(parents), tokens)
        return cache, logprob_rows(logits)

    def level_capacity(self, length: int) -> int:
        """Nodes a level of ``length`` tokens may hold within the KV and logits budgets."""
        return self._chunk_rows(length, 1)

    @torch.inference_mode()
    def next_logprobs_above(self, prefixes: Sequence[Sequence[int]], min_logprobs: Sequence[float]
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Sparse ``next_logprobs``: per prefix, the tokens whose log-prob is ``>= min_logprobs[i]``.

        Returns ``(row (m,), token (m,), logprob (m,), finite (batch,))``: every entry of ``next_logprobs``
        with ``logprob >= min_logprobs[row]`` (and possibly a few just below: the pre-selection runs on
        float32 logits with a safety margin), with the value ``next_logprobs`` would return for it (the same
        float64 formula, exact up to the model's float precision), and each row's number of tokens of
        finite log-prob. No ``(batch, vocab)`` float64 array is built, which is what makes enumeration's
        level expansion cheap (``speculum.enumeration.index.tree`` uses this hook when a model has it).

        Example:
            >>> row, token, lp, finite = model.next_logprobs_above([prompt], [-5.0])   # doctest: +SKIP
        """
        contexts = [self.check_context(prefix, name=f"prefixes[{i}]") for i, prefix in enumerate(prefixes)]
        floors = np.asarray(min_logprobs, dtype=np.float64).reshape(-1)          # (batch,)
        if len(floors) != len(contexts) or np.isnan(floors).any():
            raise InputError(f"min_logprobs must hold one number per prefix ({len(contexts)}), got {len(floors)}")
        finite = np.zeros(len(contexts), dtype=np.int64)
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

        def select(rows: list[int], logits: torch.Tensor) -> None:
            mass = log_mass(logits)                                               # (k,) float64
            cut = torch.from_numpy(floors[rows]) + mass                          # (k,) logit cut, float64
            # float32 compare: lower the cut by far more than float32 rounding so no wanted entry is lost.
            loose = (cut - 1e-5 * (1.0 + cut.abs())).float()
            r, tok = entries_at_least(logits, loose)
            values = logits[r, tok].double() - mass[r]
            rows_np = np.asarray(rows)
            finite[rows_np] = finite_counts(logits).numpy()
            parts.append((rows_np[r.numpy()], tok.numpy(), values.numpy()))

        self._walk_prefixes(contexts, select)
        if not parts:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), finite
        row, token, logprob = (np.concatenate(a) for a in zip(*parts))
        return row.astype(np.int64), token.astype(np.int64), logprob, finite

    @torch.inference_mode()
    def score_sequences(self, sequences: Sequence[Sequence[int]], prompt: Sequence[int] = ()) -> np.ndarray:
        """``(batch,)`` total log p(sequence | prompt) by batched teacher forcing. Exact up to float
        precision; the prompt (BOS when empty) is encoded once and shared by every sequence.

        Example:
            >>> model.score_sequences([[5, 6], [7]], prompt=prompt_ids)       # doctest: +SKIP
        """
        context = self.check_context(prompt, name="prompt")
        seqs = [check_token_ids(s, self.vocab_size, name=f"sequences[{i}]") for i, s in enumerate(sequences)]
        out = np.zeros(len(seqs))
        live = [i for i, s in enumerate(seqs) if s]
        if not live:
            return out
        longest = max(len(seqs[i]) for i in live)
        self.check_length(len(context) + longest - 1, name="prompt + sequence")
        root = self._cache_for(context[:-1])
        chunk = self._chunk_rows(len(context) + longest, longest)
        for lo in range(0, len(live), chunk):
            rows = live[lo: lo + chunk]
            # Inputs: last prompt token + sequence[:-1]; right-padded with token 0 (never attended to).
            inputs = torch.zeros((len(rows), longest), dtype=torch.long)
            targets = torch.zeros((len(rows), longest), dtype=torch.long)
            valid = torch.zeros((len(rows), longest), dtype=torch.bool)
            for r, i in enumerate(rows):
                seq = seqs[i]
                inputs[r, : len(seq)] = torch.tensor([context[-1], *seq[:-1]])
                targets[r, : len(seq)] = torch.tensor(seq)
                valid[r, : len(seq)] = True
            logits = self.forward(inputs, root.rows(torch.zeros(len(rows), dtype=torch.long)))
            # (rows, longest, vocab); the float64 formula of logprob_rows, so scores match next_logprobs rows
            mass = log_mass(logits.reshape(-1, logits.shape[-1])).reshape(logits.shape[:2])
            picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double() - mass
            out[rows] = (picked * valid).sum(dim=1).numpy()
        return out

    # ------------------------------------------------------------------------------------ for its sessions
    def check_context(self, tokens: Sequence[int], *, name: str) -> list[int]:
        """``tokens`` as a checked context (an empty one becomes ``[bos]``); ``InputError`` naming ``name``
        for a token outside the vocabulary or a context longer than the window."""
        ids = check_prompt(self, tokens, name=name)
        self.check_length(len(ids), name=name)
        return ids

    def check_length(self, length: int, *, name: str) -> None:
        """``InputError`` naming ``name`` when ``length`` tokens do not fit the context window."""
        if self.max_context is not None and length > self.max_context:
            raise InputError(
                f"{name} has {length} tokens, more than the context window of {self.name} "
                f"({self.max_context} tokens)"
            )

    def new_cache(self) -> OwnCache:
        """An empty KV cache of its own for this model's layers (what a new session holds)."""
        return OwnCache()

    def forward(self, input_ids: torch.Tensor, cache: KVCache, keep: int = 0) -> torch.Tensor:
        """One forward of ``input_ids (batch, n)`` on top of ``cache`` (extended in place) -> logits
        ``(batch, keep or n, vocab)`` in the model's dtype: the fused forward where it is in use, else
        transformers' own, which reads only a cache with a ``transformers_cache`` (never a store slot: only
        the fused forward moves sessions into the store)."""
        if self._fused is not None:
            self.govern_threads()
            return self._fused(input_ids, cache, keep)
        return self.module(input_ids=input_ids, cache=cache.transformers_cache, use_cache=True,
                           logits_to_keep=keep).logits

    def govern_threads(self) -> int | None:
        """Before a forward: PyTorch's thread count set to the cores other processes leave free (None: the
        count is fixed for this model; see :mod:`~speculum.models.hf.threads`)."""
        return None if self._threads is None else self._threads.adjust()

    # ------------------------------------------------------------------------------------ internals
    @torch.inference_mode()
    def _probe_rows(self) -> torch.Tensor:
        """A prompt's rows, then a block's and a step's on top of it (each product at several row counts):
        what the thread probe compares."""
        cache = self.new_cache()
        total = min(39, self.max_context or 39)               # within the model's context
        ids = torch.arange(total).remainder(self.vocab_size)
        cuts = [0, max(total - 6, 1), max(total - 1, 1), total]
        return torch.cat([self._fused(ids[None, start:end], cache)[0]
                          for start, end in zip(cuts, cuts[1:]) if end > start])

    def _cache_for(self, tokens: Sequence[int]) -> OwnCache:
        """A batch-1 cache holding ``tokens`` (do not mutate it), kept for the next calls that share it.

        Always built in one fresh forward of ``tokens``, never by extending another call's cache, so that
        every row is a function of the call alone (not of which calls came before): a pool of replicas
        (:class:`~speculum.distributed.ray_pool.RayPool`) then returns bitwise what this model returns."""
        tokens = tuple(tokens)
        cache = self._shared_caches.pop(tokens, None)
        if cache is None:
            cache = self.new_cache()
            if tokens:
                self.forward(torch.tensor([tokens]), cache, keep=1)
        self._shared_caches[tokens] = cache                     # most recently used last
        while len(self._shared_caches) > _SHARED_CACHES:
            del self._shared_caches[next(iter(self._shared_caches))]
        return cache

    def _chunk_rows(self, kv_length: int, logit_positions: int) -> int:
        """How many batch rows fit the KV and logits budgets."""
        by_kv = KV_BUDGET_BYTES // max(1, kv_length * self._kv_bytes_per_token)
        by_logits = LOGITS_BUDGET_BYTES // (logit_positions * self.vocab_size * 8)
        return max(1, min(by_kv, by_logits))

    def _level_step(self, level: OwnCache, parents: list[int], tokens: list[int]) -> tuple[OwnCache, torch.Tensor]:
        """``(cache, logits)``: the rows ``parents`` of ``level`` (left untouched) each extended by its token in
        one forward, and the ``(nodes, vocab)`` logits after each."""
        cache = level.rows(torch.tensor(parents, dtype=torch.long))
        return cache, self.forward(torch.tensor([[t] for t in tokens]), cache, keep=1)[:, 0, :]

    def _walk_prefixes(self, contexts: list[list[int]], emit: Any) -> None:
        """``emit(rows, logits)`` with the raw logits after every context (rows: indices into ``contexts``):
        the common prefix from one kept cache (:meth:`_cache_for`), the rest by a prefix tree
        (:func:`~speculum.models.hf.forward.prefix_levels.trie_forward`) in chunks that bound memory."""
        if not contexts:
            return
        # Keep at least one token per prefix outside the shared part: it is the input whose logits we need.
        shared_len = min(common_prefix_length(*contexts), min(len(c) for c in contexts) - 1)
        root = self._cache_for(contexts[0][:shared_len])
        suffixes = [tuple(c[shared_len:]) for c in contexts]
        order = sorted(range(len(suffixes)), key=lambda i: suffixes[i])  # siblings adjacent: chunks share parents
        chunk = self._chunk_rows(shared_len + max(len(s) for s in suffixes), 1)
        for lo in range(0, len(order), chunk):
            rows = order[lo: lo + chunk]
            trie_forward(self._level_step, root, [suffixes[i] for i in rows], rows, emit)


def _first_id(*candidates: Any) -> int | None:
    for value in candidates:
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return None


def _kv_geometry(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim): the KV store's shape and the memory budgets; conservative guesses when
    the config is unusual (the store is filled by the fused forward only, whose configs give all three)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = int(getattr(text, "num_hidden_layers", 32))
    heads = int(getattr(text, "num_attention_heads", 32))
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or getattr(text, "hidden_size", 4096) // heads)
    return layers, kv_heads, head_dim

