"""warp_logprobs against brute-force definitions; sampling helper; argument validation."""
from __future__ import annotations

import numpy as np
import pytest

from speculum.decoding.warp import check_sampling_args, sample_from_logprobs, warp_logprobs


def brute_warp(probs: np.ndarray, temperature: float, top_k, top_p) -> np.ndarray:
    """Reference: one row, plain Python loops over an explicit ranking."""
    scaled = probs ** (1.0 / temperature)
    scaled = scaled / scaled.sum()
    ranking = sorted(range(len(scaled)), key=lambda i: (-scaled[i], i))
    kept = ranking[: top_k or len(ranking)]
    if top_p is not None:
        nucleus, mass = [], 0.0
        for i in kept:
            if mass >= top_p:
                break
            nucleus.append(i)
            mass += scaled[i]
        kept = nucleus
    out = np.zeros_like(scaled)
    out[kept] = scaled[kept]
    return out / out.sum()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("top_k,top_p", [(None, None), (1, None), (3, None), (None, 0.5), (None, 0.95), (4, 0.7)])
def test_warp_matches_brute_force(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    rows = rng.dirichlet(np.ones(7), size=20)                                  # (20, 7)
    warped = np.exp(warp_logprobs(np.log(rows), temperature=temperature, top_k=top_k, top_p=top_p))
    for row, got in zip(rows, warped):
        np.testing.assert_allclose(got, brute_warp(row, temperature, top_k, top_p), atol=1e-12)


def test_warp_is_batched_and_keeps_zero_probabilities_at_zero():
    rows = np.array([[np.log(0.5), np.log(0.5), -np.inf], [np.log(0.2), -np.inf, np.log(0.8)]])
    out = warp_logprobs(rows, temperature=0.5, top_k=2)
    assert out.shape == (2, 3)
    assert out[0, 2] == -np.inf and out[1, 1] == -np.inf
    np.testing.assert_allclose(np.exp(out).sum(axis=-1), 1.0)


def test_top_k_ties_keep_the_lower_token_id():
    out = warp_logprobs(np.log(np.full(4, 0.25)), temperature=1.0, top_k=2)
    assert np.isfinite(out[:2]).all() and (out[2:] == -np.inf).all()


def test_warp_rejects_temperature_zero():
    with pytest.raises(ValueError, match="temperature"):
        warp_logprobs(np.zeros(3), temperature=0.0)


def test_sample_from_logprobs_is_inverse_cdf_and_never_picks_zero_mass():
    row = np.array([-np.inf, np.log(0.25), -np.inf, np.log(0.75), -np.inf])
    assert sample_from_logprobs(row, 0.0) == 1
    assert sample_from_logprobs(row, 0.2499) == 1
    assert sample_from_logprobs(row, 0.25) == 3
    assert sample_from_logprobs(row, np.nextafter(1.0, 0.0)) == 3
    uniforms = np.random.default_rng(1).random(4000)
    counts = np.bincount([sample_from_logprobs(row, u) for u in uniforms], minlength=5)
    assert counts[[0, 2, 4]].sum() == 0
    assert abs(counts[3] / 4000 - 0.75) < 0.03


@pytest.mark.parametrize("kwargs,name", [
    (dict(temperature=-0.1, top_k=None, top_p=None), "temperature"),
    (dict(temperature=float("nan"), top_k=None, top_p=None), "temperature"),
    (dict(temperature=float("inf"), top_k=None, top_p=None), "temperature"),
    (dict(temperature=1.0, top_k=0, top_p=None), "top_k"),
    (dict(temperature=1.0, top_k=2.5, top_p=None), "top_k"),
    (dict(temperature=1.0, top_k=None, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_k=None, top_p=1.5), "top_p"),
])
def test_check_sampling_args_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        check_sampling_args(**kwargs)
