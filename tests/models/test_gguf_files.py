"""GGUF files checked before any conversion (speculum.models.gguf_files).

Invariants: a file the format's own writer made is read back with its architecture and tensor types; a
file that is not GGUF, or any cut of a GGUF file short of its end, is refused in one line before anything
is converted; an architecture or quant type transformers cannot read is named with the way out; the cache
key follows the file's content, not its path.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from speculum.models.gguf_files import GGUFInfo, cache_key, inspect_gguf, is_gguf_file, unreadable_reason  # noqa: E402
from speculum.validation import InputError  # noqa: E402
from support.gguf_writer import write_gguf  # noqa: E402


def test_a_written_file_reads_back(tmp_path):
    info = inspect_gguf(write_gguf(tmp_path / "tiny.gguf"))
    assert (info.architecture, info.name, info.tensors) == ("llama", "tiny", 3)
    assert info.tensor_types == {"F32": 2, "Q8_0": 1}
    assert unreadable_reason(info) is None


def test_a_file_that_is_not_gguf_is_refused_by_its_magic(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text('{"model_type": "llama"}')
    assert not is_gguf_file(path) and not is_gguf_file(tmp_path / "missing.gguf")
    with pytest.raises(InputError, match="not a GGUF file"):
        inspect_gguf(path)


@pytest.mark.parametrize("fraction", [0.0005, 0.01, 0.3, 0.7, 0.99])
def test_every_cut_short_of_the_end_is_refused_before_conversion(tmp_path, fraction):
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:max(4, int(len(whole) * fraction))])
    with pytest.raises(InputError) as caught:
        inspect_gguf(cut)
    message = str(caught.value)
    assert "\n" not in message and ("truncated" in message or "not a complete GGUF" in message)


def test_what_transformers_cannot_read_is_named_with_the_way_out(tmp_path):
    path = tmp_path / "x.gguf"
    unknown = GGUFInfo(path, "rwkv7", "x", {"F32": 3}, 3)
    assert "'rwkv7'" in unreadable_reason(unknown) and "--backend llamacpp" in unreadable_reason(unknown)
    odd_type = GGUFInfo(path, "llama", "x", {"F32": 3, "Q4_0_4_4": 2}, 5)
    assert "Q4_0_4_4" in unreadable_reason(odd_type) and "--backend llamacpp" in unreadable_reason(odd_type)
    assert unreadable_reason(GGUFInfo(path, "gemma3", "x", {"Q4_K": 1, "Q6_K": 1, "Q5_0": 1}, 3)) is None


def test_the_cache_key_follows_the_content_not_the_path(tmp_path):
    first = write_gguf(tmp_path / "a.gguf")
    (tmp_path / "moved").mkdir()
    moved = Path(shutil.copy(first, tmp_path / "moved" / "a.gguf"))
    (tmp_path / "b").mkdir()
    other = write_gguf(tmp_path / "b" / "a.gguf", seed=1)
    assert cache_key(first) == cache_key(moved)
    assert cache_key(first) != cache_key(other)
    assert cache_key(first).startswith("gguf-a-")
