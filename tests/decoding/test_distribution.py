"""Joint-distribution exactness of speculative sampling, through the real decoding loop.

The harness (:mod:`support.laws`): one long generation from the reset token of a block-structured chain
yields i.i.d. blocks whose exact law is known, tested by chi-square. Because the blocks are cut from one
stream, chunks straddle block boundaries at every offset, so γ, bonus tokens, rollback and draft catch-up
are all exercised in steady state. The same harness is shown to FAIL on deliberately broken rules.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import stats

import speculum.decoding.generation as generation_module
from speculum.decoding import generate
from speculum.decoding.verify import Verdict
from speculum.models import MarkovModel

from support.laws import (DETECT_TV, DRAFT, LEVEL, POWER, RESET, SYMBOLS, TARGET, block_chain, block_law_pvalue,
                          exact_block_law, random_symbol_logits, required_blocks)


def chi_square_pvalue(target, draft, *, gamma, temperature=1.0, top_k=None, top_p=None, seed=0) -> float:
    """Run one long speculative generation and test its block law against the exact law."""
    law = exact_block_law(target, temperature, top_k, top_p)
    n_support = int((law > 0).sum())
    # df is at most (support − 1); the sample size is chosen for the largest df this law can give.
    n_blocks = required_blocks(max(n_support - 1, 1))
    result = generate(target, [RESET], draft=draft, max_new_tokens=4 * n_blocks, gamma=gamma,
                      temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    return block_law_pvalue(result.tokens, law, n_blocks)


class ChainProposer:
    """Point-mass draft: proposes the greedy continuation of a given chain (no distribution)."""

    def __init__(self, model: MarkovModel) -> None:
        self.model = model

    def propose(self, context, max_tokens):
        out, last = [], context[-1]
        for _ in range(max_tokens):
            last = int(np.argmax(self.model.transition_logprobs[last]))
            out.append(last)
        return out


_start, _trans = random_symbol_logits(0)
DISJOINT = block_chain(-3 * _start, -3 * _trans)               # mass where the target has little
_onehot_rng = np.random.default_rng(2)
ONE_HOT = block_chain(np.where(np.arange(SYMBOLS) == 3, 0.0, -np.inf),
                      np.where(np.eye(SYMBOLS)[_onehot_rng.integers(0, SYMBOLS, SYMBOLS)] > 0, 0.0, -np.inf))
UNSTRUCTURED = MarkovModel.random(1 + 3 * SYMBOLS, seed=3)    # proposes impossible tokens too

# (name, draft, gamma, temperature, top_k, top_p): a representative grid kept fast by small supports
# (top-k / top-p shrink the number of cells, hence the samples needed); the full sweep is marked slow.
FAST_GRID = [
    ("model-topk", DRAFT, 3, 1.5, 2, None),
    ("pointmass-unstructured", ChainProposer(UNSTRUCTURED), 6, 0.7, 2, None),
]

DRAFTS = {"model": DRAFT, "pointmass": ChainProposer(DRAFT), "draft==target": TARGET, "disjoint": DISJOINT,
          "onehot": ONE_HOT, "unstructured": ChainProposer(UNSTRUCTURED)}
WARPS = [(None, None), (3, None), (None, 0.8)]
TEMPERATURES = (0.7, 1.0, 1.5)
# Every draft kind at every γ (temperature and warp rotating), plus every temperature × warp for the
# plain model draft: 27 runs instead of the 162 of a full product (each run takes seconds to a minute).
FULL_GRID = [(name, draft, gamma, TEMPERATURES[i % 3], *WARPS[(i // 3) % 3])
             for i, ((name, draft), gamma) in enumerate(itertools.product(DRAFTS.items(), (1, 3, 6)))]
FULL_GRID += [("model", DRAFT, 3, temperature, k, p) for temperature in TEMPERATURES for k, p in WARPS]


@pytest.mark.parametrize("name,draft,gamma,temperature,top_k,top_p", FAST_GRID, ids=[g[0] for g in FAST_GRID])
def test_block_law_is_exact(name, draft, gamma, temperature, top_k, top_p):
    pvalue = chi_square_pvalue(TARGET, draft, gamma=gamma, temperature=temperature, top_k=top_k, top_p=top_p)
    assert pvalue > LEVEL, f"{name}: speculative law differs from the target's (p = {pvalue:.2e})"


@pytest.mark.slow
@pytest.mark.parametrize("name,draft,gamma,temperature,top_k,top_p", FULL_GRID,
                         ids=[f"{g[0]}-g{g[2]}-t{g[3]}-k{g[4]}-p{g[5]}" for g in FULL_GRID])
def test_block_law_is_exact_full_grid(name, draft, gamma, temperature, top_k, top_p):
    pvalue = chi_square_pvalue(TARGET, draft, gamma=gamma, temperature=temperature, top_k=top_k, top_p=top_p,
                               seed=gamma)
    assert pvalue > LEVEL, f"{name}: speculative law differs from the target's (p = {pvalue:.2e})"


def _accept_always(draft_tokens, draft_logprobs, target_logprobs, acceptance_rng, resampling_rng):
    acceptance_rng.random(len(draft_tokens))
    gamma = len(draft_tokens)
    bonus = int(np.argmax(np.cumsum(np.exp(target_logprobs[gamma])) > resampling_rng.random()))
    return Verdict(gamma, list(draft_tokens) + [bonus], None, bonus)


def _residual_is_target(draft_tokens, draft_logprobs, target_logprobs, acceptance_rng, resampling_rng):
    # The classic mistake: on rejection resample from the target row instead of the residual.
    from speculum.decoding.warp import sample_from_logprobs
    uniforms, u = acceptance_rng.random(len(draft_tokens)), resampling_rng.random()
    for i, tok in enumerate(draft_tokens):
        if uniforms[i] >= min(1.0, np.exp(target_logprobs[i, tok] - draft_logprobs[i, tok])):
            recovered = sample_from_logprobs(target_logprobs[i], u)
            return Verdict(i, list(draft_tokens[:i]) + [recovered], recovered, None)
    bonus = sample_from_logprobs(target_logprobs[len(draft_tokens)], u)
    return Verdict(len(draft_tokens), list(draft_tokens) + [bonus], None, bonus)


@pytest.mark.parametrize("broken", [pytest.param(_accept_always, marks=pytest.mark.slow), _residual_is_target],
                         ids=["accept-always", "residual=target"])
def test_harness_detects_a_broken_rule(monkeypatch, broken):
    monkeypatch.setattr(generation_module, "verify_distribution", broken)
    pvalue = chi_square_pvalue(TARGET, DRAFT, gamma=3, temperature=1.0, top_k=2)
    assert pvalue <= LEVEL, "the distribution test cannot fail: it did not detect a broken rule"


def test_sample_size_detects_tv_002():
    # The computed N gives power >= 0.9 against the weakest (chi-square-closest) law at TV 0.02.
    df = SYMBOLS ** 3 - 1
    n = required_blocks(df)
    critical = stats.chi2.ppf(1 - LEVEL, df)
    assert stats.ncx2.sf(critical, df, n * (2 * DETECT_TV) ** 2) >= POWER
