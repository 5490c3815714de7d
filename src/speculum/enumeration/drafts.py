"""Draft models for speculative enumeration: any protocol model can be the draft.

``make_enumeration_draft`` turns a CLI-style spec into a draft *model* (enumeration needs a distribution,
never a proposer of fixed tokens), through the one draft registry (:mod:`speculum.models.select`):
``ngram`` fits an interpolated n-gram to continuations sampled from the target (batched, one target call
per depth), ``int8`` / ``bf16`` / ``layers:K`` / a path build the target's twins or another model,
``llamacpp`` (or ``llamacpp:FILE.gguf``) loads the embedded GGUF (or that file) on the llama.cpp backend —
for the embedded default the same weights the PyTorch target is de-quantised from, so the two differ only
by llama.cpp's arithmetic, which makes it the closest draft — and ``none`` means "enumerate the target
exactly".

Example:
    >>> draft = make_enumeration_draft("ngram", target, prompt=prompt_ids, length=3)   # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..models.select import ENUMERATION, DraftRequest, build_draft, draft_kinds
from ..validation import check_int

__all__ = ["make_enumeration_draft", "sample_continuations", "ENUMERATION_DRAFTS",
           "NGRAM_ORDER", "NGRAM_SAMPLES"]

ENUMERATION_DRAFTS = tuple(draft_kinds(ENUMERATION))
NGRAM_ORDER = 3  # trigram: the context is the last two tokens (prompt included)
NGRAM_SAMPLES = 64  # target continuations the n-gram draft is fitted on


def sample_continuations(model: Any, prompt: Sequence[int], *, length: int, n: int,
                         rng: np.random.Generator, eos: int | None = None) -> list[list[int]]:
    """``n`` ancestral samples of up to ``length`` tokens after ``prompt`` (stopping at ``eos``).

    One batched ``next_logprobs`` call per depth over the still-running samples. Exact samples.
    """
    length = check_int(length, "length", minimum=1)
    n = check_int(n, "n", minimum=1)
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
    """The draft model named by ``spec`` (one of :data:`ENUMERATION_DRAFTS`) for enumerating ``target``'s
    continuations; None for ``none``. ``ValueError`` / ``FileNotFoundError`` for a spec that names no
    enumeration draft, checked before anything loads.

    ``ngram`` costs ``length`` batched target calls (the samples); the twins cost no target call.
    """
    request = DraftRequest(prompt=tuple(prompt), length=length, eos=eos, n_samples=n_samples, seed=seed)
    return build_draft(spec, target, purpose=ENUMERATION, request=request)
