"""Attention rows on the compiled kernel (speculum.models.hf.kernels.attention_rows).

Invariants, where the kernel builds: each (row, head) is softmax attention over keys ``first .. position``
to float32 rounding of a float64 reference, with grouped key/value heads and sliding windows; every row is
bitwise the same alone or among others, at 1 or 2 threads, in any slot; keys past a row's position (or
before its window) are never read (NaN there changes nothing); a call that does not fit its plan is refused
before the kernel reads anything; given the rows' new keys, it writes them first; AVX2 and baseline builds of
the source attend to the native build's bits. An own cache gives room
for the kernel to write into once it holds buffers with room. Everywhere: ``SPECULUM_KERNELS=off`` turns it
off with that reason, and the fused forward's blocks then run on PyTorch's operations (the fused forward on
the kernel: test_glued.py).
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from speculum.models.hf.kernels import attention_rows  # noqa: E402
from speculum.models.hf.kernels.attention_rows import AttentionRows, attention_source, attention_unavailable  # noqa: E402
from speculum.models.hf.kernels.build import FLAGS  # noqa: E402
from support.hf_tiny import save_tiny_model  # noqa: E402

needs_kernel = pytest.mark.skipif(attention_unavailable() is not None,
                                  reason=f"no attention kernel: {attention_unavailable()}")


def reference(q, keys, values, positions, slots, scale, window=None) -> torch.Tensor:
    """Softmax attention in float64, row by row and head by head."""
    rows, heads, dim = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(rows, heads, dim, dtype=torch.float64)
    for r in range(rows):
        position, slot = int(positions[r]), int(slots[r])
        first = 0 if window is None else max(0, position - window + 1)
        for h in range(heads):
            k = keys[slot, h // group, first:position + 1].double()
            v = values[slot, h // group, first:position + 1].double()
            out[r, h] = torch.softmax(k @ q[r, h].double() * scale, 0) @ v
    return out


def store(slots: int, kv_heads: int, length: int, dim: int, generator: torch.Generator) -> tuple:
    return tuple(torch.randn(slots, kv_heads, length, dim, generator=generator) for _ in range(2))


@needs_kernel
@given(kv_heads=st.integers(1, 3), group=st.integers(1, 6), dim=st.sampled_from([4, 8, 16, 24, 64, 80, 256]),
       rows=st.integers(0, 12), window=st.one_of(st.none(), st.integers(1, 40)), seed=st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_rows_are_attention_to_float32_rounding_and_each_row_alone(kv_heads, group, dim, rows, window, seed):
    generator = torch.Generator().manual_seed(seed)
    heads, length = kv_heads * group, 150
    keys, values = store(3, kv_heads, length, dim, generator)
    positions = torch.randint(0, length, (rows,), generator=generator)
    slots = torch.randint(0, 3, (rows,), generator=generator)
    # Queries as the fused forward holds them: a view of projected rows with keys and values beside them.
    q = torch.randn(rows, heads + 2 * kv_heads, dim, generator=generator)[:, :heads] * 3
    out = AttentionRows(positions, slots, window)(q, keys, values, dim ** -0.5)
    assert out.shape == (rows, heads, dim) and out.is_contiguous()
    if rows:
        # Each output is a convex combination of values: float32 rounding of their size.
        assert float((out.double() - reference(q, keys, values, positions, slots, dim ** -0.5, window)).abs().max()) < 2e-5
    for r in range(rows):
        alone = AttentionRows(positions[r:r + 1], slots[r:r + 1], window)(q[r:r + 1].clone(), keys, values, dim ** -0.5)
        assert torch.equal(alone, out[r:r + 1])


@needs_kernel
@given(position=st.integers(0, 149), peak=st.integers(0, 149), seed=st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_the_softmax_shift_is_each_rows_largest_score(position, peak, seed):
    """Scores spread over hundreds, one key far above the rest: only the row's own largest score as the
    shift keeps every exponential finite and the largest at 1 (a shift 90 below it overflows, 110 above it
    flushes every term to 0), wherever that key sits among the row's keys (a full block of 16 or the tail)."""
    generator = torch.Generator().manual_seed(seed)
    dim, peak = 64, min(peak, position)
    keys, values = store(1, 1, 150, dim, generator)
    q = torch.randn(1, 2, dim, generator=generator) * 30
    keys[0, 0, peak] = q[0, 0] / q[0, 0].norm() * 40            # the first head's score there: ~ +1200 * 0.125
    out = AttentionRows(torch.tensor([position]), torch.tensor([0]))(q, keys, values, dim ** -0.5)
    assert bool(torch.isfinite(out).all())
    want = reference(q, keys, values, torch.tensor([position]), torch.tensor([0]), dim ** -0.5)
    assert float((out.double() - want).abs().max()) < 2e-4


