"""The attention kernel (`attention_rows.c`) against its source at another git revision, side by side.

Both sources are built with the flags the library uses (`-march=native`, OpenMP) and called through the
arguments the library passes (`AttentionRows`) at decode shapes of SmolLM2-135M (9 query heads sharing 3 key/value
heads of 64, 30 layers, `--keys` keys of context): 8 sequences of one row (plain decoding) or of 4 rows
(verification blocks), each layer's keys and values in a store of its own, as a packed step reads them
(`distinct`), or every row reading one sequence's keys, which then stay in the cache (`one sequence`: the
arithmetic alone). The two builds alternate call by call, medians; every output is compared bitwise, since
row-canonical rows are the contract.

    .venv/bin/python benchmarks/attention_kernel.py --against HEAD~1
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kernel_builds import baseline_and_now  # noqa: E402  (benchmarks/kernel_builds.py)
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)

SOURCE = "src/speculum/models/hf/kernels/attention_rows.c"

LAYERS, SEQUENCES, HEADS, KV_HEADS, DIM = 30, 8, 9, 3, 64
I64, F32, POINTER = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def attend(function, positions: torch.Tensor, offsets: torch.Tensor, q: torch.Tensor, keys: torch.Tensor,
           values: torch.Tensor, out: torch.Tensor) -> None:
    """One layer's call, as ``AttentionRows`` makes it: rows ``q (rows, heads, dim)`` at ``positions``, each
    reading keys 0 .. its position at ``offsets`` (its slot times the store's first stride)."""
    pointer = lambda tensor: POINTER(tensor.data_ptr())  # noqa: E731
    first = torch.zeros_like(positions)
    if function(I64(q.shape[0]), I64(HEADS), I64(KV_HEADS), I64(DIM), pointer(q), I64(q.stride(0)), pointer(keys),
                pointer(values), I64(keys.stride(1)), pointer(offsets), pointer(first), pointer(positions),
                F32(DIM ** -0.5), pointer(out), None, None, I64(0), ctypes.c_int(torch.get_num_threads())):
        raise MemoryError("the attention kernel could not allocate its score buffers")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="HEAD~1", help="the git revision whose attention_rows.c is the baseline")
    parser.add_argument("--keys", type=int, default=290, help="keys of context a sequence (default: 290)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    capacity = args.keys + 8
    stores = [(torch.randn(SEQUENCES, KV_HEADS, capacity, DIM, generator=generator),
               torch.randn(SEQUENCES, KV_HEADS, capacity, DIM, generator=generator)) for _ in range(LAYERS)]
    with tempfile.TemporaryDirectory() as folder:
        functions = [library.attention_rows
                     for library in baseline_and_now(SOURCE, args.against, Path(folder), openmp=True)]
        for function in functions:
            function.restype = ctypes.c_int
        print(f"# attention_rows.c at {args.against} against the working tree, {cpu_name()}, "
              f"{torch.get_num_threads()} threads, {LAYERS} layers of {args.keys} keys, median of {args.repeats}\n")
        print("| rows | keys read | before, ms (30 layers) | now, ms | speed-up | same bits |")
        print("|---|---|---:|---:|---:|---|")
        for block in (1, 4):
            for shared in (False, True):
                positions = [args.keys - block + r for _ in range(SEQUENCES) for r in range(block)]
                slots = [0 if shared else s for s in range(SEQUENCES) for _ in range(block)]
                positions_tensor = torch.tensor(positions, dtype=torch.int64)
                offsets = torch.tensor(slots, dtype=torch.int64) * stores[0][0].stride(0)
                q = torch.randn(len(positions), HEADS, DIM, generator=generator)
                outs = [torch.empty_like(q), torch.empty_like(q)]
                times: list[list[float]] = [[], []]
                for repeat in range(args.repeats):
                    for side in ((0, 1) if repeat % 2 else (1, 0)):          # alternating: drift hits both
                        started = time.perf_counter()
                        for keys, values in stores:
                            attend(functions[side], positions_tensor, offsets, q, keys, values, outs[side])
                        times[side].append(time.perf_counter() - started)
                before, now = (statistics.median(t) * 1e3 for t in times)
                same = torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))
                print(f"| {SEQUENCES} x {block} | {'one sequence' if shared else 'distinct'} | {before:.2f} | "
                      f"{now:.2f} | {before / now:.2f}x | {'yes' if same else '**no**'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
