"""llama.cpp backend: any GGUF file through ``llama-cpp-python``, as a protocol model.

Why: on CPUs small LLMs run with llama.cpp, not PyTorch. SmolLM2-135M-Instruct (Q4_1) decodes several
times faster here than in PyTorch float32 (``benchmarks/decoding_llamacpp.py``), and speculum's exact
verification runs on top of it.

How the one llama context is shared
-----------------------------------
A llama context holds one KV-cache sequence (sequence id 0). The model remembers which tokens are
resident in it (``_resident``). Every evaluation first truncates the cache to the longest common prefix
of the resident tokens and the requested sequence (``llama_memory_seq_rm``), then evaluates only the rest
in one ``llama_decode`` per ``n_batch`` tokens, asking for logits only at the positions it returns.
Consequences:

* ``Session.rollback`` truncates the KV cache; the kept tokens are never evaluated again;
* several sessions may be alive at once: the session that evaluates takes the context over and
  re-evaluates only where its tokens differ from the previous owner's (cost: the divergent suffix). A
  session and its draft should therefore live on *different* models (two GGUF loads), not one;
* ``next_logprobs(prefixes)`` visits the prefixes in sorted order, so consecutive prefixes share the
  evaluation of their common prefix (a shared prompt is evaluated once, siblings cost one token each).

Batch shapes and greedy exactness: llama.cpp's CPU kernels do not always compute a token's logits
bit-identically when it is decoded alone (plain decoding) and when it is decoded with others
(verification, prefill), so two near-tied logits can swap order between the two. Flash attention (used
here) keeps them closest: bit-identical on short contexts, a small difference on long ones, and no greedy
token changed in the tests, which other settings did not achieve. Greedy speculative decoding therefore
reproduces plain greedy decoding except at a near-exact tie of the top two tokens.

Log-probs: llama.cpp returns float32 logits; rows are returned as float64 log-probs normalised over the
vocabulary. Against the PyTorch backend on the same (dequantised) weights they differ by llama.cpp's 8-bit
activation quantisation (``tests/models/test_llamacpp.py`` bounds it: under 0.6 nats on tokens with p > 1e-3,
total variation under 0.11 per row).

Example:
    >>> from speculum.models.llamacpp import load_llamacpp_model
    >>> model = load_llamacpp_model("smollm2-135m")            # doctest: +SKIP
    >>> session = model.start(model.tokenizer.encode("The sky is"))   # doctest: +SKIP
    >>> rows = session.extend([1, 2]); session.rollback(2)      # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import weakref
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ...validation import InputError, check_int, check_optional_int
from ..base import BaseModel, Capabilities, check_prompt, check_token_ids, common_prefix_length
from ..cpu import usable_cpus
from ..paths import DEFAULT_MODEL, EMBEDDED_MODELS, embedded_gguf_path
from .build_check import check_native_build
from .tokenizer import LlamaCppTokenizer

__all__ = [
    "LlamaCppModel",
    "LlamaCppSession",
    "load_llamacpp_model",
    "check_same_vocabulary",
    "INSTALL_HINT",
]

INSTALL_HINT = "llama-cpp-python is not installed: pip install 'speculum[llamacpp]'"
DEFAULT_N_CTX = 2048
DEFAULT_N_BATCH = 512


def _import_llama_cpp():
    """Import ``llama_cpp`` or raise the one-line ``ImportError`` the CLI shows (exit code 2)."""
    try:
        import llama_cpp  # the optional [llamacpp] extra, loaded with the first model
    except (ImportError, OSError) as exc:  # OSError: the shared library is present but cannot load
        raise ImportError(INSTALL_HINT) from exc
    return llama_cpp


def _logits_to_logprobs(logits: np.ndarray) -> np.ndarray:
    """``(n, vocab)`` float32 logits -> float64 log-probs (the normaliser is summed in float64).

    ``max`` propagates NaN and +inf, so checking the row maxima validates every entry.
    The float32 ``exp`` pass is ~5x cheaper than a float64 one; the result is within 1e-8 of it."""
    top = logits.max(axis=1, keepdims=True)  # (n, 1)
    if not np.isfinite(top).all():
        raise InputError("llama.cpp returned logits with NaN, +inf, or a row with no finite entry")
    scaled = np.subtract(logits, top)  # (n, vocab) float32, a fresh buffer reused for exp
    np.exp(scaled, out=scaled)
    log_normaliser = top.astype(np.float64) + np.log(scaled.sum(axis=1, keepdims=True, dtype=np.float64))
    return np.subtract(logits, log_normaliser, dtype=np.float64)


class LlamaCppSession:
    """Incremental decoding state over one token sequence on a :class:`LlamaCppModel`.

    Exact: every row is llama.cpp's next-token distribution after the session's tokens. ``rollback`` is
    a KV-cache truncation. Rows from the latest ``extend`` (and the row just before it) are kept, so
    ``next_logprobs`` after a rollback within that span costs nothing; a deeper rollback re-evaluates
    one token when ``next_logprobs`` is next asked for. Returned arrays are shared: do not modify them.
    """

    def __init__(self, model: "LlamaCppModel", prompt: Sequence[int]) -> None:
        self.model = model
        self.tokens: list[int] = check_prompt(model, prompt, name="prompt")
        # Known rows: _rows[i] follows tokens[: _rows_start + i + 1]; _anchor_row follows tokens[:_rows_start].
        self._rows = model._logprobs(self.tokens, 1)  # (1, vocab)
        self._rows_start = len(self.tokens) - 1
        self._anchor_row: np.ndarray | None = None

    @property
    def length(self) -> int:
        return len(self.tokens)

    def _known_row(self) -> np.ndarray | None:
        """The row after the current tokens if it was computed and not invalidated, else ``None``."""
        index = len(self.tokens) - 1 - self._rows_start
        if 0 <= index < len(self._rows):
            return self._rows[index]
        return self._anchor_row if index == -1 else None

    def next_logprobs(self) -> np.ndarray:
        """``(vocab,)`` exact log p(next | current tokens)."""
        if not self.tokens:
            raise InputError("the session is empty (rolled back to length 0): extend it first")
        row = self._known_row()
        if row is not None:
            return row
        self._rows = self.model._logprobs(self.tokens, 1)
        self._rows_start, self._anchor_row = len(self.tokens) - 1, None
        return self._rows[0]

    def extend(self, tokens: Sequence[int]) -> np.ndarray:
        """Consume ``tokens`` in one llama.cpp batch; returns ``(len(tokens), vocab)`` exact log-probs.

        Row j is log p(next | session tokens + tokens[: j + 1])."""
        new = check_token_ids(tokens, self.model.vocab_size, name="tokens")
        if not new:
            return np.zeros((0, self.model.vocab_size))
        anchor = self._known_row()  # kept so that rolling all of ``new`` back stays free
        rows = self.model._logprobs(self.tokens + new, len(new))  # (len(new), vocab)
        self._anchor_row, self._rows_start, self._rows = anchor, len(self.tokens), rows
        self.tokens.extend(new)
        return rows

    def advance(self, tokens: Sequence[int]) -> np.ndarray:
        """Consume ``tokens`` like ``extend``; ``(vocab,)`` exact log-probs after the LAST one only (llama.cpp
        then computes logits at one position: a draft catching up on accepted tokens needs no more)."""
        new = check_token_ids(tokens, self.model.vocab_size, name="tokens")
        if not new:
            return self.next_logprobs()
        rows = self.model._logprobs(self.tokens + new, 1)  # (1, vocab)
        self.tokens.extend(new)
        self._anchor_row, self._rows_start, self._rows = None, len(self.tokens) - 1, rows
        return rows[0]

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens by truncating the KV cache (no re-evaluation of kept tokens)."""
        if not isinstance(n, (int, np.integer)) or not 0 <= n <= len(self.tokens):
            raise InputError(f"n must be an int in [0, {len(self.tokens)}], got {n!r}")
        if n:
            self.model._release(self.tokens, len(self.tokens) - n)
            del self.tokens[-n:]


