"""Row-wise float32 glue in one C call each (speculum.models.hf.kernels.row_ops).

Invariants, where the kernel builds: each operation agrees with the PyTorch formulas it replaces
(``F.rms_norm``, the residual add and Gemma 3's norms after it, bias + head norms + ``q * cos +
rotate_half(q) * sin``, ``F.silu`` / ``F.gelu(approximate="tanh")`` times up) to a few float32 ulps of the
outputs' size, extreme inputs included; its exp is within 2 ulp of the exact one; every row is bitwise the
same alone, among 1, 7 or 300 rows and at 1 or 2 threads; the AVX2 and baseline x86-64 builds compute the
same bits as the native one. Everywhere: ``SPECULUM_KERNELS=off`` makes it unavailable with that reason.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
F = torch.nn.functional

from speculum.models.hf.kernels import row_ops  # noqa: E402
from speculum.models.hf.kernels.build import FLAGS  # noqa: E402
from speculum.models.hf.kernels.row_ops import RowOps, row_ops_unavailable  # noqa: E402

needs_rows = pytest.mark.skipif(row_ops_unavailable() is not None, reason=f"no row kernel: {row_ops_unavailable()}")
FEATURES = [64, 576, 640, 1536, 2048, 100]
HEAD_DIMS = [64, 128, 256, 48]
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def close(actual, expected, ulps=4):
    """Within ``ulps`` float32 ulps of each row's size (plus the element's own relative rounding)."""
    scale = expected.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    assert actual.dtype == torch.float32
    bound = ulps * 2**-23 * scale + 2e-6 * expected.abs()
    assert torch.all((actual.double() - expected.double()).abs() <= bound), \
        float(((actual.double() - expected.double()).abs() / scale).max())


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference_rotate(qkv, heads, kv_heads, head_dim, cos, sin, bias=None, head_weight=None, eps=0.0):
    """The fused forward's PyTorch formulas, in float64."""
    qkv = qkv.double() + (0 if bias is None else bias.double())
    rows = qkv.shape[0]
    end = (heads + kv_heads) * head_dim
    qk = qkv[:, :end].reshape(rows, heads + kv_heads, head_dim)
    if head_weight is not None:
        qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps) * head_weight.double()
    cos, sin = cos.double()[:, None], sin.double()[:, None]
    return torch.cat([(qk * cos + rotate_half(qk) * sin).reshape(rows, end), qkv[:, end:]], dim=1)


