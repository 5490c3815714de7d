"""The compiled kernels' cache (speculum.models.hf.kernels.build and .cache).

Invariants: a library is found in the cache without running a compiler, and built again when its source or
the CPU changes; ``$CC`` is split as a shell splits it; a compiler's failure reaches the caller in full and
is recorded per compiler, so it is not tried again until the compiler changes or the record goes; a cache
folder or file that another user may write is never used (the kernels are built privately instead);
``SPECULUM_KERNELS=off`` turns every kernel off; a process loading a kernel maps one OpenMP runtime.
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from speculum.models.hf.kernels import amx_tiles, build, gguf_groups  # noqa: E402
from speculum.models.hf.kernels import cache as kernel_cache  # noqa: E402
from speculum.models.hf.kernels.amx_tiles import TileProduct  # noqa: E402
from speculum.models.hf.kernels.products import build_product  # noqa: E402

SOURCE = Path(gguf_groups.__file__).with_name("gguf_groups.c")
needs_compiler = pytest.mark.skipif(build.compiler_command() is None, reason="no C compiler")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder of this user's (mode 0755), as ``SPECULUM_CACHE``; CC unset."""
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    monkeypatch.setenv("SPECULUM_CACHE", str(folder))
    monkeypatch.delenv("CC", raising=False)
    return folder


def compiler_script(folder: Path, name: str, body: str) -> Path:
    """An executable shell script standing in for a compiler."""
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


# ------------------------------------------------------------------------------------------ identity
@needs_compiler
def test_a_cached_library_is_found_without_a_compiler_and_rebuilt_when_source_or_cpu_change(cache, tmp_path,
                                                                                            monkeypatch):
    built = build.build("grouped", SOURCE)
    assert built.parent == cache / "kernels" and built.is_file()
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))         # no compiler to run, nor to read a version of
    assert build.build("grouped", SOURCE) == built
    changed = tmp_path / "grouped.c"
    changed.write_bytes(SOURCE.read_bytes() + b"\n/* another release */\n")
    with pytest.raises(RuntimeError, match="no C compiler"):
        build.build("grouped", changed)
    monkeypatch.setattr(build, "cpu_identity", lambda: "model name: another CPU")
    with pytest.raises(RuntimeError, match="no C compiler"):
        build.build("grouped", SOURCE)


@needs_compiler
def test_cc_is_split_as_a_shell_splits_it(cache, monkeypatch):
    monkeypatch.setenv("CC", f"env '{build.compiler_command()[0]}'")
    built = build.build("grouped", SOURCE)
    assert built.is_file()
    record = kernel_cache.read_record(built.with_suffix(".json"))
    assert record["compiler"].startswith("env ")


# ------------------------------------------------------------------------------------------ failures
def test_a_compiler_failure_is_reported_in_full(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "/bin/false")
    with pytest.raises(RuntimeError, match=r"does not compile here: the compiler \(/bin/false\) exited 1 with no "
                                           r"message"):
        build.build("grouped", SOURCE)
    loud = compiler_script(tmp_path, "loud-cc", 'echo "grouped.c:1: error: no such intrinsic" >&2; exit 2')
    monkeypatch.setenv("CC", str(loud))
    with pytest.raises(RuntimeError, match="exited 2: grouped.c:1: error: no such intrinsic"):
        build.build("grouped", SOURCE)


def test_a_failure_is_recorded_per_compiler_and_retried_when_it_changes_or_its_record_goes(cache, tmp_path,
                                                                                          monkeypatch):
    tries = tmp_path / "tries"
    first = compiler_script(tmp_path, "first-cc", f'echo x >> {tries}; echo "error: broken" >&2; exit 1')
    second = compiler_script(tmp_path, "second-cc", f'echo y >> {tries}; exit 1')
    monkeypatch.setenv("CC", str(first))
    for _ in range(3):              # each call stands for a new process: only the record remembers
        with pytest.raises(RuntimeError, match="error: broken"):
            build.build("grouped", SOURCE)
    assert tries.read_text() == "x\n"
    with pytest.raises(RuntimeError, match="recorded in .*failed: delete it"):
        build.build("grouped", SOURCE)
    monkeypatch.setenv("CC", str(second))
    with pytest.raises(RuntimeError, match="exited 1 with no message"):
        build.build("grouped", SOURCE)
    assert tries.read_text() == "x\ny\n"
    monkeypatch.setenv("CC", str(first))
    for record in (cache / "kernels").glob("*.failed"):
        record.unlink()
    with pytest.raises(RuntimeError, match="error: broken"):
        build.build("grouped", SOURCE)
    assert tries.read_text() == "x\ny\nx\n"


def test_a_crashing_tiles_test_is_recorded_with_its_reason(tmp_path, monkeypatch):
    import subprocess

    library = tmp_path / "tiles-0.so"
    calls = []

    def crash(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, -4, b"", b"")

    monkeypatch.setattr(amx_tiles.subprocess, "run", crash)
    assert "crashed a test process (exit -4)" in amx_tiles.self_test(library)
    assert "crashed a test process (exit -4)" in amx_tiles.self_test(library)
    assert "recorded in" in amx_tiles.self_test(library)
    assert len(calls) == 1