@needs_kernel
def test_rows_are_the_same_at_any_thread_count_and_slot():
    generator = torch.Generator().manual_seed(1)
    keys, values = store(4, 2, 700, 64, generator)
    keys[3], values[3] = keys[0], values[0]                       # slot 3 holds slot 0's sequence
    positions = torch.randint(0, 700, (40,), generator=generator)
    q = torch.randn(40, 6, 64, generator=generator)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = AttentionRows(positions, torch.zeros(40, dtype=torch.long))(q, keys, values, 0.125)
        torch.set_num_threads(2)
        two = AttentionRows(positions, torch.zeros(40, dtype=torch.long))(q, keys, values, 0.125)
        moved = AttentionRows(positions, torch.full((40,), 3))(q, keys, values, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and torch.equal(one, moved)


@needs_kernel
@pytest.mark.parametrize("window", [None, 5])
def test_keys_outside_a_rows_range_are_never_read(window):
    generator = torch.Generator().manual_seed(2)
    keys, values = store(1, 1, 64, 32, generator)
    positions = torch.tensor([10, 20, 30])
    clean = AttentionRows(positions, torch.zeros(3, dtype=torch.long), window)(torch.randn(3, 2, 32), keys, values, 0.2)
    for r, position in enumerate(positions.tolist()):
        poisoned = [t.clone() for t in (keys, values)]
        for t in poisoned:
            t[0, 0, position + 1:] = float("nan")
            if window is not None:
                t[0, 0, :position - window + 1] = float("nan")
        q = torch.randn(1, 2, 32)
        plan = AttentionRows(positions[r:r + 1], torch.zeros(1, dtype=torch.long), window)
        assert torch.equal(plan(q, *poisoned, 0.2), plan(q, keys, values, 0.2))
    assert torch.isfinite(clean).all()


@needs_kernel
def test_calls_that_do_not_fit_their_plan_are_refused():
    keys = values = torch.zeros(2, 1, 16, 16)
    plan = AttentionRows(torch.tensor([15, 3]), torch.tensor([0, 1]))
    q = torch.zeros(2, 2, 16)
    with pytest.raises(ValueError, match="does not fit"):
        plan(q, keys[:, :, :15], values[:, :, :15], 1.0)              # position 15 past the keys
    with pytest.raises(ValueError, match="does not fit"):
        plan(q, keys[:1], values[:1], 1.0)                             # slot 1 past the store
    with pytest.raises(ValueError, match="does not fit"):
        plan(q, keys.double(), values.double(), 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        plan(torch.zeros(2, 16, 2).transpose(1, 2), keys, values, 1.0)  # features not contiguous
    with pytest.raises(ValueError, match="positions and slots"):
        AttentionRows(torch.tensor([1, 2]), torch.tensor([0]))
    with pytest.raises(ValueError, match=">= 0"):
        AttentionRows(torch.tensor([-1]), torch.tensor([0]))


def test_kernels_off_turns_it_off_and_the_fused_forward_attends_on_pytorch(monkeypatch, tmp_path):
    from speculum.models.hf import HFModel

    monkeypatch.setenv("SPECULUM_KERNELS", "off")
    assert "SPECULUM_KERNELS=off" in attention_unavailable()
    model = HFModel.from_pretrained(save_tiny_model(tmp_path / "model", layers=2))
    assert model.fused_forward and model.fused.row_ops is None          # blocks on PyTorch's operations


def test_forget_looks_for_the_kernel_again(monkeypatch):
    monkeypatch.delenv("SPECULUM_KERNELS", raising=False)      # the suite may run with the kernels off
    before = attention_unavailable()
    attention_rows.forget()
    monkeypatch.setenv("SPECULUM_KERNELS", "off")
    assert "SPECULUM_KERNELS=off" in attention_unavailable()
    monkeypatch.delenv("SPECULUM_KERNELS")
    attention_rows.forget()
    assert attention_unavailable() == before


@needs_kernel
def test_new_keys_given_to_a_call_are_written_first_and_attended_as_if_written_before():
    generator = torch.Generator().manual_seed(4)
    keys, values = store(2, 2, 64, 32, generator)
    positions, slots = torch.tensor([5, 6, 7, 3]), torch.tensor([0, 0, 0, 1])   # rows 0..2 read each other's keys
    new = torch.randn(4, 4, 32, generator=generator)                              # (rows, k heads + v heads, d)
    written = [keys.clone(), values.clone()]
    for r in range(4):
        written[0][slots[r], :, positions[r]] = new[r, :2]
        written[1][slots[r], :, positions[r]] = new[r, 2:]
    q = torch.randn(4, 4, 32, generator=generator)
    plan = AttentionRows(positions, slots)
    before = plan(q, *written, 0.2)
    given = plan(q, keys, values, 0.2, None, new[:, :2], new[:, 2:])
    assert torch.equal(before, given) and torch.equal(keys, written[0]) and torch.equal(values, written[1])
    with pytest.raises(ValueError, match="new keys"):
        plan(q, keys, values, 0.2, None, new[:, :2], new[:3, 2:])


def test_an_own_cache_gives_room_for_keys_once_it_holds_buffers_with_room():
    from speculum.models.hf.kv.cache import OwnCache

    cache = OwnCache()
    assert cache.room_for(1, 0) is None                        # nothing held yet
    first, one = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 1, 8)
    cache.append(first, first + 1, 0)
    cache.append(one, one + 1, 0)                               # buffers with room for exactly 4
    assert cache.room_for(1, 0) is None                        # full: the next append grows them
    cache.append(one, one + 1, 0)                               # room for 8
    room = cache.room_for(2, 0)
    assert room is not None and room[0].shape == (1, 2, 7, 8) and cache.length == 7
    assert torch.equal(room[0][:, :, :3], first) and torch.equal(room[1][:, :, 3:5], torch.cat([one, one], 2) + 1)
    cache.trim(2)
    assert cache.room_for(1, 0) is None and cache.length == 5   # a trim drops the buffers with room


def test_an_own_cache_gives_room_on_every_layer_or_counts_none():
    from speculum.models.hf.kv.cache import OwnCache

    cache = OwnCache()
    first, one = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 1, 8)
    for layer in (0, 1):
        cache.append(first, first + 1, layer)
        cache.append(one, one + 1, layer)
    cache.append(one, one + 1, 0)                               # layer 0: room for 8; layer 1: full at 4
    assert cache.rooms_for(1, 2) is None
    assert [cache.view(layer)[0].shape[2] for layer in (0, 1)] == [5, 4]     # nothing counted
    cache.append(one, one + 1, 1)                               # layer 1: room for 8
    rooms = cache.rooms_for(2, 2)
    assert [room[0].shape[2] for room in rooms] == [7, 7] and cache.length == 7
    assert all(torch.equal(room[0], cache.view(layer)[0]) for layer, room in enumerate(rooms))


