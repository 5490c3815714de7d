"""The n-gram drafts' order, and the n-gram draft for enumeration: fitted to continuations sampled from the target.

Enumeration needs a draft with a distribution, never a proposer of fixed tokens. :func:`fit_ngram_draft`
samples ``n_samples`` continuations of the prompt from the target (exact ancestral samples, one batched
target call per depth) and fits an interpolated :class:`~speculum.models.reference.ngram.NGramModel` of order
:data:`NGRAM_ORDER` to them; the decoding n-gram proposer (:class:`~speculum.drafts.proposers.NGramProposer`)
learns online with the same order.

Example:
    >>> from speculum.models import MarkovModel
    >>> target = MarkovModel.random(5, seed=0)
    >>> draft = fit_ngram_draft(target, [1, 2], length=3, n_samples=8)
    >>> draft.n, draft.vocab_size
    (3, 5)
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..models.reference.ngram import NGramModel
from ..validation import check_int

__all__ = ["NGRAM_ORDER", "NGRAM_SAMPLES", "sample_continuations", "fit_ngram_draft"]

NGRAM_ORDER = 3  # trigram: the context is the last two tokens (prompt included)
NGRAM_SAMPLES = 64  # target continuations the enumeration n-gram draft is fitted on


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


def fit_ngram_draft(target: Any, prompt: Sequence[int], *, length: int, eos: int | None = None,
                    n_samples: int = NGRAM_SAMPLES, seed: int = 0) -> NGramModel:
    """An order-:data:`NGRAM_ORDER` n-gram model fitted to the prompt followed by each of ``n_samples``
    samples of up to ``length`` target tokens (seeded by ``seed``; samples stop at ``eos``).

    Costs ``length`` batched target calls. The model's eos is the target's, so it ends sequences where the
    target can.
    """
    rng = np.random.default_rng(seed)
    samples = sample_continuations(target, prompt, length=length, n=n_samples, rng=rng, eos=eos)
    return NGramModel.fit([list(prompt) + sample for sample in samples], NGRAM_ORDER, target.vocab_size,
                          eos_token_id=getattr(target, "eos_token_id", None))
