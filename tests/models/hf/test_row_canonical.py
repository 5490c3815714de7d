"""Row-canonical forwards: a row's logits depend on its sequence's tokens up to it, never on how they were fed.

Invariants (float32 and bfloat16 targets through the fused forward, bitwise): the rows of a sequence are
the same fed whole, token by token or in any blocks; packed with other sessions on the KV store at any
concurrency; read by a batched ``next_logprobs``; so greedy speculative output equals plain greedy output
token for token. :class:`RowAttention` gives each row bitwise what it gives that row alone, whatever its
block, batch or the keys past it, with or without the kernel's batched items, and is attention to float32
rounding.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import speculum  # noqa: E402
from support.hf_tiny import save_tiny_model  # noqa: E402
from speculum.models import PromptLookup  # noqa: E402
from speculum.models.base import Feed  # noqa: E402
from speculum.models.hf import HFModel  # noqa: E402
from speculum.models.hf.forward import attention as row_attention  # noqa: E402
from speculum.models.hf.forward.attention import KEY_BLOCK, RowAttention, SlotRows, keys_from, keys_needed  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")

sequences = st.lists(st.integers(min_value=3, max_value=22), min_size=2, max_size=90)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request, tmp_path_factory) -> HFModel:
    folder = tmp_path_factory.mktemp(f"canonical-{request.param}") / "model"
    loaded = HFModel.from_pretrained(save_tiny_model(folder, layers=2, max_context=512), dtype=request.param)
    assert loaded.fused_forward
    return loaded


def cuts(tokens: list[int], draw) -> list[list[int]]:
    """``tokens`` in consecutive blocks of drawn lengths."""
    blocks, start = [], 0
    while start < len(tokens):
        size = draw(st.integers(1, max(1, len(tokens) - start)))
        blocks.append(tokens[start:start + size])
        start += size
    return blocks


@settings(max_examples=20, deadline=None)
@given(tokens=sequences, data=st.data())
def test_rows_do_not_depend_on_how_the_sequence_is_fed(model, tokens, data):
    whole = model.start(tokens[:1]).extend(tokens[1:])
    session = model.start(tokens[:1])
    blocked = np.vstack([session.extend(block) for block in cuts(tokens[1:], data.draw)])
    assert np.array_equal(blocked, whole)
    one_by_one = model.start(tokens[:1])
    assert np.array_equal(np.vstack([one_by_one.extend([t]) for t in tokens[1:]]), whole)
    batched = model.next_logprobs([tokens[:i] for i in range(2, len(tokens) + 1)])
    assert np.array_equal(np.asarray(batched), whole)


@settings(max_examples=15, deadline=None)
@given(prompts=st.lists(sequences, min_size=2, max_size=5), data=st.data())
def test_packed_sessions_get_their_rows_alone_bitwise(model, prompts, data):
    """Sessions packed on the store, each round a drawn block per session (some sit rounds out)."""
    packed = [model.start(p[:1]) for p in prompts]
    alone = [model.start(p[:1]) for p in prompts]
    rest = [list(p[1:]) for p in prompts]
    while any(rest):
        taking = [i for i, r in enumerate(rest) if r and data.draw(st.booleans())] or [
            next(i for i, r in enumerate(rest) if r)]
        blocks = []
        for i in taking:
            size = data.draw(st.integers(1, len(rest[i])))
            blocks.append(rest[i][:size])
            rest[i] = rest[i][size:]
        got = model.extend_sessions([Feed(packed[i], block) for i, block in zip(taking, blocks)])
        for i, block, rows in zip(taking, blocks, got):
            assert np.array_equal(rows, alone[i].extend(block))


def test_packed_rows_without_batched_items_are_the_same(model, monkeypatch):
    """Where the kernel's batched items are not independent, every row gets a call of its own: the same rows."""
    prompts = [[3, 4, 5] * (i + 1) for i in range(4)]
    blocks = [[6], [7, 8, 9], [10], [11]]
    batched_items = model.extend_sessions([Feed(model.start(p), b) for p, b in zip(prompts, blocks)])
    monkeypatch.setattr(row_attention, "items_are_independent", lambda *shape: False)
    for got, want in zip(model.extend_sessions([Feed(model.start(p), b) for p, b in zip(prompts, blocks)]),
                         batched_items):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("gamma", [1, 3, 7, "auto"])