@needs_kernel
def test_layer_arguments_are_each_layers_own_call():
    generator = torch.Generator().manual_seed(3)
    positions, slots = torch.tensor([2, 5]), torch.tensor([0, 1])
    plan = AttentionRows(positions, slots)
    q = torch.randn(2, 4, 16, generator=generator)
    out = torch.empty(2, 4, 16)
    layers = [(torch.randn(2, 2, 8, 16, generator=generator), torch.randn(2, 2, 8, 16, generator=generator))
              for _ in range(3)]
    wider = torch.randn(2, 2, 2, 9, 16, generator=generator)
    layers.append((wider[0][:, :, :8], wider[1][:, :, :8]))     # another layer's strides: checked in full
    found = plan.layer_arguments(q, [k for k, _ in layers], [v for _, v in layers], 0.25, out)
    assert found == [plan.arguments(q, k, v, 0.25, out) for k, v in layers]
    with pytest.raises(ValueError, match="does not fit"):
        plan.layer_arguments(q, [layers[0][0], layers[0][0][:, :, :4]], [layers[0][1], layers[0][1][:, :, :4]],
                             0.25, out)


@needs_kernel
@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
@pytest.mark.parametrize("target", ["x86-64-v3", "x86-64", "x86-64-v3 -DNATIVE_LANES=16"])
def test_avx2_and_baseline_builds_attend_to_the_same_bits(tmp_path, target):
    """AVX2 (8 lanes a register), the baseline build, and AVX-512's code (16 lanes a vector, built for AVX2:
    ``NATIVE_LANES=16``) give the native build's bits."""
    # Without OpenMP (no second runtime in this process): the other build runs its rows on one thread.
    march, *defines = target.split()
    flags = [f"-march={march}" if flag == "-march=native" else flag for flag in FLAGS if flag != "-fopenmp"]
    flags += defines
    built = tmp_path / f"attention-{target.replace(' ', '')}.so"
    subprocess.run(["gcc", *flags, "-shared", str(attention_source()), "-o", str(built)], check=True,
                   capture_output=True)
    other = ctypes.CDLL(str(built)).attention_rows
    pointer, count = ctypes.c_void_p, ctypes.c_int64
    other.argtypes = [count, count, count, count, pointer, count, pointer, pointer, count, pointer, pointer, pointer,
                      ctypes.c_float, pointer, pointer, pointer, count, ctypes.c_int]
    other.restype = ctypes.c_int
    generator = torch.Generator().manual_seed(5)
    for dim in (64, 24):                        # a width the native build inlines, and one with a partial chunk
        keys, values = store(2, 2, 300, dim, generator)
        positions, slots = torch.randint(0, 300, (12,), generator=generator), torch.randint(0, 2, (12,), generator=generator)
        q = torch.randn(12, 6, dim, generator=generator)
        plan = AttentionRows(positions, slots, window=100)
        ours, theirs = plan(q, keys, values, 0.3), torch.empty(12, 6, dim)
        offsets = slots * keys.stride(0)
        assert other(12, 6, 2, dim, q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), keys.stride(1),
                     offsets.data_ptr(), plan.first.data_ptr(), plan.last.data_ptr(), 0.3, theirs.data_ptr(), None,
                     None, 0, 1) == 0
        assert torch.equal(ours, theirs)
