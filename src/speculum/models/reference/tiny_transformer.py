"""A small causal transformer in NumPy float64 with random weights: an exact reference with a KV cache.

It is a real pre-LN decoder (GPT-2 layout: token + learned position embeddings, multi-head causal
self-attention, GELU MLP, layer norm), so it exercises everything a Hugging Face backend does — a
per-layer KV cache, one-pass multi-token ``extend``, cheap ``rollback`` by truncation, batched
teacher forcing — while staying exact and fast enough for brute-force tests.

Example:
    >>> model = TinyTransformer(vocab_size=16, seed=0)
    >>> session = model.start([1, 2, 3])
    >>> rows = session.extend([4, 5])                   # (2, 16), one forward over both tokens
    >>> session.rollback(2); session.length
    3
    >>> draft = model.perturbed(0.3, seed=1)            # a correlated draft model
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ...validation import InputError, check_int, check_number
from ..base import BaseModel, Capabilities, Feed, check_prompt, check_session_blocks, check_token_ids, log_softmax

__all__ = ["TinyTransformer", "TransformerWeights", "LayerWeights", "TransformerSession"]

# Logit scale: the head's raw logits are ~N(0, 1); multiplying by c * sqrt(2 ln V) makes the top token
# carry ~0.3-0.6 of the mass at any vocabulary size (the max of V Gaussians grows like sqrt(2 ln V)).
DEFAULT_LOGIT_SCALE_PER_SQRT_2LNV = 1.0
LAYER_NORM_EPS = 1e-5


@dataclass(frozen=True)
class LayerWeights:
    """One pre-LN block. Shapes use d = d_model, m = d_mlp."""

    ln1_gain: np.ndarray  # (d,)
    ln1_bias: np.ndarray  # (d,)
    w_query: np.ndarray  # (d, d), heads are contiguous column blocks of size d // n_heads
    w_key: np.ndarray  # (d, d)
    w_value: np.ndarray  # (d, d)
    w_attn_out: np.ndarray  # (d, d)
    ln2_gain: np.ndarray  # (d,)
    ln2_bias: np.ndarray  # (d,)
    w_mlp_in: np.ndarray  # (d, m)
    b_mlp_in: np.ndarray  # (m,)
    w_mlp_out: np.ndarray  # (m, d)
    b_mlp_out: np.ndarray  # (d,)


@dataclass(frozen=True)
class TransformerWeights:
    """All parameters; ``head`` is ``token_embedding.T`` when the embeddings are tied."""

    token_embedding: np.ndarray  # (V, d)
    position_embedding: np.ndarray  # (max_len, d)
    layers: tuple[LayerWeights, ...]
    lnf_gain: np.ndarray  # (d,)
    lnf_bias: np.ndarray  # (d,)
    head: np.ndarray  # (d, V)

    def map(self, fn: Callable[[str, np.ndarray], np.ndarray]) -> "TransformerWeights":
        """A copy with ``fn(name, array)`` applied to every array (in a fixed order: reproducible noise)."""
        def apply(obj):
            return dataclasses.replace(obj, **{
                f.name: fn(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name != "layers"
            })
        top = apply(self)
        return dataclasses.replace(top, layers=tuple(apply(layer) for layer in self.layers))


def _layer_norm(x: np.ndarray, gain: np.ndarray, bias: np.ndarray) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + LAYER_NORM_EPS) * gain + bias


def _gelu(x: np.ndarray) -> np.ndarray:
    # tanh approximation (GPT-2's); any fixed nonlinearity would do, exactness only needs determinism.
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x * x * x)))


class TinyTransformer(BaseModel):
    """Causal pre-LN transformer with seeded random weights; every log-prob is exact float64.

    Args:
        vocab_size: number of token ids.
        d_model: residual width (divisible by ``n_heads``).
        n_layers: number of blocks (0 gives an embedding → head bigram-like model).
        seed: seed of the weight initialisation (an int or a ``numpy.random.Generator``).
        n_heads: attention heads.
        d_mlp: MLP width, default ``4 * d_model``.
        max_len: longest sequence (learned positions); longer prompts / extensions raise ``ValueError``.
        logit_scale: multiplies the final logits; default ``sqrt(2 ln V)`` so the top token typically
            has probability ~0.3-0.6 (a peaked but not degenerate distribution).
        tie_embeddings: use ``token_embedding.T`` as the output head.
        bos_token_id / eos_token_id: optional special ids; with a BOS an empty prompt means ``[bos]``.

    Example:
        >>> model = TinyTransformer(8, d_model=16, n_layers=1, seed=3)
        >>> model.next_logprobs([[1], [1, 2]]).shape
        (2, 8)
    """

    # Several sessions' blocks in one forward (``extend_sessions``): the decoding scheduler verifies them so.
    capabilities = Capabilities(batched_extend=True)

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 32,
        n_layers: int = 2,
        seed: int | np.random.Generator = 0,
        *,
        n_heads: int = 2,
        d_mlp: int | None = None,
        max_len: int = 256,
        logit_scale: float | None = None,
        tie_embeddings: bool = False,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        self.vocab_size = check_int(vocab_size, "vocab_size", minimum=1)
        d_model, n_heads = check_int(d_model, "d_model", minimum=1), check_int(n_heads, "n_heads", minimum=1)
        if d_model % n_heads:
            raise InputError(f"d_model ({d_model}) must be a positive multiple of n_heads ({n_heads})")
        n_layers = check_int(n_layers, "n_layers", minimum=0)
        self.max_len = self.max_context = check_int(max_len, "max_len", minimum=1)
        d_mlp = 4 * d_model if d_mlp is None else check_int(d_mlp, "d_mlp", minimum=1)
        self.d_model, self.n_heads, self.d_mlp = d_model, n_heads, d_mlp
        if logit_scale is None:
            logit_scale = DEFAULT_LOGIT_SCALE_PER_SQRT_2LNV * np.sqrt(2.0 * np.log(max(self.vocab_size, 2)))
        self.logit_scale = check_number(logit_scale, "logit_scale", minimum=0)
        for name, tok in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if tok is not None:
                check_token_ids([tok], self.vocab_size, name=name)
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.weights = self._init_weights(np.random.default_rng(seed), int(n_layers), tie_embeddings)

    @property
    def n_layers(self) -> int:
        return len(self.weights.layers)

    def _init_weights(self, rng: np.random.Generator, n_layers: int, tie: bool) -> TransformerWeights:
        d, m, V = self.d_model, self.d_mlp, self.vocab_size
        # Unit-variance embeddings and 1/sqrt(fan_in) matrices keep activations O(1); residual outputs are
        # scaled by 1/sqrt(2 n_layers) (GPT-2) so depth does not blow up the residual stream.
        resid = 1.0 / np.sqrt(2.0 * max(n_layers, 1))

        def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
            return rng.normal(scale=scale / np.sqrt(rows), size=(rows, cols))

        token_embedding = rng.normal(size=(V, d))
        position_embedding = rng.normal(scale=0.5, size=(self.max_len, d))
        layers = tuple(
            LayerWeights(
                ln1_gain=1.0 + 0.1 * rng.normal(size=d), ln1_bias=0.1 * rng.normal(size=d),
                w_query=mat(d, d), w_key=mat(d, d), w_value=mat(d, d), w_attn_out=mat(d, d, resid),
                ln2_gain=1.0 + 0.1 * rng.normal(size=d), ln2_bias=0.1 * rng.normal(size=d),
                w_mlp_in=mat(d, m), b_mlp_in=0.1 * rng.normal(size=m),
                w_mlp_out=mat(m, d, resid), b_mlp_out=0.1 * rng.normal(size=d),
            )
            for _ in range(n_layers)
        )
        head = token_embedding.T / np.sqrt(d) if tie else mat(d, V)
        return TransformerWeights(token_embedding, position_embedding, layers,
                                  lnf_gain=np.ones(d), lnf_bias=np.zeros(d), head=head)

    # ------------------------------------------------------------------------------------- variants
    def _with_weights(self, weights: TransformerWeights) -> "TinyTransformer":
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.weights = weights
        return clone

    def perturbed(self, noise: float, seed: int | np.random.Generator = 0) -> "TinyTransformer":
        """A copy whose every weight gets Gaussian noise of ``noise`` × that array's RMS: a correlated draft.

        ``noise=0`` gives identical outputs (exact); larger noise lowers the draft/target agreement.

        Example:
            >>> target = TinyTransformer(16, seed=0)
            >>> draft = target.perturbed(0.2, seed=1)
        """
        noise = check_number(noise, "noise", minimum=0)
        rng = np.random.default_rng(seed)

        def jitter(_name: str, array: np.ndarray) -> np.ndarray:
            rms = float(np.sqrt(np.mean(array**2))) if array.size else 0.0
            return array + noise * rms * rng.normal(size=array.shape)

        return self._with_weights(self.weights.map(jitter))

    def truncated(self, n_layers: int) -> "TinyTransformer":
        """The same model keeping only its first ``n_layers`` blocks (a layer-truncated self-draft)."""
        if not 0 <= n_layers <= self.n_layers:
            raise InputError(f"n_layers must be in [0, {self.n_layers}], got {n_layers}")
        return self._with_weights(dataclasses.replace(self.weights, layers=self.weights.layers[:n_layers]))

    # ------------------------------------------------------------------------------------- forward
    def _forward(self, tokens: np.ndarray, offset: int, keys: list[np.ndarray], values: list[np.ndarray]) -> np.ndarray:
        """Run ``tokens`` (batch, n) at positions ``offset..offset+n-1`` against the caches; return hidden.

        ``keys[l]`` / ``values[l]`` are (batch, heads, capacity, d_head) caches already holding positions
        ``< offset``; the new positions are written in place. Returns the final-LN hidden (batch, n, d).
        """
        return self._forward_ragged(tokens, np.full(len(tokens), offset, dtype=np.int64), keys, values)

    def _forward_ragged(self, tokens: np.ndarray, offsets: np.ndarray, keys: list[np.ndarray],
                        values: list[np.ndarray]) -> np.ndarray:
        """``_forward`` with a different offset per row: row b's tokens (batch, n; padding after its own
        count) sit at positions ``offsets[b]..``; query i of row b sees keys ``j <= offsets[b] + i``, so the
        padding never reaches a real position. Caches: (batch, heads, capacity, d_head), written in place."""
        w = self.weights
        batch, n = tokens.shape
        H, dh = self.n_heads, self.d_model // self.n_heads
        end = int(offsets.max()) + n
        positions = offsets[:, None] + np.arange(n)[None, :]                       # (batch, n)
        x = w.token_embedding[tokens] + w.position_embedding[np.minimum(positions, self.max_len - 1)]
        visible = np.arange(end)[None, None, :] <= positions[:, :, None]          # (batch, n, end)
        rows = np.arange(batch)[:, None]
        for layer, layer_keys, layer_values in zip(w.layers, keys, values):
            h = _layer_norm(x, layer.ln1_gain, layer.ln1_bias)

            def heads(proj: np.ndarray) -> np.ndarray:  # (batch, n, d) -> (batch, n, H, dh)
                return (h @ proj).reshape(batch, n, H, dh)

            layer_keys.transpose(0, 2, 1, 3)[rows, positions] = heads(layer.w_key)
            layer_values.transpose(0, 2, 1, 3)[rows, positions] = heads(layer.w_value)
            query = heads(layer.w_query).transpose(0, 2, 1, 3)
            scores = query @ layer_keys[:, :, :end].transpose(0, 1, 3, 2) / np.sqrt(dh)
            scores = np.where(visible[:, None], scores, -np.inf)                   # (batch, H, n, end)
            attn = np.exp(scores - scores.max(axis=-1, keepdims=True))
            attn /= attn.sum(axis=-1, keepdims=True)
            mixed = (attn @ layer_values[:, :, :end]).transpose(0, 2, 1, 3).reshape(batch, n, self.d_model)
            x = x + mixed @ layer.w_attn_out
            h = _layer_norm(x, layer.ln2_gain, layer.ln2_bias)
            x = x + _gelu(h @ layer.w_mlp_in + layer.b_mlp_in) @ layer.w_mlp_out + layer.b_mlp_out
        return _layer_norm(x, w.lnf_gain, w.lnf_bias)

    def _logprobs(self, hidden: np.ndarray) -> np.ndarray:
        """(..., d) final hidden -> (..., V) normalised log-probs."""
        return log_softmax(self.logit_scale * (hidden @ self.weights.head))

    def _empty_cache(self, batch: int, capacity: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        shape = (batch, self.n_heads, capacity, self.d_model // self.n_heads)
        return ([np.empty(shape) for _ in self.weights.layers], [np.empty(shape) for _ in self.weights.layers])

    def _full_hidden(self, batch_tokens: np.ndarray) -> np.ndarray:
        """(batch, T) equal-length sequences -> (batch, T, d) hidden, one fresh forward."""
        keys, values = self._empty_cache(*batch_tokens.shape)
        return self._forward(batch_tokens, 0, keys, values)

    def _check_length(self, length: int, name: str) -> None:
        if length > self.max_len:
            raise InputError(f"{name} would make the sequence {length} tokens long, over max_len={self.max_len}")

    # ------------------------------------------------------------------------------------- protocol
    def start(self, prompt: Sequence[int]) -> "TransformerSession":
        """A KV-cached session after ``prompt`` (``[]`` means ``[bos]``; without a BOS it is an error)."""
        return TransformerSession(self, prompt)

    def extend_sessions(self, feeds: Sequence[Feed] | Sequence["TransformerSession"],
                        token_lists: Sequence[Sequence[int]] | None = None,
                        prompt_limits: Sequence[int | None] | None = None) -> list[np.ndarray]:
        """Each feed's ``session.extend(tokens)`` for several of this model's sessions in one ragged forward
        (each session's own cache and positions; padding masked). Exact: each result equals that session's
        own ``extend`` to float64 rounding (the batched products may round the last bits differently).
        ``feeds``: :class:`~speculum.models.base.Feed` records, or the sessions with ``token_lists`` beside
        them (prompt limits have nothing to limit: no prompt is deferred).

        Example:
            >>> m = TinyTransformer(8, seed=0)
            >>> a, b = m.start([1]), m.start([2, 3])
            >>> [rows.shape for rows in m.extend_sessions([Feed(a, [4, 5]), Feed(b, [6])])]
            [(2, 8), (1, 8)]
        """
        feeds = check_session_blocks(self, TransformerSession, feeds, token_lists, prompt_limits)
        sessions, checked = [feed.session for feed in feeds], [feed.tokens for feed in feeds]
        for session, tokens in zip(sessions, checked):
            self._check_length(session.length + len(tokens), "tokens")
        out = [np.zeros((0, self.vocab_size)) for _ in sessions]
        live = [i for i, tokens in enumerate(checked) if tokens]
        if not live:
            return out
        n = max(len(checked[i]) for i in live)
        offsets = np.array([sessions[i].length for i in live], dtype=np.int64)
        tokens = np.zeros((len(live), n), dtype=np.int64)
        for b, i in enumerate(live):
            tokens[b, : len(checked[i])] = checked[i]
        capacity = int(offsets.max()) + n
        # Zeros, not empty: a row's masked positions get attention weight 0, and 0 x garbage can be NaN.
        shape = (len(live), self.n_heads, capacity, self.d_model // self.n_heads)
        keys = [np.zeros(shape) for _ in self.weights.layers]
        values = [np.zeros(shape) for _ in self.weights.layers]
        for b, i in enumerate(live):
            sessions[i].copy_cache_into(keys, values, b)
        hidden = self._forward_ragged(tokens, offsets, keys, values)                # (batch, n, d)
        for b, i in enumerate(live):
            count = len(checked[i])
            sessions[i].record_forward(checked[i], keys, values, b, hidden[b, :count])
            out[i] = self._logprobs(hidden[b, :count])
        return out

    def next_logprobs(self, prefixes: Sequence[Sequence[int]]) -> np.ndarray:
        """``(batch, vocab)`` exact next-token log-probs; equal-length prefixes share one batched forward.

        Example:
            >>> TinyTransformer(8, seed=0).next_logprobs([[1, 2], [3, 4], [5]]).shape
            (3, 8)
        """
        ids = [check_prompt(self, prefix, name="prefix") for prefix in prefixes]
        out = np.empty((len(ids), self.vocab_size))
        for length, members in _group_by_length(ids).items():
            self._check_length(length, "prefix")
            hidden = self._full_hidden(np.array([ids[b] for b in members], dtype=np.int64))
            out[members] = self._logprobs(hidden[:, -1])
        return out

    def score_sequences(self, sequences: Sequence[Sequence[int]], prompt: Sequence[int] = ()) -> np.ndarray:
        """``(batch,)`` exact log p(sequence | prompt) by batched teacher forcing (ragged lengths allowed).

        Sequences of equal length share one forward over ``prompt + sequence``; an empty sequence scores 0.

        Example:
            >>> m = TinyTransformer(8, seed=0)
            >>> m.score_sequences([[1, 2], [3]], prompt=[0]).shape
            (2,)
        """
        context = check_prompt(self, prompt, name="prompt")
        seqs = [check_token_ids(seq, self.vocab_size, name="sequence") for seq in sequences]
        out = np.zeros(len(seqs))
        for length, members in _group_by_length(seqs).items():
            if length == 0:
                continue
            self._check_length(len(context) + length, "prompt + sequence")
            batch = np.array([context + seqs[b] for b in members], dtype=np.int64)  # (B, P + L)
            # Rows P-1 .. P+L-2 predict the sequence tokens; only the gathered entries are needed.
            hidden = self._full_hidden(batch[:, :-1])[:, len(context) - 1:]  # (B, L, d)
            rows = self._logprobs(hidden)  # (B, L, V)
            targets = batch[:, len(context):]  # (B, L)
            out[members] = np.take_along_axis(rows, targets[..., None], axis=-1)[..., 0].sum(axis=1)
        return out


def _group_by_length(sequences: list[list[int]]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for b, seq in enumerate(sequences):
        groups.setdefault(len(seq), []).append(b)
    return groups


class TransformerSession:
    """Per-layer KV cache over one sequence: ``extend`` is one forward, ``rollback`` a truncation.

    The cache is preallocated to ``max_len`` positions, so rollback only moves ``length`` back (no
    recompute, no copy) and the next ``extend`` overwrites the forgotten positions. The final hidden
    state of every position is kept, so the row after any kept token is one head matmul away.
    """

    def __init__(self, model: TinyTransformer, prompt: Sequence[int]) -> None:
        self.model = model
        tokens = check_prompt(model, prompt, name="prompt")
        model._check_length(len(tokens), "prompt")
        self.tokens: list[int] = []
        self._keys, self._values = model._empty_cache(1, model.max_len)
        self._hidden = np.empty((model.max_len, model.d_model))  # (max_len, d) final-LN states
        self._run(tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def copy_cache_into(self, keys: list[np.ndarray], values: list[np.ndarray], row: int) -> None:
        """Copy this session's keys and values (its ``length`` positions) into row ``row`` of a batched
        forward's caches ``keys[layer]`` / ``values[layer]`` ``(batch, heads, capacity, d_head)``."""
        held = len(self.tokens)
        for layer_keys, layer_values, own_keys, own_values in zip(keys, values, self._keys, self._values):
            layer_keys[row, :, :held] = own_keys[0, :, :held]
            layer_values[row, :, :held] = own_values[0, :, :held]

    def record_forward(self, tokens: list[int], keys: list[np.ndarray], values: list[np.ndarray], row: int,
                       hidden: np.ndarray) -> None:
        """Take ``tokens`` as consumed by a batched forward that wrote their keys and values in row ``row``
        of ``keys[layer]`` / ``values[layer]`` ``(batch, heads, capacity, d_head)``, after this session's
        positions, and computed their final hidden states ``hidden (len(tokens), d)``."""
        start, end = len(self.tokens), len(self.tokens) + len(tokens)
        for layer_keys, layer_values, own_keys, own_values in zip(keys, values, self._keys, self._values):
            own_keys[0, :, start:end] = layer_keys[row, :, start:end]
            own_values[0, :, start:end] = layer_values[row, :, start:end]
        self._hidden[start:end] = hidden
        self.tokens.extend(tokens)

    def _run(self, tokens: list[int]) -> np.ndarray:
        start, end = len(self.tokens), len(self.tokens) + len(tokens)
        if tokens:
            batch = np.array([tokens], dtype=np.int64)
            self._hidden[start:end] = self.model._forward(batch, start, self._keys, self._values)[0]
            self.tokens.extend(tokens)
        return self._hidden[start:end]

    def next_logprobs(self) -> np.ndarray:
        """``(vocab,)`` exact log p(next | tokens)."""
        if not self.tokens:
            raise InputError("the session is empty: TinyTransformer needs at least one token of context")
        return self.model._logprobs(self._hidden[len(self.tokens) - 1])

    def extend(self, tokens: Sequence[int]) -> np.ndarray:
        """Consume ``tokens`` in one forward; returns ``(len(tokens), vocab)`` exact rows (row j after tokens[j])."""
        tokens = check_token_ids(tokens, self.model.vocab_size, name="tokens")
        self.model._check_length(len(self.tokens) + len(tokens), "tokens")
        return self.model._logprobs(self._run(tokens)) if tokens else np.zeros((0, self.model.vocab_size))

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens: O(1), the cache slots are simply reused."""
        if not 0 <= n <= len(self.tokens):
            raise InputError(f"rollback({n}) on a session of length {len(self.tokens)}")
        if n:
            del self.tokens[-n:]
