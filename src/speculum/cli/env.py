"""``speculum env``: what this machine runs, and which dtype to pick on it, without loading a model.

It reports the versions that matter, the CPU's instruction sets, whether each of speculum's compiled
kernels runs here (and why not, in one line), and for each dtype of the PyTorch backend whether it pays on
this CPU. The kernels are built on first use (about a second each), so the first call compiles them; the
bfloat16 tiles are also tried once in a child process. Paste its output (or ``--json``) into a bug report.

Example:
    $ speculum env
    $ speculum env --json | python -m json.tool
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
from typing import Any

from speculum import __version__
from speculum.models.cpu import KERNEL_FLAGS, cpu_flags, cpu_name

__all__ = ["register", "run", "environment"]



def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "env",
        help="this machine's kernels and which --dtype pays on it (no model loaded)",
        description=(
            "Print the versions, the CPU's instruction sets, whether each compiled kernel runs here (float32 "
            "products from GGUF weight groups; bfloat16 products on AMX tiles or by AVX-512 BF16 dot "
            "products) and, for each --dtype, whether it pays on this CPU. The first call builds the kernels (about a second each)."
        ),
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.set_defaults(handler=run)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """The report as a dict: ``versions``, ``cpu``, ``kernels`` (each ``{"runs": bool, "why_not": str |
    None}``), ``dtypes`` (each ``{"slower": bool, "note": str}``: slower than float32 here, and why or what
    it is good for), ``cache``, ``kernel_cache`` (``{"folder", "trusted", "why_not"}``: where the kernels
    are built, and why not in the cache where another user may write to it) and ``kernels_off`` (why the
    compiled kernels are off, ``SPECULUM_KERNELS=off``, else None). The PyTorch entries are None without
    the ``[llm]`` extra."""
    from speculum.models.paths import cache_dir  # the models package loads numpy and more: only when asked

    report: dict[str, Any] = {
        "versions": {"speculum": __version__, "python": platform.python_version(),
                     **{name: _version(name) for name in ("torch", "transformers", "llama-cpp-python")}},
        "cpu": {"name": cpu_name(), "cores": os.cpu_count()},
        "kernels": None, "dtypes": None, "cache": str(cache_dir()), "kernel_cache": None, "kernels_off": None,
    }
    try:
        import torch  # the [llm] extra: without it there is no PyTorch backend to report on
    except ImportError:
        return report
    from speculum.models.hf.kernels.gguf_groups import kernel_unavailable  # the backend's modules import torch
    from speculum.models.hf.kernels.cache import kernel_folder  # (as above)
    from speculum.models.hf.kernels.build import kernels_disabled  # (as above)
    from speculum.models.hf.precision import DTYPES, dtype_advice  # (as above)
    from speculum.models.hf.kernels.onednn import onednn_available  # (as above)
    from speculum.models.hf.kernels.amx_tiles import tiles_unavailable  # (as above)
    from speculum.models.hf.kernels.bf16_dot import dot_unavailable  # (as above)
    from speculum.models.hf.kernels.q8_groups import q8_unavailable  # (as above)
    from speculum.models.hf.kernels.attention_rows import attention_unavailable  # (as above)
    from speculum.models.hf.kernels.row_ops import row_ops_unavailable  # (as above)
    from speculum.models.hf.kernels.call_list import call_list_unavailable  # (as above)

    flags = cpu_flags()
    report["cpu"]["flags"] = {flag: flag in flags for flag in KERNEL_FLAGS} if flags else None
    report["cpu"]["torch_threads"] = torch.get_num_threads()

    def kernel(reason: str | None) -> dict[str, Any]:
        return {"runs": reason is None, "why_not": reason}

    where = kernel_folder()
    report["kernel_cache"] = {"folder": str(where.path), "trusted": where.distrust is None,
                              "why_not": where.distrust}
    report["kernels_off"] = kernels_disabled()
    report["kernels"] = {
        "onednn": kernel(None if onednn_available() else "this torch build has no oneDNN"),
        "float32 from GGUF groups": kernel(kernel_unavailable()),
        "bfloat16 on AMX tiles": kernel(tiles_unavailable()),
        "bfloat16 by AVX-512 BF16 dot products": kernel(dot_unavailable()),
        "8-bit products on GGUF groups": kernel(q8_unavailable()),
        "attention, every row of a layer in one call": kernel(attention_unavailable()),
        "row-wise work between products (norms, rotation, gate)": kernel(row_ops_unavailable()),
        "a forward's kernel calls in one call from Python": kernel(call_list_unavailable()),
    }
    report["dtypes"] = {dtype: _dtype_note(dtype, dtype_advice(dtype), report["kernels"]) for dtype in DTYPES}
    return report


def _dtype_note(dtype: str, advice: str | None, kernels: dict[str, Any]) -> dict[str, Any]:
    """``{"slower": bool, "note": str}`` for ``--dtype dtype`` on this machine."""
    if advice is not None:
        return {"slower": True, "note": advice}
    if dtype == "float32":
        note = "the reference target" + (
            "; the embedded model multiplies by its GGUF weight groups" if kernels["float32 from GGUF groups"]["runs"]
            else "")
    elif dtype == "q8":
        note = "GGUF weight groups times 8-bit activations, integer products (GGUF files and the embedded model)"
    elif dtype == "bfloat16" and kernels["bfloat16 on AMX tiles"]["runs"]:
        note = ("products on AMX tiles, many rows a call: pick it for enumeration and batched serving "
                "(docs/backends.md)")
    elif dtype == "bfloat16" and kernels["bfloat16 by AVX-512 BF16 dot products"]["runs"]:
        note = "products by AVX-512 BF16 dot products, many rows a call, float32 sums"
    else:
        note = "multiplied natively by this CPU"
    return {"slower": False, "note": note}


def _text(report: dict[str, Any]) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in report["versions"].items() if version)
    cpu = report["cpu"]
    lines = [versions, f"CPU: {cpu['name']}, {cpu['cores']} cores"]
    if cpu.get("flags"):
        lines.append("  " + "  ".join(f"{flag} {'yes' if present else 'no'}" for flag, present in cpu["flags"].items()))
    if report["kernels"] is None:
        lines.append("PyTorch backend: not installed (pip install 'speculum[llm]')")
    else:
        lines.append(f"PyTorch threads: {cpu['torch_threads']}")
        lines.append("kernels:" + (f" {report['kernels_off']}: every product on PyTorch's kernels"
                                   if report["kernels_off"] else ""))
        for name, state in report["kernels"].items():
            lines.append(f"  {name}: " + ("runs" if state["runs"] else f"unavailable ({state['why_not']})"))
        lines.append("dtypes (--dtype):")
        for dtype, state in report["dtypes"].items():
            lines.append(f"  {dtype}: " + (f"slower here: {state['note']}" if state["slower"] else state["note"]))
    lines.append(f"cache: {report['cache']}")
    trust = report.get("kernel_cache")
    if trust and not trust["trusted"]:
        lines.append(f"  not safe to share ({trust['why_not']}): kernels are built for each process in a "
                     f"private folder ({trust['folder']})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = environment()
    print(json.dumps(report) if args.json else _text(report))
    return 0
