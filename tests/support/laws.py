"""The block-law harness of the distribution tests: a target whose output law is known exactly, and a
chi-square test of a generation against it.

A random Markov chain over S = 6 symbols is embedded in a chain over V = 1 + 3·S tokens — a reset token R,
then 3 symbol tokens tagged with their position, then R with probability 1. One long generation from prompt
[R] therefore yields i.i.d. blocks "x1 x2 x3 R" *if* its output law is the target's (blocks renew at R by
the Markov property), and the exact law of (x1, x2, x3) is a product of three warped target rows.

A chi-square test compares the block histogram with the exact law (cells with expected count < 5 pooled).
The sample size is computed so that ANY output law at total-variation distance 0.02 from the exact one is
detected with probability >= 0.9 at level 0.001: chi-square divergence >= (2·TV)² (Cauchy–Schwarz), so
the noncentrality is >= N·0.0016, and N solves P(ncx2(df, N·0.0016) > crit) = 0.9.
"""
from __future__ import annotations

import functools
import itertools

import numpy as np
from scipy import stats

from speculum.decoding import warp_logprobs
from speculum.models import MarkovModel

__all__ = ["DETECT_TV", "DRAFT", "LEVEL", "POWER", "RESET", "SYMBOLS", "TARGET", "block_chain",
           "block_law_pvalue", "exact_block_law", "random_symbol_logits", "required_blocks"]

SYMBOLS = 6
LEVEL = 0.001
DETECT_TV = 0.02
POWER = 0.9
RESET = 0


def token(position: int, symbol: int) -> int:
    """The token of ``symbol`` at ``position`` (0, 1 or 2) of a block."""
    return 1 + position * SYMBOLS + symbol


def block_chain(start_logits: np.ndarray, transition_logits: np.ndarray) -> MarkovModel:
    """Embed a symbol chain (start row (S,), transitions (S, S)) into the block-structured token chain."""
    vocab = 1 + 3 * SYMBOLS
    logits = np.full((vocab, vocab), -np.inf)
    for x in range(SYMBOLS):
        logits[RESET, token(0, x)] = start_logits[x]
        for a in range(SYMBOLS):
            logits[token(0, a), token(1, x)] = transition_logits[a, x]
            logits[token(1, a), token(2, x)] = transition_logits[a, x]
    for a in range(SYMBOLS):
        logits[token(2, a), RESET] = 0.0
    return MarkovModel(logits, np.zeros(vocab))


def random_symbol_logits(seed: int, scale: float = 1.5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(scale=scale, size=SYMBOLS), rng.normal(scale=scale, size=(SYMBOLS, SYMBOLS))


def exact_block_law(target: MarkovModel, temperature: float, top_k, top_p) -> np.ndarray:
    """(S, S, S) exact law of a block under plain sampling with the same warp."""
    def row(prev: int) -> np.ndarray:
        lp = target.transition_logprobs[prev]
        if temperature == 0:
            raise ValueError("exact law is for sampling")
        return np.exp(warp_logprobs(lp, temperature=temperature, top_k=top_k, top_p=top_p))
    law = np.zeros((SYMBOLS,) * 3)
    first = row(RESET)
    for a, b, c in itertools.product(range(SYMBOLS), repeat=3):
        law[a, b, c] = first[token(0, a)] * row(token(0, a))[token(1, b)] * row(token(1, b))[token(2, c)]
    return law


@functools.lru_cache(maxsize=None)
def required_blocks(df: int) -> int:
    """Blocks N such that every law at TV >= DETECT_TV is rejected with probability >= POWER."""
    critical = stats.chi2.ppf(1 - LEVEL, df)
    lo, hi = 1.0, 10_000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if stats.ncx2.sf(critical, df, mid) < POWER else (lo, mid)
    return int(np.ceil(hi / (2 * DETECT_TV) ** 2))


def pooled_cells(law: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat cell indices of the tested cells and the pooled rest (expected count < 5 merged)."""
    flat = law.ravel()
    big = np.flatnonzero(flat * n >= 5)
    return big, np.setdiff1d(np.arange(flat.size), big)


def block_law_pvalue(tokens, law: np.ndarray, n_blocks: int) -> float:
    """Chi-square p-value of the blocks of ``tokens`` (generated from [RESET]) against the exact ``law``."""
    blocks = np.asarray(tokens).reshape(n_blocks, 4)
    if not (blocks[:, 3] == RESET).all():          # a zero-probability token was emitted
        return 0.0
    symbols = blocks[:, :3] - 1 - SYMBOLS * np.arange(3)
    if ((symbols < 0) | (symbols >= SYMBOLS)).any():
        return 0.0
    counts = np.bincount(np.ravel_multi_index(symbols.T, (SYMBOLS,) * 3), minlength=SYMBOLS ** 3)
    big, rest = pooled_cells(law, n_blocks)
    observed = np.append(counts[big], counts[rest].sum())
    expected = np.append(law.ravel()[big], law.ravel()[rest].sum()) * n_blocks
    if expected[-1] == 0:
        if observed[-1] > 0:
            return 0.0                               # mass on cells the exact law forbids
        observed, expected = observed[:-1], expected[:-1]
    return float(stats.chisquare(observed, expected).pvalue)


# The harness's target, and a model draft of the same block structure.
TARGET = block_chain(*random_symbol_logits(0))
DRAFT = block_chain(*random_symbol_logits(1))
