"""A guard against llama.cpp builds whose CPU kernels crash the process on this machine.

llama-cpp-python compiles llama.cpp with ``-march=native`` unless told otherwise. On a CPU with AMX
(Intel Sapphire Rapids and later) that build runs AMX matrix kernels, and in sandboxes that do not grant
the AMX tile state (containers, gVisor) they segfault on the first batch of two or more tokens — the
whole Python process dies with no message. So before a model is used, a build that reports AMX is tried
once in a child process on the GGUF itself; a crash there becomes a one-line error saying how to rebuild,
and success is remembered in speculum's cache (per library build and model file), so the probe costs
about a second once.
"""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from ..paths import cache_dir

__all__ = ["check_native_build", "CMAKE_ARGS", "LLAMACPP_REQUIREMENT", "REBUILD_COMMAND"]

# The one list of llama.cpp build flags: any x86-64 CPU with AVX2, never -march=native (whose AMX kernels
# are what crashes). `make install` reads this line, so keep it a single-line string literal.
CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
# The version the ``llamacpp`` extra pins (pyproject.toml; a test keeps the two equal).
LLAMACPP_REQUIREMENT = "llama-cpp-python==0.3.36"
# --no-cache-dir: pip must not reuse a wheel built with other flags.
REBUILD_COMMAND = f"CMAKE_ARGS='{CMAKE_ARGS}' pip install --force-reinstall --no-cache-dir {LLAMACPP_REQUIREMENT}"

# Loads the model and decodes a batch of four tokens: a batch (not one token) reaches the matrix kernels.
_PROBE = """
import sys
from llama_cpp import Llama
model = Llama(sys.argv[1], n_ctx=64, n_batch=64, n_ubatch=64, verbose=False)
tokens = model.tokenize(b"Hello there, world", add_bos=False)
model.eval((tokens * 4)[:4])
"""


def _library_file() -> Path | None:
    import llama_cpp  # the optional [llamacpp] extra: only a model being loaded gets here

    folder = Path(llama_cpp.__file__).parent / "lib"
    candidates = sorted(folder.glob("libggml-cpu*")) or sorted(folder.glob("libllama*"))
    return candidates[0] if candidates else None


def _marker(model_path: str) -> Path:
    library = _library_file()
    identity = [str(library), str(library.stat().st_mtime_ns) if library else "",
                os.path.abspath(model_path), str(os.stat(model_path).st_mtime_ns)]
    digest = hashlib.sha256("\n".join(identity).encode()).hexdigest()[:16]
    return cache_dir() / "llamacpp-probe" / f"ok-{digest}"


def check_native_build(model_path: str, system_info: str, *, command: list[str] | None = None) -> None:
    """Raise ``ImportError`` (one line, with the fix) if this llama.cpp build crashes on ``model_path``:
    the extra is installed but unusable, which callers report like a missing extra.

    Only builds whose ``system_info`` reports AMX are probed; the result is cached. ``command`` replaces
    the probe's command line (tests).
    """
    if "AMX" not in system_info:
        return
    marker = _marker(model_path)
    if marker.exists():
        return
    argv = command or [sys.executable, "-c", _PROBE, model_path]
    try:
        result = subprocess.run(argv, capture_output=True, timeout=300)
    except subprocess.TimeoutExpired:
        return  # inconclusive (a slow machine), not a crash: do not block the user
    if result.returncode < 0 or result.returncode in (128 + signal.SIGSEGV, 128 + signal.SIGILL):
        signum = -result.returncode if result.returncode < 0 else result.returncode - 128
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        raise ImportError(
            f"the installed llama-cpp-python build crashes on this machine ({name} in a test decode; its CPU kernels "
            f"use AMX, which this environment does not allow). Rebuild it for AVX2: {REBUILD_COMMAND}")
    if result.returncode == 0:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
