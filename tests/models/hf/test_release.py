"""Releasing the unpacked block weights once the fused forward holds them packed.

Invariants: every call of the model returns bitwise what it returned before the release; drafts derived
from the weights are refused after it with a clear error; pages are dropped only inside private file
mappings, and a dropped page reads back as the file's bytes; trimming the heap gives back blocks the
allocator kept after they were freed.
"""
from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.hf_tiny import save_tiny_model  # noqa: E402
from speculum.drafts.twins import bf16_twin, int8_twin, truncated_draft  # noqa: E402
from speculum.models.hf import HFModel  # noqa: E402
from speculum.models.memory.pages import drop_mapped_pages  # noqa: E402
from speculum.validation import InputError  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


def test_release_changes_no_answer_and_refuses_derived_drafts(tmp_path):
    model = HFModel.from_pretrained(save_tiny_model(tmp_path / "model", layers=2))
    prompts = [[5, 9, 3], [4, 4, 7, 12]]
    session = model.start(prompts[0])
    before = (model.next_logprobs(prompts), model.score_sequences(prompts, prompt=[6]),
              session.extend([8, 10]))
    freed = model.release_unfused_weights()
    assert freed >= 0 and all(not layer.weight.numel() for block in model.module.get_decoder().layers
                              for layer in (block.self_attn.q_proj, block.mlp.down_proj))
    session.rollback(2)
    after = (model.next_logprobs(prompts), model.score_sequences(prompts, prompt=[6]), session.extend([8, 10]))
    for was, now in zip(before, after):
        assert np.array_equal(was, now)
    for derive in (int8_twin, bf16_twin, lambda target: truncated_draft(target, 1)):
        with pytest.raises(InputError, match="derive drafts from it before"):
            derive(model)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are dropped on Linux only")
def test_release_drops_the_packed_heads_pages_and_the_tied_embedding_reads_them_back(tmp_path):
    # 400 words: a tied head of 403 x 32 floats spans a dozen pages of the mapped checkpoint.
    words = [f"w{i}" for i in range(400)]
    model = HFModel.from_pretrained(save_tiny_model(tmp_path / "model", words=words, layers=1))
    head = model.module.get_output_embeddings().weight
    assert head.data_ptr() == model.module.get_input_embeddings().weight.data_ptr()
    prompts = [[5, 9, 300], [4, 402, 7, 12]]
    before = model.next_logprobs(prompts)
    blocks = sum(layer.weight.numel() * 4 for block in model.module.get_decoder().layers
                 for layer in (*(getattr(block.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                               block.mlp.gate_proj, block.mlp.up_proj, block.mlp.down_proj))
    freed = model.release_unfused_weights()
    assert freed >= head.numel() * 4 - 2 * mmap.PAGESIZE       # the head's whole pages, besides the blocks'
    assert freed <= head.numel() * 4 + blocks
    assert np.array_equal(model.next_logprobs(prompts), before)  # embedding rows read back from the file


def test_pages_are_dropped_only_in_private_file_mappings(tmp_path):
    page = mmap.PAGESIZE
    path = tmp_path / "weights.bin"
    content = np.arange(4 * page // 4, dtype=np.float32)
    content.tofile(path)
    mapped = np.memmap(path, dtype=np.float32, mode="c")      # private, copy-on-write: as safetensors maps
    assert mapped.sum() == content.sum()                        # touched: resident
    address = mapped.ctypes.data
    assert drop_mapped_pages([(address, mapped.nbytes)]) == mapped.nbytes
    assert np.array_equal(np.asarray(mapped), content)         # read back from the file
    anonymous = np.ones(4 * page // 8)
    assert drop_mapped_pages([(anonymous.ctypes.data, anonymous.nbytes)]) == 0
    assert anonymous.sum() == len(anonymous)
    assert drop_mapped_pages([(address + 1, page)]) == 0        # no whole page inside


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc/self/status")
def test_trimming_the_heap_gives_back_freed_blocks_the_allocator_kept():
    import subprocess

    # In a fresh process: 150 MB of heap blocks (below glibc's mmap threshold), each followed by a small
    # live block so that freeing them cannot shrink the heap; resident memory falls only once trimmed.
    probe = """
from speculum.models.memory.allocator import trim_heap
def rss():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) // 1024
big, keep = [], []
for _ in range(1500):
    big.append(bytearray(100_000))
    keep.append(bytearray(600))
big.clear()
freed = rss()
print(trim_heap(), freed - rss())
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "True" and int(out[1]) > 100