def test_greedy_speculative_output_is_plain_greedy_output(model, gamma):
    prompt = [1, 3, 4, 5, 3, 4, 5, 6, 3, 4]
    plain = speculum.generate(model, prompt, max_new_tokens=60, temperature=0, eos_token_id=None)
    fast = speculum.generate(model, prompt, draft=PromptLookup(), gamma=gamma, max_new_tokens=60, temperature=0,
                             eos_token_id=None)
    assert fast.tokens == plain.tokens


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def test_the_real_model_rows_and_greedy_output_do_not_depend_on_blocks(dtype):
    """The embedded SmolLM2 at full size: a prompt's rows fed whole, in blocks crossing a key span, and
    packed beside another session are bitwise the same, and greedy prompt lookup is plain greedy output."""
    model = speculum.load_model(dtype=dtype)
    assert model.capabilities.canonical_rows
    prompt = model.encode("Rewrite politely: send me the report now, I have been waiting for days.")
    tokens = prompt + prompt[3:40]
    whole = model.start(tokens[:1]).extend(tokens[1:])
    session = model.start(tokens[:1])
    blocked = [session.extend(tokens[1:17]), session.extend(tokens[17:18])]
    other = model.start(tokens[:9])
    for block in (tokens[18:31], tokens[31:]):
        blocked.append(model.extend_sessions([Feed(session, block), Feed(other, [5])])[0])
    assert np.array_equal(np.vstack(blocked), whole)
    plain = speculum.generate(model, prompt, max_new_tokens=24, temperature=0, eos_token_id=None)
    fast = speculum.generate(model, prompt, draft=PromptLookup(), gamma=4, max_new_tokens=24, temperature=0,
                             eos_token_id=None)
    assert fast.tokens == plain.tokens


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_packed_scheduling_gives_every_greedy_generation_its_solo_tokens(model, batch_invariant):
    """Generations joining a scheduler at different steps, verified in packed forwards (a row-canonical
    target keeps them even when asked for batch invariance): each one's tokens are its solo run's."""
    from speculum.decoding.scheduler import Scheduler

    prompts = [[1, 3, 4, 5, 3, 4][: 2 + i] * (1 + i % 3) for i in range(5)]
    scheduler = Scheduler(model, batch_invariant=batch_invariant)
    assert scheduler.batched
    out: dict[int, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or scheduler.active:
        if pending:
            i, prompt = pending.pop(0)
            out[scheduler.add(prompt, draft=PromptLookup(), gamma="auto", max_new_tokens=30, temperature=0,
                              eos_token_id=None)] = []
        for request, chunk in scheduler.step():
            out[request].extend(chunk.tokens)
    for request, prompt in enumerate(prompts):
        assert out[request] == speculum.generate(model, prompt, max_new_tokens=30, temperature=0,
                                                 eos_token_id=None).tokens


# ------------------------------------------------------------------------------------------ RowAttention
def reference(q, keys, values, past, scale, window=None):
    """Causal attention in float64, head h reading key head h // (heads // kv_heads); a row at p sees keys
    p - window + 1 .. p on a sliding-window layer."""
    heads, kv = q.shape[1], keys.shape[1]
    keys = keys.double().repeat_interleave(heads // kv, dim=1)
    values = values.double().repeat_interleave(heads // kv, dim=1)
    n = q.shape[2]
    scores = (q.double() @ keys.transpose(-1, -2)) * scale                   # (batch, heads, n, keys)
    visible = torch.arange(keys.shape[2]) <= (torch.arange(n) + past)[:, None]
    if window is not None:
        visible &= torch.arange(keys.shape[2]) > (torch.arange(n) + past)[:, None] - window
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ values


@settings(max_examples=30, deadline=None)
@given(past=st.integers(0, 3 * KEY_BLOCK), n=st.integers(1, 2 * KEY_BLOCK), batch=st.integers(1, 3),
       kv=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]), seed=st.integers(0, 2**31))
def test_row_attention_gives_each_row_what_it_gives_it_alone(past, n, batch, kv, group, seed):
    generator = torch.Generator().manual_seed(seed)
    heads, d, scale = kv * group, 8, 8 ** -0.5
    span = keys_needed(past + n) + KEY_BLOCK                                 # room past the block: garbage
    q = torch.randn(batch, heads, n, d, generator=generator)
    keys, values = (torch.randn(batch, kv, span, d, generator=generator) for _ in range(2))
    out = RowAttention(past, n)(q, keys, values, scale)
    want = reference(q, keys[:, :, :past + n], values[:, :, :past + n], past, scale)
    assert torch.allclose(out.double(), want, atol=1e-5)
    for row in {0, n // 2, n - 1}:
        for b in {0, batch - 1}:
            alone = RowAttention(past + row, 1)(q[b:b + 1, :, row:row + 1], keys[b:b + 1], values[b:b + 1], scale)
            assert torch.equal(alone, out[b:b + 1, :, row:row + 1])
    garbage = keys.clone()
    garbage[:, :, past + n:] = torch.randn(garbage[:, :, past + n:].shape, generator=generator) * 100
    assert torch.equal(RowAttention(past, n)(q, garbage, values, scale), out)


@settings(max_examples=30, deadline=None)
@given(past=st.integers(0, 4 * KEY_BLOCK), n=st.integers(1, 2 * KEY_BLOCK), window=st.integers(1, 150),
       kv=st.sampled_from([1, 2]), seed=st.integers(0, 2**31))
def test_sliding_window_rows_read_from_their_windows_block_and_equal_each_alone(past, n, window, kv, seed):
    """On a sliding-window layer a row reads keys from its window's key block on (``keys_from``): the
    attention of its window (float64 reference), bitwise the same alone, in its block, or on slots of a
    store (``SlotRows``), and nothing before the block is read (garbage there changes nothing)."""
    generator = torch.Generator().manual_seed(seed)
    heads, d, scale = 3 * kv, 8, 8 ** -0.5
    span = keys_needed(past + n) + KEY_BLOCK
    q = torch.randn(1, heads, n, d, generator=generator)
    keys, values = (torch.randn(1, kv, span, d, generator=generator) for _ in range(2))
    out = RowAttention(past, n, window)(q, keys, values, scale)
    want = reference(q, keys[:, :, :past + n], values[:, :, :past + n], past, scale, window)
    assert torch.allclose(out.double(), want, atol=1e-5)
    rows = sorted({0, n // 2, n - 1})
    # Each row on a slot of its own holding this sequence's keys, beside a slot of other keys.
    store_keys, store_values = (torch.cat([t.expand(len(rows), -1, -1, -1), torch.randn(t.shape, generator=generator)])
                                for t in (keys, values))
    slots = SlotRows(list(range(len(rows))), [past + row for row in rows], window)
    together = slots(q[0, :, rows].transpose(0, 1), store_keys, store_values, scale)
    for at, row in enumerate(rows):
        alone = RowAttention(past + row, 1, window)(q[:, :, row:row + 1], keys, values, scale)
        assert torch.equal(alone, out[:, :, row:row + 1])
        assert torch.equal(together[at], alone[0, :, 0])
    first = min(keys_from(past + row, window) for row in range(n))
    if first:
        garbage = keys.clone()
        garbage[:, :, :first] = torch.randn(garbage[:, :, :first].shape, generator=generator) * 100
        assert torch.equal(RowAttention(past, n, window)(q, garbage, values, scale), out)


def test_row_attention_without_batched_items_gives_the_same_rows(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 70, 8, generator=generator)
    keys, values = (torch.randn(2, 2, 256, 8, generator=generator) for _ in range(2))
    batched = RowAttention(50, 70)(q, keys, values, 0.3)
    monkeypatch.setattr(row_attention, "items_are_independent", lambda *shape: False)
    assert torch.equal(RowAttention(50, 70)(q, keys, values, 0.3), batched)


def test_row_attention_checks_its_shapes():
    attention = RowAttention(10, 3)
    assert attention.keys == 16 and [g[:3] for g in attention.groups] == [(0, 3, 16)]
    assert [g[:3] for g in RowAttention(60, 10).groups] == [(0, 4, KEY_BLOCK), (4, 10, 2 * KEY_BLOCK)]
    assert [g[:3] for g in RowAttention(14, 4).groups] == [(0, 2, 16), (2, 4, 32)]
    assert [keys_needed(end) for end in (1, 16, 17, 64, 65, 129)] == [16, 16, 32, 64, 128, 192]
    with pytest.raises(ValueError, match="does not fit"):
        short = torch.zeros(1, 2, 15, 8)
        attention(torch.zeros(1, 4, 3, 8), short, short, 1.0)
    with pytest.raises(ValueError, match="n >= 1"):
        RowAttention(0, 0)


@pytest.mark.parametrize("kv_heads, group", [(3, 3), (1, 9)])     # SmolLM2's item shape; one key head
def test_row_attention_batches_items_only_where_the_kernel_keeps_them_apart(monkeypatch, kv_heads, group):
    """Whatever this CPU's kernel does, the probe's answer decides the calls, and every row is the row
    alone: one call over every item where items are independent, else a call per item."""
    generator = torch.Generator().manual_seed(1)
    batch, past, n, d = 2, 10, 3, 64
    q = torch.randn(batch, kv_heads * group, n, d, generator=generator)
    keys, values = (torch.randn(batch, kv_heads, 32, d, generator=generator) for _ in range(2))
    independent = row_attention.items_are_independent(kv_heads, group, d)     # probed before counting
    real, calls = row_attention.F.scaled_dot_product_attention, []

    def counted(*args, **options):
        calls.append(args[0].shape[0])
        return real(*args, **options)

    monkeypatch.setattr(row_attention.F, "scaled_dot_product_attention", counted)
    out = RowAttention(past, n)(q, keys, values, d ** -0.5)
    items = batch * n
    assert calls == ([items] if independent else [1] * items)
    for b in range(batch):
        for row in range(n):
            alone = RowAttention(past + row, 1)(q[b:b + 1, :, row:row + 1], keys[b:b + 1], values[b:b + 1], d ** -0.5)
            assert torch.equal(alone, out[b:b + 1, :, row:row + 1])
