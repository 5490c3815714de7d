"""Brute-force references of the enumeration tests: every continuation of a model in rank order, and every
token sequence of a made-up vocabulary whose text matches a pattern (strings there have several
tokenizations: "7" "7" and "77", "x" "y" and "xy")."""
from __future__ import annotations

import itertools
import math
import re

import numpy as np

from speculum.models import MarkovModel

__all__ = ["EOS", "PROMPT", "VOCAB", "brute_force", "model", "ranked_support"]


def ranked_support(model, *, max_len=None, eos=None, prompt=()):
    """Every positive-probability continuation with its log-prob (the float sum of its steps, in order),
    likeliest first, ties in token order."""
    if eos is None:
        candidates = itertools.product(range(model.vocab_size), repeat=max_len)
    else:
        candidates = (body + (eos,) for n in range(max_len) for body in
                      itertools.product([t for t in range(model.vocab_size) if t != eos], repeat=n))
    out = []
    for seq in candidates:
        rows = model.next_logprobs([list(prompt) + list(seq[:j]) for j in range(len(seq))])
        total = 0.0
        for j, token in enumerate(seq):
            total += float(rows[j, token])
        if math.isfinite(total):
            out.append((tuple(seq), total))
    return sorted(out, key=lambda item: (-item[1], item[0]))


# ------------------------------------------------------------------- a vocabulary of several tokenizations
VOCAB = ["7", "8", "77", "x", "y", "xy", None]      # id 6 has no text: the eos
EOS = 6
PROMPT = [3]


def model(seed: int = 0, vocab_size: int = len(VOCAB)) -> MarkovModel:
    """A random Markov model over :data:`VOCAB` whose eos is :data:`EOS`."""
    return MarkovModel.random(vocab_size, seed=seed, eos_token_id=EOS)


def brute_force(m, pattern: str, *, eos: bool, max_tokens: int):
    """Every token sequence (eos appended in eos mode) of at most ``max_tokens`` tokens whose text fully
    matches ``pattern``, with its exact log-prob; and the strings with the sum over their tokenizations."""
    texts = [t for t in VOCAB if t is not None]
    body_len = max_tokens - (1 if eos else 0)
    items = []
    for n in range(1, body_len + 1):
        for body in itertools.product(range(len(texts)), repeat=n):
            text = "".join(VOCAB[t] for t in body)
            if re.fullmatch(pattern, text):
                items.append((body + ((EOS,) if eos else ()), text))
    scores = m.score_sequences([seq for seq, _ in items], prompt=PROMPT) if items else []
    tokens = sorted(((seq, float(lp)) for (seq, _), lp in zip(items, scores)), key=lambda it: (-it[1], it[0]))
    strings: dict[str, list[float]] = {}
    for (seq, text), lp in zip(items, scores):
        strings.setdefault(text, []).append(float(lp))
    string_items = sorted(((text, float(np.logaddexp.reduce(lps))) for text, lps in strings.items()),
                          key=lambda it: (-it[1], it[0].encode()))
    return tokens, string_items
