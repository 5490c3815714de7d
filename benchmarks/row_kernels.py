"""The row operations' C kernel (`row_ops.c`) against its source at another git revision, side by side.

Both sources are built with the flags the library uses (`-march=native`, no OpenMP: one thread, so the two
builds cannot disturb each other's thread pools), and each operation is timed at decode-sized calls
(SmolLM2-135M's widths: 576 features, 1536 gate inputs, 9 + 2 x 3 heads of 64, a 49,152-token vocabulary),
the two builds interleaved, best of `--repeats`. Every output is compared bitwise: a kernel change that
moves a bit is reported, since row-canonical rows are the contract.

    .venv/bin/python benchmarks/row_kernels.py --against HEAD~1
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import torch

from kernel_builds import baseline_and_now  # noqa: E402  (benchmarks/kernel_builds.py)
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)

SOURCE = "src/speculum/models/hf/kernels/row_ops.c"

I64, F32 = ctypes.c_int64, ctypes.c_float


def calls(library: ctypes.CDLL, rows: int) -> dict:
    """Each operation as (a call, its outputs), on inputs made from one seed."""
    pointer = lambda tensor: ctypes.c_void_p(tensor.data_ptr() if tensor is not None else 0)  # noqa: E731
    generator = torch.Generator().manual_seed(0)
    gate_up, gated = torch.randn(rows, 2 * 1536, generator=generator), torch.empty(rows, 1536)
    hidden, weight = torch.randn(rows, 576, generator=generator), torch.randn(576, generator=generator)
    normed, delta = torch.empty(rows, 576), torch.randn(rows, 576, generator=generator)
    summed, resnormed = hidden.clone(), torch.empty(rows, 576)
    qkv0 = torch.randn(rows, 960, generator=generator)
    qkv, cos, sin = qkv0.clone(), torch.randn(rows, 64, generator=generator), torch.randn(rows, 64, generator=generator)
    logits, mass = torch.randn(rows, 49152, generator=generator) * 5, torch.empty(rows, dtype=torch.float64)

    def residual_norm() -> None:
        summed.copy_(hidden)
        library.rowops_residual_norm(pointer(summed), pointer(delta), pointer(weight), F32(1e-5), pointer(resnormed),
                                     None, F32(0.0), I64(rows), I64(576), 1)

    def rotate() -> None:
        qkv.copy_(qkv0)
        library.rowops_rotate(pointer(qkv), I64(rows), I64(960), I64(12), I64(64), pointer(cos), I64(64),
                              pointer(sin), I64(64), None, None, F32(0.0), 1)

    return {
        "gated (SiLU x up)": (lambda: library.rowops_gated(pointer(gate_up), pointer(gated), I64(rows), I64(1536),
                                                           0, 1), [gated]),
        "norm": (lambda: library.rowops_norm(pointer(hidden), pointer(weight), F32(1e-5), pointer(normed),
                                             I64(rows), I64(576), 1), [normed]),
        "residual + norm": (residual_norm, [summed, resnormed]),
        "rotate (q, k)": (rotate, [qkv]),
        "log-sum-exp (head)": (lambda: library.rowops_log_mass(pointer(logits), I64(rows), I64(49152),
                                                               pointer(mass), None, 1), [mass]),
    }


def best_seconds(call, repeats: int, inner: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(inner):
            call()
        best = min(best, (time.perf_counter() - started) / inner)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="HEAD~1", help="the git revision whose row_ops.c is the baseline")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        libraries = baseline_and_now(SOURCE, args.against, Path(folder), openmp=False)
        print(f"# row_ops.c at {args.against} against the working tree, {cpu_name()}, one thread, "
              f"best of {args.repeats}\n")
        print("| operation | rows | before, us | now, us | speed-up | same bits |")
        print("|---|---:|---:|---:|---:|---|")
        for rows in args.rows:
            before, now = (calls(library, rows) for library in libraries)
            for name in before:
                inner = max(1, 2000 // rows if "log" not in name else 100 // rows)
                seconds = [float("inf")] * 2
                for _ in range(2):                                     # interleaved: drift hits both
                    for side, table in enumerate((before, now)):
                        seconds[side] = min(seconds[side], best_seconds(table[name][0], args.repeats, inner))
                same = all(torch.equal(a.view(torch.int64 if a.dtype == torch.float64 else torch.int32),
                                       b.view(torch.int64 if b.dtype == torch.float64 else torch.int32))
                           for a, b in zip(before[name][1], now[name][1]))
                print(f"| {name} | {rows} | {seconds[0] * 1e6:.1f} | {seconds[1] * 1e6:.1f} | "
                      f"{seconds[0] / seconds[1]:.2f}x | {'yes' if same else '**no**'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