# ------------------------------------------------------------------------------------------ trust
def foreign(path: Path, monkeypatch) -> None:
    """Make ``path`` belong to another user (as root: chown; else this process takes another uid)."""
    if os.getuid() == 0:
        os.chown(path, 65534, 65534)
    else:
        real = os.getuid()
        monkeypatch.setattr(kernel_cache.os, "getuid", lambda: real + 1)


@pytest.mark.parametrize("how", ["world-writable cache", "group-writable kernels", "foreign cache"])
def test_a_cache_folder_others_may_write_is_not_used(cache, monkeypatch, how):
    kernels_folder = cache / "kernels"
    kernels_folder.mkdir(mode=0o755)
    if how == "world-writable cache":
        cache.chmod(0o777)
    elif how == "group-writable kernels":
        kernels_folder.chmod(0o775)
    else:
        foreign(cache, monkeypatch)
    planted = kernels_folder / f"{build.library_stem('grouped', SOURCE)}.so"
    planted.write_bytes(b"not a library")
    where = kernel_cache.kernel_folder()
    assert where.private and where.distrust and where.path != kernels_folder
    assert ("other users" in where.distrust) != (how == "foreign cache")
    if build.compiler_command() is not None:
        built = build.build("grouped", SOURCE)
        assert built != planted and built.is_relative_to(where.path)
        assert built.read_bytes() != b"not a library"


@needs_compiler
def test_a_library_others_may_write_is_built_again(cache):
    folder = cache / "kernels"
    folder.mkdir(mode=0o755)
    planted = folder / f"{build.library_stem('grouped', SOURCE)}.so"
    planted.write_bytes(b"not a library")
    planted.chmod(0o666)
    assert build.build("grouped", SOURCE) == planted
    assert planted.read_bytes() != b"not a library"
    assert stat.S_IMODE(planted.stat().st_mode) == 0o755


def test_a_planted_tiles_pass_does_not_skip_the_child_test(tmp_path, monkeypatch):
    import platform
    import subprocess

    library = tmp_path / "tiles-0.so"
    planted = tmp_path / f"tiles-0.{platform.release()}.passed"
    planted.touch()
    planted.chmod(0o666)
    calls = []

    def child(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 3, b"", b"")

    monkeypatch.setattr(amx_tiles.subprocess, "run", child)
    assert "not granted" in amx_tiles.self_test(library) and len(calls) == 1


# ------------------------------------------------------------------------------------------ off
@pytest.mark.parametrize("value", ["off", "0", "OFF "])
def test_kernels_off_takes_every_fallback(monkeypatch, value):
    gguf_groups.kernel_unavailable(), amx_tiles.tiles_unavailable()      # whatever this machine has, loaded first
    monkeypatch.setenv("SPECULUM_KERNELS", value)
    assert "SPECULUM_KERNELS" in build.kernels_disabled()
    assert "SPECULUM_KERNELS" in gguf_groups.kernel_unavailable()
    assert "SPECULUM_KERNELS" in amx_tiles.tiles_unavailable()
    assert gguf_groups.grouped_run([gguf_groups.pack("q8_0", np.zeros((16, 34), np.uint8))]) is None
    with pytest.raises(RuntimeError, match="SPECULUM_KERNELS"):
        TileProduct(torch.zeros(16, 32, dtype=torch.bfloat16))
    product = build_product([torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)])
    assert not isinstance(product.run, TileProduct) and product.rows_alone


@pytest.mark.parametrize("value", ["", "on", "1"])
def test_kernels_are_on_unless_turned_off(monkeypatch, value):
    monkeypatch.setenv("SPECULUM_KERNELS", value)
    assert build.kernels_disabled() is None


# ------------------------------------------------------------------------------------------ OpenMP
OPENMP = re.compile(r"lib(gomp|iomp5|omp)(-\w+)?\.so(\.\d+)*")


def openmp_files() -> set[str]:
    """The OpenMP runtime files mapped into this process."""
    names = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and OPENMP.fullmatch(Path(parts[5]).name):
            names.add(os.path.realpath(parts[5]))
    return names


@pytest.mark.skipif(gguf_groups.kernel_unavailable() is not None, reason="no grouped kernel here")
def test_a_loaded_kernel_shares_pytorchs_openmp_runtime():
    assert gguf_groups.kernel_unavailable() is None
    assert len(openmp_files()) == 1, openmp_files()


@needs_compiler
def test_a_library_links_the_openmp_runtime_pytorch_loaded(cache):
    """By its file: a runtime of another name (a wheel's renamed copy) is still the one thread pool."""
    runtime = build.openmp_runtime()
    if runtime is None:
        pytest.skip("PyTorch loaded no OpenMP runtime here")
    built = build.build("grouped", SOURCE)
    assert kernel_cache.read_record(built.with_suffix(".json"))["openmp"] == str(runtime)
