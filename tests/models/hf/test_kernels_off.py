"""The compiled kernels and their fallbacks (``SPECULUM_KERNELS=off``) compute the same target.

Invariants, on any x86-64 CPU: with the kernels off no layer multiplies by its GGUF groups, and the fused
forward keeps its guarantees on the fallback (rows canonical, greedy speculative output equal to plain
greedy output, a draft equal to the target accepted in full). Both ways are the float32 target: the logits
agree within float32 rounding (only the order of each sum differs), so a well-separated model's greedy
tokens are identical both ways.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")
pytest.importorskip("transformers")

import speculum  # noqa: E402
from speculum.models.hf import HFModel  # noqa: E402
from speculum.models.hf.kernels.gguf_groups import GroupedProduct, kernel_unavailable  # noqa: E402
from speculum.models.hf.kernels.build import kernels_disabled  # noqa: E402
from speculum.models.hf.kernels.amx_tiles import tiles_unavailable  # noqa: E402
from support.grouped_weights import grouped_tiny  # noqa: E402

PROMPT = [1, 5, 9, 4, 7, 7, 2]


def test_the_switch_turns_every_kernel_off_with_its_reason(monkeypatch):
    monkeypatch.setenv("SPECULUM_KERNELS", "off")
    assert "SPECULUM_KERNELS=off" in kernels_disabled()
    assert "SPECULUM_KERNELS=off" in kernel_unavailable() and "SPECULUM_KERNELS=off" in tiles_unavailable()
    monkeypatch.setenv("SPECULUM_KERNELS", "on")
    assert kernels_disabled() is None


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_float32_target_is_the_same_with_and_without_kernels(tmp_path, monkeypatch, kind):
    plain, groups = grouped_tiny(tmp_path / "on", kind)
    with_kernels = HFModel(plain.module, plain.tokenizer, groups=groups)
    monkeypatch.setenv("SPECULUM_KERNELS", "off")
    plain, groups = grouped_tiny(tmp_path / "off", kind)                     # the same weights, loaded again
    without = HFModel(plain.module, plain.tokenizer, groups=groups)
    assert without.grouped_layers == 0 and without.fused_forward and without.capabilities.canonical_rows
    assert not isinstance(without.fused.blocks[0].qkv.run, GroupedProduct)

    rows_off = without.start(PROMPT).extend([3, 8])
    rows_on = with_kernels.start(PROMPT).extend([3, 8])
    assert np.allclose(rows_off, rows_on, rtol=0, atol=1e-5)      # float32 rounding of the sums, no more

    blocked = without.start(PROMPT[:3])
    assert np.array_equal(np.vstack([blocked.extend(PROMPT[3:5]), blocked.extend(PROMPT[5:] + [3, 8])])[-2:],
                          rows_off)                                 # the fallback's rows are canonical too
    greedy_off = speculum.generate(without, PROMPT, max_new_tokens=12, temperature=0, eos_token_id=None)
    speculative = speculum.generate(without, PROMPT, draft=without, gamma=3, max_new_tokens=12, temperature=0,
                                    eos_token_id=None)
    assert speculative.tokens == greedy_off.tokens and speculative.stats.acceptance_rate == 1.0
    monkeypatch.delenv("SPECULUM_KERNELS")
    greedy_on = speculum.generate(with_kernels, PROMPT, max_new_tokens=12, temperature=0, eos_token_id=None)
    assert greedy_on.tokens == greedy_off.tokens
