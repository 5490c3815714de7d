"""A C kernel of the library built twice, side by side: its source at a git revision and in the working tree,
with the flags the library compiles it with (what `row_kernels.py` and `attention_kernel.py` compare)."""
from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from speculum.models.hf.kernels.build import FLAGS  # noqa: E402

__all__ = ["ROOT", "baseline_and_now"]


def build(source: str, folder: Path, name: str, *, openmp: bool) -> ctypes.CDLL:
    """``source`` compiled into ``folder`` as ``name.so`` and loaded; without ``openmp``, one thread."""
    (folder / f"{name}.c").write_text(source)
    flags = [flag for flag in FLAGS if openmp or flag != "-fopenmp"]
    built = subprocess.run(["gcc", *flags, "-shared", str(folder / f"{name}.c"), "-o", str(folder / f"{name}.so")],
                           capture_output=True, text=True)
    if built.returncode:
        raise SystemExit(f"gcc could not build the {name} source:\n{built.stderr}")
    return ctypes.CDLL(str(folder / f"{name}.so"))


def baseline_and_now(path: str, revision: str, folder: Path, *, openmp: bool) -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """The kernel at ``path`` (from the repository's root) built from ``revision`` and from the working tree."""
    baseline = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:{path}"], check=True,
                              capture_output=True, text=True).stdout
    return (build(baseline, folder, "baseline", openmp=openmp),
            build((ROOT / path).read_text(), folder, "now", openmp=openmp))
