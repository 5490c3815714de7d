"""The seed API: SpeculativeDecoder / SpeculativeDecodingStats with seed-style (.forward) models."""
from __future__ import annotations

import numpy as np
import pytest

import speculum
from speculum import SpeculativeDecoder, SpeculativeDecodingStats
from speculum.models import MarkovModel


class SeedStyleBigram:
    """A seed-style model: forward(ids[1, T]) -> logits[1, T, V], no sessions, no protocol."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.table = np.random.default_rng(seed).normal(scale=2.0, size=(vocab_size, vocab_size))
        self.forward_calls = 0

    def forward(self, ids: np.ndarray) -> np.ndarray:
        self.forward_calls += 1
        return self.table[np.asarray(ids)]


def greedy_reference(model: SeedStyleBigram, prompt, n):
    out = list(prompt)
    for _ in range(n):
        out.append(int(np.argmax(model.table[out[-1]])))
    return out


def test_seed_api_shape_fields_and_properties():
    target, draft = SeedStyleBigram(10, 0), SeedStyleBigram(10, 1)
    ids, stats = SpeculativeDecoder(gamma=3, temperature=1.0, seed=0).generate(draft, target, [1, 2], 25)
    assert ids[:2] == [1, 2] and len(ids) == 27
    assert isinstance(stats, SpeculativeDecodingStats)
    assert stats.total_tokens_generated == 25
    assert 0 <= stats.total_draft_tokens_accepted <= stats.total_draft_tokens_proposed
    assert stats.num_target_forward_passes >= 25 / 4
    assert stats.acceptance_rate == stats.total_draft_tokens_accepted / stats.total_draft_tokens_proposed
    assert stats.tokens_per_step == 25 / stats.num_target_forward_passes
    assert SpeculativeDecodingStats().acceptance_rate == 0.0 and SpeculativeDecodingStats().tokens_per_step == 0.0


def test_temperature_zero_is_exactly_greedy():
    target, draft = SeedStyleBigram(10, 0), SeedStyleBigram(10, 1)
    for gamma in (1, 4):
        ids, _ = SpeculativeDecoder(gamma=gamma, temperature=0).generate(draft, target, [3], max_new_tokens=30)
        assert ids == greedy_reference(target, [3], 30)


def test_eos_and_protocol_models():
    target, draft = MarkovModel.random(6, seed=0), MarkovModel.random(6, seed=1)
    ids, stats = SpeculativeDecoder(gamma=4, seed=1).generate(draft, target, [0], max_new_tokens=200,
                                                              eos_token_id=2)
    assert ids[-1] == 2 and 2 not in ids[1:-1] and stats.total_tokens_generated == len(ids) - 1


def test_seeded_decoder_is_reproducible_and_successive_calls_differ():
    target, draft = MarkovModel.random(6, seed=0), MarkovModel.random(6, seed=1)
    first = [SpeculativeDecoder(seed=5).generate(draft, target, [0], 40)[0] for _ in range(2)]
    assert first[0] == first[1]
    decoder = SpeculativeDecoder(seed=5)
    assert decoder.generate(draft, target, [0], 40)[0] != decoder.generate(draft, target, [0], 40)[0]


def test_bad_gamma_is_a_value_error():
    with pytest.raises(ValueError, match="gamma"):
        SpeculativeDecoder(gamma=0).generate(MarkovModel.random(4), MarkovModel.random(4), [0], 5)


def test_exported_at_top_level():
    assert speculum.SpeculativeDecoder is SpeculativeDecoder
