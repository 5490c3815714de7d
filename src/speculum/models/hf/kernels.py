"""C kernels compiled on this machine on first use, for its CPU, and cached.

Why: PyTorch's CPU kernels cannot multiply float32 rows by GGUF weight groups
(:mod:`~speculum.models.hf.grouped`), nor keep each row's sum in one order on AMX tiles
(:mod:`~speculum.models.hf.tiles`). These small kernels can; they are built with the machine's C compiler
(``-march=native``: the CPU's own instructions) and run on PyTorch's OpenMP threads.

A library is cached in speculum's cache folder by the hash of its source, the flags, the compiler's version
and the CPU's model and flags, so a change of any of them builds it again; the build lands by an atomic
rename, and an unwritable cache builds into a temporary folder for this process.

Example:
    >>> path = build("grouped", Path(__file__).with_name("grouped.c"))   # doctest: +SKIP
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..cpu import cpu_identity
from ..paths import cache_dir

__all__ = ["build", "FLAGS"]

FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]


def build(name: str, source: Path) -> Path:
    """The compiled library of ``source`` for this machine, built into the cache on first use.

    Raises RuntimeError naming the cause where there is no compiler or the source does not compile."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    identity = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join(FLAGS).encode(), version.encode(),
                                          cpu_identity().encode()])).hexdigest()[:20]
    folder = cache_dir() / "kernels"
    target = folder / f"{name}-{identity}.so"
    if target.is_file():
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=folder))
    except OSError:                     # an unwritable cache: build for this process only
        scratch = Path(tempfile.mkdtemp())
        folder = target = None
    built = scratch / f"{name}-{identity}.so"
    result = subprocess.run([compiler, *FLAGS, str(source), "-o", str(built)], capture_output=True, text=True,
                            timeout=300)
    if result.returncode:
        shutil.rmtree(scratch, ignore_errors=True)
        errors = [line for line in result.stderr.splitlines() if "error" in line] or [result.stderr]
        raise RuntimeError(f"the {name} kernel does not compile here: {errors[0].strip()}")
    if target is None:
        return built                    # a temporary folder holds it for this process
    os.replace(built, target)
    shutil.rmtree(scratch, ignore_errors=True)
    return target