def norm64(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def inputs(generator, rows, features, extreme):
    x = torch.randn(rows, features, generator=generator) * 3
    if extreme and rows > 1:
        x[0] = 0.0                                              # a row of zeros: its norm is zeros
        x[-1, :8] = torch.tensor([100.0, -100.0, 1e-30, -1e-30, 30.0, -30.0, 1e-3, 0.0])
    return x


@needs_rows
@given(st.sampled_from(FEATURES), st.integers(0, 9), st.booleans(), st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_norm_and_residual_norm_are_the_pytorch_formulas(features, rows, extreme, seed):
    generator = torch.Generator().manual_seed(seed)
    ops = RowOps()
    x = inputs(generator, rows, features, extreme)
    weight, post = torch.randn(features, generator=generator), torch.randn(features, generator=generator)
    out = torch.full_like(x, float("nan"))
    assert ops.norm(x, weight, 1e-6, out) is out
    close(out, norm64(x, weight, 1e-6))
    close(out, F.rms_norm(x, (features,), weight, 1e-6))
    if extreme and rows > 1:
        assert torch.equal(out[0], torch.zeros(features))
    delta = inputs(generator, rows, features, extreme)
    for post_weight in (None, post):
        total = x.clone()
        assert ops.residual_norm(total, delta, weight, 1e-5, out, post_weight, 1e-6) is out
        added = delta.double() if post_weight is None else norm64(delta, post_weight, 1e-6)
        close(total, x.double() + added, ulps=8)
        torch_total = x + (delta if post_weight is None else F.rms_norm(delta, (features,), post_weight, 1e-6))
        close(total, torch_total, ulps=8)
        close(out, norm64(total, weight, 1e-5))


@needs_rows
@given(st.sampled_from(HEAD_DIMS), st.sampled_from([(9, 3), (4, 1), (2, 2)]), st.integers(0, 9), st.booleans(),
       st.booleans(), st.integers(0, 3), st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_rotate_is_bias_head_norm_and_rotate_half(head_dim, heads, rows, biased, normed, spare, seed):
    heads, kv_heads = heads
    generator = torch.Generator().manual_seed(seed)
    features = (heads + 2 * kv_heads) * head_dim + spare            # spare columns past the values are kept
    qkv = inputs(generator, rows, features, True)
    angles = torch.rand(rows, head_dim // 2, generator=generator) * 1000
    table = torch.cat([angles, angles], dim=1)
    wide = torch.cat([table.cos(), table.sin()], dim=1)                # cos and sin: rows of stride 2 head_dim
    cos, sin = wide[:, :head_dim], wide[:, head_dim:]
    bias = torch.randn(features, generator=generator) if biased else None
    weight = torch.randn(heads + kv_heads, head_dim, generator=generator) if normed else None
    rotated = qkv.clone()
    assert RowOps().rotate(rotated, heads, kv_heads, head_dim, cos, sin, bias, weight, 1e-6) is None
    expected = reference_rotate(qkv, heads, kv_heads, head_dim, cos, sin, bias, weight, 1e-6)
    close(rotated, expected, ulps=8)
    end = (heads + kv_heads) * head_dim
    if bias is None:
        assert torch.equal(rotated[:, end:], qkv[:, end:])
    if weight is None and bias is None:
        # The rotation alone is the same element-wise IEEE operations as PyTorch's: the same bits.
        qk = qkv[:, :end].view(rows, heads + kv_heads, head_dim)
        same = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
        assert torch.equal(rotated[:, :end], same.reshape(rows, end))


@needs_rows
@given(st.sampled_from(FEATURES), st.sampled_from(sorted(ACTIVATIONS)), st.integers(0, 9), st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_gated_is_activation_times_up(inner, activation, rows, seed):
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * inner, generator=generator) * 4
    out = torch.empty(rows, inner)
    assert RowOps().gated(gate_up, activation, out) is out
    gate, up = gate_up.double().chunk(2, dim=-1)
    if activation == "silu":
        expected = gate / (1 + torch.exp(-gate)) * up
    else:
        expected = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3))) * up
    close(out, expected)
    gate, up = gate_up.chunk(2, dim=-1)
    close(out, ACTIVATIONS[activation](gate) * up, ulps=16)


@needs_rows
def test_gates_saturate_and_keep_their_signs():
    values = torch.tensor([-1e30, -100.0, -30.0, -1e-30, 0.0, 1e-30, 30.0, 100.0, 1e30, 3e38, -3e38])
    up = torch.ones_like(values)
    for activation, function in ACTIVATIONS.items():
        out = torch.empty(1, values.numel())
        RowOps().gated(torch.cat([values, up])[None], activation, out)
        expected = function(values)
        assert torch.equal(torch.signbit(out[0]), torch.signbit(expected)), (activation, out, expected)
        assert out[0, 1] == 0 and out[0, 7] == 100 and out[0, 8] == 1e30 and out[0, 4] == 0
        close(out[0], expected.double())


@needs_rows
def test_exp_is_within_two_ulp_and_saturates():
    x = torch.cat([torch.linspace(-110.0, 95.0, 1_000_001), torch.tensor([0.0, -0.0, 88.72, 88.73, -87.5, -103.9])])
    out = torch.empty_like(x)
    RowOps().exp(x, out)
    exact = torch.exp(x.double())
    rounded = exact.float()
    ulp = (rounded.nextafter(torch.tensor(float("inf"))) - rounded).double().clamp_min(2.0**-149)
    finite = torch.isfinite(rounded)
    assert torch.all((out.double() - exact)[finite].abs() <= 2 * ulp[finite])
    assert torch.equal(torch.isinf(out), ~finite) and torch.all(out >= 0)
    assert torch.all(out[x < -104] == 0)


@needs_rows
@pytest.mark.parametrize("features", [576, 100])
def test_each_row_is_the_same_alone_among_others_and_at_any_thread_count(features):
    generator = torch.Generator().manual_seed(0)
    ops = RowOps()
    x = torch.randn(300, features, generator=generator) * 5         # 300 x 576 runs on threads
    delta = torch.randn(300, features, generator=generator)
    weight, post = torch.randn(features, generator=generator), torch.randn(features, generator=generator)
    cos, sin = torch.randn(300, 64, generator=generator), torch.randn(300, 64, generator=generator)
    head = torch.randn(4 + 1, 64, generator=generator)
    projected = torch.randn(300, (4 + 2) * 64 + 3, generator=generator) * 5
    bias = torch.randn(projected.shape[1], generator=generator)

    def run(start, end):
        rows = end - start
        out, total = torch.empty(rows, features), x[start:end].clone()
        ops.norm(x[start:end], weight, 1e-6, out)
        residual = torch.empty(rows, features)
        ops.residual_norm(total, delta[start:end], weight, 1e-6, residual, post, 1e-6)
        qkv = projected[start:end].clone()
        ops.rotate(qkv, 4, 1, 64, cos[start:end], sin[start:end], bias, head, 1e-6)
        gated = torch.empty(rows, features // 2)
        ops.gated(x[start:end], "gelu_pytorch_tanh" if features > 400 else "silu", gated)
        return out, total, residual, qkv, gated

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [torch.cat(parts) for parts in zip(*(run(r, r + 1) for r in range(300)))]
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (1, 7, 300):
                for start in (0, 300 - rows):
                    for got, expected in zip(run(start, start + rows), alone):
                        assert torch.equal(got, expected[start:start + rows])
    finally:
        torch.set_num_threads(threads)


@needs_rows
def test_zero_rows_and_broadcast_tables():
    ops = RowOps()
    empty = torch.empty(0, 64)
    assert ops.norm(empty, torch.ones(64), 1e-6, torch.empty(0, 64)).shape == (0, 64)
    ops.rotate(torch.empty(0, 192), 1, 1, 64, empty, empty)
    assert ops.gated(torch.empty(0, 128), "silu", torch.empty(0, 64)).shape == (0, 64)
    qkv = torch.randn(5, 192)
    table = torch.randn(1, 64)
    rotated = qkv.clone()
    ops.rotate(rotated, 1, 1, 64, table.expand(5, 64), table.expand(5, 64))          # stride 0: one row for all
    close(rotated, reference_rotate(qkv, 1, 1, 64, table.expand(5, 64), table.expand(5, 64)))


@needs_rows
def test_what_it_cannot_take_is_refused():
    ops = RowOps()
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="norm"):
        ops.norm(x.t(), torch.ones(4), 1e-6, torch.empty(64, 4))
    with pytest.raises(ValueError, match="norm"):
        ops.norm(x, torch.ones(64), 1e-6, torch.empty(4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rotate"):
        ops.rotate(torch.randn(4, 100), 1, 1, 64, torch.randn(4, 64), torch.randn(4, 64))
    with pytest.raises(ValueError, match="gated"):
        ops.gated(torch.randn(4, 128), "relu", torch.empty(4, 64))


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
@pytest.mark.parametrize("target", ["x86-64-v3", "x86-64", "x86-64-v3 -DNATIVE_LANES=16"])
def test_avx2_and_baseline_builds_compute_the_same_bits(tmp_path, target):
    """AVX2 (8 lanes a register), the baseline build, and AVX-512's code (16 lanes a vector, built for AVX2:
    ``NATIVE_LANES=16``) give the native build's bits."""
    if row_ops_unavailable() is not None:
        pytest.skip("no native row kernel to compare with")
    # Without OpenMP (no second runtime in this process): these calls run on one thread anyway.
    march, *defines = target.split()
    flags = [f"-march={march}" if flag == "-march=native" else flag for flag in FLAGS if flag != "-fopenmp"]
    flags += defines
    built = tmp_path / f"rowops-{target.replace(' ', '')}.so"
    subprocess.run(["gcc", *flags, "-shared", str(row_ops.row_ops_source()), "-o", str(built)], check=True,
                   capture_output=True)
    other = ctypes.CDLL(str(built))
    generator = torch.Generator().manual_seed(3)
    x, weight = torch.randn(9, 100, generator=generator) * 20, torch.randn(100, generator=generator)
    row_ops.bind(other)
    ours, theirs = torch.empty(9, 100), torch.empty(9, 100)
    RowOps().exp(x, ours)
    RowOps(other).exp(x, theirs)
    assert torch.equal(ours, theirs)
    ours, theirs = RowOps().norm(x, weight, 1e-6, torch.empty(9, 100)), torch.empty(9, 100)
    other.rowops_norm(x.data_ptr(), weight.data_ptr(), 1e-6, theirs.data_ptr(), 9, 100, 1)
    assert torch.equal(ours, theirs)
    for code, activation in enumerate(("silu", "gelu_pytorch_tanh")):
        ours, theirs = RowOps().gated(x, activation, torch.empty(9, 50)), torch.empty(9, 50)
        other.rowops_gated(x.data_ptr(), theirs.data_ptr(), 9, 50, code, 1)
        assert torch.equal(ours, theirs)
    delta, post = torch.randn(9, 100, generator=generator), torch.randn(100, generator=generator)
    ours_x, theirs_x, ours, theirs = x.clone(), x.clone(), torch.empty(9, 100), torch.empty(9, 100)
    RowOps().residual_norm(ours_x, delta, weight, 1e-6, ours, post, 1e-5)
    other.rowops_residual_norm(theirs_x.data_ptr(), delta.data_ptr(), weight.data_ptr(), 1e-6, theirs.data_ptr(),
                               post.data_ptr(), 1e-5, 9, 100, 1)
    assert torch.equal(ours_x, theirs_x) and torch.equal(ours, theirs)
    cos, sin, head = x[:, :48], x[:, 48:96], torch.randn(3, 48, generator=generator)   # head_dim 48: short chunks
    ours = torch.randn(9, 4 * 48, generator=generator)
    theirs = ours.clone()
    RowOps().rotate(ours, 2, 1, 48, cos, sin, None, head, 1e-6)
    other.rowops_rotate(theirs.data_ptr(), 9, 4 * 48, 3, 48, cos.data_ptr(), 100, sin.data_ptr(), 100, None,
                        head.data_ptr(), 1e-6, 1)
    assert torch.equal(ours, theirs)
    logits = torch.cat([x * 3, torch.full((9, 37), float("-inf"))], dim=1).contiguous()   # a tail of -inf
    ours, ours_rows = torch.empty(9, dtype=torch.float64), torch.empty(9, 137, dtype=torch.float64)
    theirs, theirs_rows = torch.empty_like(ours), torch.empty_like(ours_rows)
    RowOps().log_mass(logits, ours, ours_rows)
    other.rowops_log_mass(logits.data_ptr(), 9, 137, theirs.data_ptr(), theirs_rows.data_ptr(), 1)
    assert torch.equal(ours, theirs) and torch.equal(ours_rows, theirs_rows)


def test_the_switch_makes_it_unavailable_with_its_reason(monkeypatch):
    monkeypatch.setenv("SPECULUM_KERNELS", "off")
    row_ops.forget()
    try:
        reason = row_ops_unavailable()
        assert reason is not None and "SPECULUM_KERNELS=off" in reason
        with pytest.raises(RuntimeError, match="SPECULUM_KERNELS=off"):
            RowOps()
    finally:
        monkeypatch.delenv("SPECULUM_KERNELS")
        row_ops.forget()
