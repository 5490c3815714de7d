"""The fused forward's blocks with their glue compiled (speculum.models.hf.forward.glued), on every family.

Invariants, where the row and attention kernels build: a model takes the compiled path; its logits equal
the PyTorch path's to float32 rounding, in batches of several sequences and packed; packed sequences on
caches of their own equal each alone, bitwise; greedy output is the same on both paths; buffers kept for a
row count give bitwise the rows fresh buffers give, and forwards from two threads each get their own.
"""
from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.hf_tiny import FAMILIES, save_tiny_model  # noqa: E402
from speculum.decoding.speculative import generate  # noqa: E402
from speculum.models.hf import HFModel  # noqa: E402
from speculum.models.hf.kernels.attention_rows import attention_unavailable  # noqa: E402
from speculum.models.hf.kernels.row_ops import row_ops_unavailable  # noqa: E402
from speculum.models.hf.kv.cache import OwnCache  # noqa: E402

pytestmark = pytest.mark.skipif(row_ops_unavailable() is not None or attention_unavailable() is not None,
                                reason=f"no compiled glue: {row_ops_unavailable() or attention_unavailable()}")


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory) -> HFModel:
    path = save_tiny_model(tmp_path_factory.mktemp(request.param) / "model", family=request.param, max_context=256)
    loaded = HFModel.from_pretrained(path)
    assert loaded.fused_forward and loaded.fused.row_ops is not None
    return loaded


class PyTorchPath:
    """The model's fused forward on PyTorch's operations and attention for the duration."""

    def __init__(self, model: HFModel) -> None:
        self.fused = model.fused

    def __enter__(self) -> None:
        self.saved = self.fused.row_ops
        self.fused.row_ops = None

    def __exit__(self, *exc) -> None:
        self.fused.row_ops = self.saved


def close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    assert float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())


def test_batches_and_extensions_give_the_pytorch_paths_logits(model):
    tokens = torch.randint(3, model.vocab_size, (2, 70), generator=torch.Generator().manual_seed(0))
    runs = []
    for path in ("glued", "pytorch"):
        with PyTorchPath(model) if path == "pytorch" else contextlib.nullcontext():
            cache = OwnCache()
            whole = model.fused(tokens[:, :50], cache)
            runs.append(torch.cat([whole, model.fused(tokens[:, 50:], cache, keep=3)], dim=1))
    close(*runs)


def test_packed_sequences_on_their_own_caches_are_each_alone_and_the_pytorch_paths(model):
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, model.vocab_size, (n,), generator=generator).tolist() for n in (5, 1, 40)]
    packed = model.fused.forward_packed(sequences, [OwnCache() for _ in sequences])
    for tokens, rows in zip(sequences, packed):
        assert torch.equal(model.fused(torch.tensor([tokens]), OwnCache())[0], rows)
    with PyTorchPath(model):
        reference = model.fused.forward_packed(sequences, [OwnCache() for _ in sequences])
    for ours, theirs in zip(packed, reference):
        close(ours, theirs)


def test_greedy_output_is_the_same_on_both_paths(model):
    prompt = [3, 4, 5, 6]
    glued = generate(model, prompt, max_new_tokens=24, temperature=0, eos_token_id=None).tokens
    with PyTorchPath(model):
        pytorch = generate(model, prompt, max_new_tokens=24, temperature=0, eos_token_id=None).tokens
    assert glued == pytorch



class Unbound:
    """Kept buffers that are never available: every forward binds buffers of its own."""

    def get(self, rows: int) -> None:
        return None


@pytest.mark.parametrize("rows", [1, 4, 64, 65])
def test_kept_buffers_give_fresh_buffers_rows_bitwise(model, monkeypatch, rows):
    tokens = torch.randint(3, model.vocab_size, (1, 80), generator=torch.Generator().manual_seed(rows))
    results = []
    for bound in (True, False):
        if not bound:
            monkeypatch.setattr(model.fused, "bound_blocks", Unbound())
        cache = OwnCache()
        first = model.fused(tokens[:, :10], cache)
        again = [model.fused(tokens[:, 10 + i * rows:10 + (i + 1) * rows], cache) for i in range(2) if 10 + (i + 1) * rows <= 80]
        results.append(torch.cat([first, *again], dim=1))
    assert torch.equal(*results)


def test_row_counts_taking_turns_on_the_shared_buffers_give_fresh_buffers_rows(model, monkeypatch):
    """Every kept row count binds the first rows of one set of buffers: forwards of counts taking turns (a
    server's steps) give bitwise what buffers of their own give, and each count is bound once."""
    counts = [5, 2, 9, 5, 1, 9, 2]
    generator = torch.Generator().manual_seed(11)
    sequences = [torch.randint(3, model.vocab_size, (1, n), generator=generator) for n in counts]
    model.fused.bound_blocks.shapes.clear()
    kept = [model.fused(tokens, OwnCache()) for tokens in sequences]
    assert sorted(model.fused.bound_blocks.shapes) == sorted(set(counts))
    monkeypatch.setattr(model.fused, "bound_blocks", Unbound())
    fresh = [model.fused(tokens, OwnCache()) for tokens in sequences]
    assert all(torch.equal(a, b) for a, b in zip(kept, fresh))


def test_forwards_from_two_threads_get_their_own_rows(model):
    from concurrent.futures import ThreadPoolExecutor

    generator = torch.Generator().manual_seed(7)
    sequences = [torch.randint(3, model.vocab_size, (1, 3), generator=generator) for _ in range(24)]
    alone = [model.fused(tokens, OwnCache()) for tokens in sequences]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda tokens: model.fused(tokens, OwnCache()), sequences))
    assert all(torch.equal(a, b) for a, b in zip(alone, together))
