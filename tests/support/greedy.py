"""The reference greedy decoding of the decoding tests."""
from __future__ import annotations

import numpy as np

__all__ = ["plain_greedy"]


def plain_greedy(model, prompt, n, eos=None):
    """Reference greedy decoding, recomputing every row from scratch (no sessions)."""
    context, out = list(prompt), []
    for _ in range(n):
        token = int(np.argmax(model.next_logprobs([context])[0]))
        out.append(token)
        context.append(token)
        if token == eos:
            break
    return out