class LlamaCppModel(BaseModel):
    """A protocol model over any GGUF file, evaluated by llama.cpp (``llama-cpp-python``).

    Exact with respect to llama.cpp: every log-prob is llama.cpp's own distribution for the GGUF (its
    weights are quantised, so they differ from a float32 PyTorch model by quantisation error only).

    Args:
        model_path: a ``.gguf`` file.
        n_ctx: context length in tokens (``max_context``); sequences longer than it raise ``ValueError``.
        n_threads: CPU threads; default one per CPU this process may use (``usable_cpus``).
        n_batch: most tokens per ``llama_decode`` call (longer inputs are split).

    Only one sequence is resident in the llama context at a time; see the module docstring for how
    sessions share it. Not thread-safe. ``backend = "llamacpp"`` lets draft loaders pick the same backend.

    Example:
        >>> model = LlamaCppModel("SmolLM2-135M-Instruct.Q4_1.gguf", n_ctx=1024)   # doctest: +SKIP
        >>> model.next_logprobs([[1, 2], [1, 3]]).shape                              # doctest: +SKIP
        (2, 49152)
    """

    # One resident KV cache: sessions advanced in turn would re-evaluate each other's context.
    capabilities = Capabilities(session_advance=True, independent_sessions=False)

    backend = "llamacpp"

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        n_ctx: int = DEFAULT_N_CTX,
        n_threads: int | None = None,
        n_batch: int = DEFAULT_N_BATCH,
    ) -> None:
        llama_cpp = _import_llama_cpp()
        path = os.fspath(model_path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model_path: no GGUF file at {path!r}")
        n_ctx, n_batch = check_int(n_ctx, "n_ctx", minimum=1), check_int(n_batch, "n_batch", minimum=1)
        threads = check_optional_int(n_threads, "n_threads", minimum=1) or usable_cpus()
        n_batch = min(n_batch, n_ctx)
        # A crashing native build would kill the process with no message: probe it once (build_check).
        check_native_build(path, llama_cpp.llama_print_system_info().decode(errors="replace"))
        self._lib = llama_cpp
        self.model_path = path
        self.name = os.path.basename(path)
        # logits_all=False: we request logits per position ourselves through the batch's logits flags.
        # flash_attn=True: the setting under which batched verification agrees best with one-token plain
        # decoding (module docstring); no slower than the default here.
        self.llama = llama_cpp.Llama(
            model_path=path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
            n_threads_batch=threads, logits_all=False, flash_attn=True, verbose=False,
        )
        self.vocab_size = int(self.llama.n_vocab())
        self.max_context = int(self.llama.n_ctx())
        self.n_threads = threads
        self._n_batch = n_batch
        self._ctx = self.llama.ctx
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._vocab = llama_cpp.llama_model_get_vocab(self.llama.model)
        self.eos_token_id = self._special_id(self.llama.token_eos())
        self.bos_token_id = self._special_id(self.llama.token_bos())
        self.tokenizer = LlamaCppTokenizer(self.llama, eos_token_id=self.eos_token_id, bos_token_id=self.bos_token_id)
        self._resident: list[int] = []
        self._vocabulary_fingerprint: str | None = None
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        weakref.finalize(self, llama_cpp.llama_batch_free, self._batch)
        # Every position is in sequence 0 and belongs to one sequence: set once, never changes.
        for i in range(n_batch):
            self._batch.n_seq_id[i] = 1
            self._batch.seq_id[i][0] = 0

    def _special_id(self, token_id: int) -> int | None:
        return int(token_id) if 0 <= token_id < self.vocab_size else None

    def encode(self, text: str, *, chat: bool | None = None) -> list[int]:
        """Token ids of ``text``; ``chat`` (default: when the GGUF has a chat template) wraps it as a user
        turn followed by the generation prompt, as instruct models expect (same as ``HFModel.encode``)."""
        if chat is None:
            chat = self.tokenizer.chat_template is not None
        if chat:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return self.tokenizer.encode(text)

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` (special tokens skipped)."""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def token_bytes(self) -> list[bytes | None]:
        """``(vocab_size,)`` the bytes each token id adds to the decoded text, None for a token that adds
        none: llama.cpp's own piece of every token (:meth:`LlamaCppTokenizer.token_bytes`), exact."""
        return self.tokenizer.token_bytes()

    def __repr__(self) -> str:
        return f"LlamaCppModel({os.path.basename(self.model_path)!r}, n_ctx={self.max_context})"

    # ------------------------------------------------------------------------------- the llama context
    def _claim_context(self) -> None:
        """Forget our resident tokens if the wrapped ``Llama`` object evaluated on the context itself."""
        if self.llama.n_tokens:
            self._lib.llama_memory_clear(self._memory, True)
            self.llama.n_tokens = 0
            self._resident = []

    def _truncate(self, keep: int) -> int:
        """Drop resident tokens from position ``keep`` on; returns how many are really kept."""
        if keep < len(self._resident):
            if not self._lib.llama_memory_seq_rm(self._memory, 0, keep, -1):
                # Some memories (recurrent models) cannot be cut inside: start over, still exact.
                self._lib.llama_memory_clear(self._memory, True)
                keep = 0
            del self._resident[keep:]
        return len(self._resident)

    def _release(self, tokens: list[int], keep: int) -> None:
        """A session rolled back from ``tokens`` to ``tokens[:keep]``: truncate the cache if it owns it."""
        if self._resident[: len(tokens)] == tokens:
            self._truncate(keep)

    def _decode(self, tokens: list[int], first_position: int, first_output: int) -> np.ndarray | None:
        """One ``llama_decode``; returns a copy of the ``(len(tokens) - first_output, vocab)`` float32 logits."""
        n = len(tokens)
        batch = self._batch
        batch.n_tokens = n
        if n <= 16:  # decode steps and verification blocks: element writes beat building arrays
            for i, token in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.logits[i] = token, first_position + i, i >= first_output
        else:
            # The arrays are bound to names so that they outlive the copies out of their memory.
            token_ids = np.asarray(tokens, dtype=np.int32)
            positions = np.arange(first_position, first_position + n, dtype=np.int32)
            wants_logits = (np.arange(n) >= first_output).astype(np.int8)
            ctypes.memmove(batch.token, token_ids.ctypes.data, 4 * n)
            ctypes.memmove(batch.pos, positions.ctypes.data, 4 * n)
            ctypes.memmove(batch.logits, wants_logits.ctypes.data, n)
        status = self._lib.llama_decode(self._ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")
        n_outputs = n - max(first_output, 0)
        if n_outputs <= 0:
            return None
        address = ctypes.cast(self._lib.llama_get_logits(self._ctx), ctypes.c_void_p).value
        buffer = (ctypes.c_float * (n_outputs * self.vocab_size)).from_address(address)
        # Copied: llama.cpp reuses the buffer at the next decode.
        return np.frombuffer(buffer, dtype=np.float32).reshape(n_outputs, self.vocab_size).copy()

    def _logits(self, tokens: list[int], n_rows: int) -> np.ndarray:
        """``(n_rows, vocab)`` float32 logits after each of the last ``n_rows`` prefixes of ``tokens``.

        The resident prefix shared with ``tokens`` is reused (only the rest is evaluated); afterwards
        ``tokens`` is resident."""
        total = len(tokens)
        if total > self.max_context:
            raise InputError(f"sequence of {total} tokens exceeds the context length n_ctx={self.max_context}")
        if not 1 <= n_rows <= total:
            raise InputError(f"n_rows must be in [1, {total}], got {n_rows}")
        self._claim_context()
        first_output = total - n_rows
        position = self._truncate(min(common_prefix_length(self._resident, tokens), first_output))
        parts = []
        try:
            while position < total:
                end = min(position + self._n_batch, total)
                chunk = tokens[position:end]
                logits = self._decode(chunk, position, first_output - position)
                self._resident.extend(chunk)
                if logits is not None:
                    parts.append(logits)
                position = end
        except BaseException:
            # A failed or interrupted decode leaves the cache in an unknown state: start clean next time.
            self._lib.llama_memory_clear(self._memory, True)
            self._resident = []
            raise
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _logprobs(self, tokens: list[int], n_rows: int) -> np.ndarray:
        return _logits_to_logprobs(self._logits(tokens, n_rows))

    # -------------------------------------------------------------------------------------- protocol
    def start(self, prompt: Sequence[int]) -> LlamaCppSession:
        """Evaluate ``prompt`` (an empty one becomes ``[bos]``) and return a session after it. Exact."""
        return LlamaCppSession(self, prompt)

    def next_logprobs(self, prefixes: Sequence[Sequence[int]]) -> np.ndarray:
        """``(batch, vocab)`` exact log p(next | prefix) for each prefix.

        Prefixes are evaluated in sorted order, each reusing the KV cache of its common prefix with the
        previous one: a prompt shared by all of them is evaluated once, and each continuation costs its
        own suffix only."""
        prefix_ids = [check_prompt(self, prefix, name="prefixes") for prefix in prefixes]
        out = np.empty((len(prefix_ids), self.vocab_size))
        for b in sorted(range(len(prefix_ids)), key=lambda b: prefix_ids[b]):
            out[b] = self._logprobs(prefix_ids[b], 1)[0]
        return out

    def score_sequences(self, sequences: Sequence[Sequence[int]], prompt: Sequence[int] = ()) -> np.ndarray:
        """``(batch,)`` exact total log p(sequence | prompt) by teacher forcing, one batch per sequence.

        The prompt (an empty one becomes ``[bos]``) is evaluated once; each sequence then costs one
        ``llama_decode`` over the prompt's last token and the sequence."""
        prompt_ids = check_prompt(self, prompt, name="prompt")
        out = np.zeros(len(sequences))
        for b, sequence in enumerate(sequences):
            seq = check_token_ids(sequence, self.vocab_size, name="sequences")
            if not seq:
                continue
            logits = self._logits(prompt_ids + seq[:-1], len(seq))  # (len(seq), vocab) float32
            top = logits.max(axis=1)
            log_normaliser = top + np.log(np.exp(logits - top[:, None]).sum(axis=1, dtype=np.float64))
            out[b] = float((logits[np.arange(len(seq)), seq] - log_normaliser).sum())
        return out

    # ----------------------------------------------------------------------------------- vocabulary
    @property
    def vocabulary_fingerprint(self) -> str:
        """SHA-256 over every token's text and the special ids: equal fingerprints = same tokenizer."""
        if self._vocabulary_fingerprint is None:
            digest = hashlib.sha256(f"{self.vocab_size}|{self.bos_token_id}|{self.eos_token_id}".encode())
            for token_id in range(self.vocab_size):
                digest.update(self._lib.llama_vocab_get_text(self._vocab, token_id) or b"")
                digest.update(b"\x00")
            self._vocabulary_fingerprint = digest.hexdigest()
        return self._vocabulary_fingerprint


def check_same_vocabulary(target: Any, draft: Any) -> None:
    """Raise ``InputError`` (a ``ValueError``) unless ``draft`` can draft for ``target``: the same token
    ids must mean the same strings, or the draft's proposals would be verified as other tokens."""
    if target.vocab_size != draft.vocab_size:
        raise InputError(
            f"draft vocabulary ({draft.vocab_size} tokens) differs from the target's ({target.vocab_size}): "
            "a draft must share the target's tokenizer"
        )
    target_print = getattr(target, "vocabulary_fingerprint", None)
    draft_print = getattr(draft, "vocabulary_fingerprint", None)
    if target_print is not None and draft_print is not None and target_print != draft_print:
        raise InputError(
            "draft and target tokenizers differ (same size, different tokens): a draft must share the "
            "target's tokenizer"
        )


def load_llamacpp_model(
    name_or_path: str | os.PathLike = DEFAULT_MODEL,
    *,
    n_ctx: int = DEFAULT_N_CTX,
    n_threads: int | None = None,
    n_batch: int = DEFAULT_N_BATCH,
    draft_for: Any = None,
) -> LlamaCppModel:
    """Load a GGUF file (or ``"smollm2-135m"``, the embedded default) on the llama.cpp backend.

    Args:
        name_or_path: ``"smollm2-135m"`` or a path to a ``.gguf`` file.
        draft_for: a target model; the loaded model must share its tokenizer (else ``ValueError``).

    Raises ``ImportError`` (one line, with the install command) without ``llama-cpp-python``.

    Example:
        >>> target = load_llamacpp_model("smollm2-135m")                                  # doctest: +SKIP
        >>> draft = load_llamacpp_model("smollm2-135m", n_ctx=1024, draft_for=target)     # doctest: +SKIP
    """
    _import_llama_cpp()
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        try:  # an embedded model's name, e.g. "smollm2-135m": its GGUF file is used as is
            path = embedded_gguf_path(str(name_or_path))
        except ValueError:
            raise FileNotFoundError(
                f"no GGUF file at {str(name_or_path)!r} and no embedded model by that name "
                f"(known: {', '.join(EMBEDDED_MODELS)})"
            ) from None
    model = LlamaCppModel(path, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch)
    if draft_for is not None:
        check_same_vocabulary(draft_for, model)
    return model
