"""Draft models for speculative enumeration: any protocol model can be the draft.

``make_enumeration_draft`` turns a CLI-style spec into a draft *model* (enumeration needs a distribution,
never a proposer of fixed tokens): ``ngram`` fits an interpolated n-gram to continuations sampled from
the target (batched, one target call per depth), ``int8`` / ``bf16`` / ``layers:K`` / a path build the
twins of :func:`speculum.models.select.make_draft`, ``llamacpp`` (or ``llamacpp:FILE.gguf``) loads the
embedded GGUF (or that file) on the llama.cpp backend — for the embedded default the same Q4_1 weights
the float32 PyTorch target is dequantised from, so the two differ only by llama.cpp's 8-bit activations
(measured: <= ~0.4 nats per likely token, the closest draft we have) — and ``none`` means "enumerate the
target exactly".

Example:
    >>> draft = make_enumeration_draft("ngram", target, prompt=prompt_ids, length=3)   # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["make_enumeration_draft", "sample_continuations", "ENUMERATION_DRAFTS",
           "NGRAM_ORDER", "NGRAM_SAMPLES"]

ENUMERATION_DRAFTS = ("none", "ngram", "llamacpp", "llamacpp:GGUF", "int8", "bf16", "layers:K", "PATH")
NGRAM_ORDER = 3  # trigram: the context is the last two tokens (prompt included)
NGRAM_SAMPLES = 64  # target continuations the n-gram draft is fitted on


def sample_continuations(model: Any, prompt: Sequence[int], *, length: int, n: int,
                         rng: np.random.Generator, eos: int | None = None) -> list[list[int]]:
    """``n`` ancestral samples of up to ``length`` tokens after ``prompt`` (stopping at ``eos``).

    One batched ``next_logprobs`` call per depth over the still-running samples. Exact samples.
    """
    if length < 1 or n < 1:
        raise ValueError(f"length and n must be >= 1, got length={length}, n={n}")
    prompt = [int(t) for t in prompt]
    samples: list[list[int]] = [[] for _ in range(n)]
    running = list(range(n))
    for _ in range(length):
        if not running:
            break
        rows = np.asarray(model.next_logprobs([prompt + samples[i] for i in running]))  # (running, vocab)
        probs = np.exp(rows - rows.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        still = []
        for row, i in zip(probs, running):
            token = int(rng.choice(len(row), p=row))
            samples[i].append(token)
            if token != eos:
                still.append(i)
        running = still
    return samples


def make_enumeration_draft(spec: str, target: Any, *, prompt: Sequence[int], length: int,
                           eos: int | None = None, n_samples: int = NGRAM_SAMPLES, seed: int = 0) -> Any:
    """The draft model named by ``spec`` for enumerating ``target``'s continuations; None for ``none``.

    ``ngram`` costs ``length`` batched target calls (the samples); the twins cost no target call.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"draft must be one of {', '.join(ENUMERATION_DRAFTS)}, got {spec!r}")
    kind = spec.strip().lower()
    if kind == "none":
        return None
    if kind == "ngram":
        from ..models.ngram import NGramModel

        rng = np.random.default_rng(seed)
        samples = sample_continuations(target, prompt, length=length, n=n_samples, rng=rng, eos=eos)
        return NGramModel.fit([list(prompt) + s for s in samples], NGRAM_ORDER, target.vocab_size,
                              eos_token_id=getattr(target, "eos_token_id", None))
    if kind == "llamacpp" or kind.startswith("llamacpp:"):
        from ..models.default import DEFAULT_MODEL
        from ..models.llamacpp import load_llamacpp_model

        source = spec.strip()[len("llamacpp:"):] if kind.startswith("llamacpp:") else DEFAULT_MODEL
        # draft_for: the GGUF must share the target's tokenizer (ValueError otherwise).
        return load_llamacpp_model(source, draft_for=target)
    from ..models.select import make_draft

    if kind in ("lookup",):
        raise ValueError("draft 'lookup' proposes fixed tokens; enumeration needs a draft model "
                         f"({', '.join(ENUMERATION_DRAFTS)})")
    return make_draft(spec.strip(), target)
