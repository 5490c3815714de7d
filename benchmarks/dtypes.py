"""The target forward at the memory limit, per dtype, on SmolLM2-135M-Instruct (PyTorch backend).

For each dtype (`float32`, `bfloat16`, `int8`, ...) side by side in one run, in alternating rounds:

- **the single-token decode step**: median ms per token of plain greedy decoding, the bytes of weights the
  step reads (every parameter once), and so the effective GB/s, beside the machine's memory bandwidth
  measured here (a STREAM-like triad `a = b + s * c` on arrays far larger than the caches, NumPy);
- **quality against float32** on a fixed text set: the share of positions where the greedy token (the
  argmax of the teacher-forced row) agrees, and the mean KL(float32 || dtype) per token, in nats;
- **enumeration**: prefixes per second of the exact index (`AutoregressiveEnumerable.top_k` of two-token
  continuations), whose answers are exact for each dtype's own target, in alternating rounds too, and its
  ratio to the first dtype's (the median of each round's ratio);
- **the products per row**: the matrix products of one forward (every layer's and the head's, each one
  kernel call) at 1 to 155 rows, in ms and GFLOP/s: a verification of n tokens or an enumeration level
  multiplies n or hundreds of rows, and each dtype's kernels pay for rows differently.

The process keeps freed memory for reuse (`keep_freed_memory`), as the `speculum` command does.

    .venv/bin/python benchmarks/dtypes.py                              # float32 bfloat16 int8
    .venv/bin/python benchmarks/dtypes.py --dtypes float32 int8 --rounds 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from counting import CountingModel  # noqa: E402  (benchmarks/counting.py)
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)

import speculum  # noqa: E402
from speculum.cli.demo import PASSAGE  # noqa: E402
from speculum.enumeration import AutoregressiveEnumerable  # noqa: E402
from speculum.models.memory.allocator import keep_freed_memory  # noqa: E402

TEXTS = [PASSAGE, "The quick brown fox jumps over the lazy dog. " * 4,
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
         "Question: What is the capital of France?\nAnswer: The capital of France is Paris, on the Seine."]


def triad_gb_per_s(megabytes: int = 512, repeats: int = 5) -> float:
    """STREAM's triad: three arrays of ``megabytes`` / 3 each, best of ``repeats`` (bytes moved: 3 per
    element read or written, 8 bytes each)."""
    n = megabytes * 1024 * 1024 // 8 // 3
    b, c = np.random.default_rng(0).random(n), np.random.default_rng(1).random(n)
    a = np.empty_like(b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.multiply(c, 3.0, out=a)
        np.add(a, b, out=a)
        best = min(best, time.perf_counter() - start)
    # multiply reads c and writes a, add reads a and b and writes a: 5 passes of 8-byte elements.
    return 5 * 8 * n / best / 1e9


def weight_bytes(model) -> int:
    """The weight bytes a decode step reads: a layer multiplied by its GGUF groups counts their bytes."""
    import torch  # with the llm extra

    from speculum.models.hf.kernels.gguf_groups import GROUPS

    module = model.module if hasattr(model, "module") else model.model
    seen, total = set(), 0
    for layer in module.modules():
        groups = getattr(layer, GROUPS, None)
        if groups is not None and layer.weight.dtype == torch.float32:
            seen.add(layer.weight.data_ptr())
            total += groups.nbytes
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def decode_ms(model, ids: list[int], tokens: int) -> float:
    start = time.perf_counter()
    out = speculum.generate(model, ids, max_new_tokens=tokens, temperature=0, eos_token_id=None)
    assert len(out.tokens) == tokens
    return (time.perf_counter() - start) / tokens * 1e3


def rows(model, text: str) -> np.ndarray:
    ids = model.encode(text, chat=False)
    session = model.start(ids[:1])
    return np.vstack([session.next_logprobs()[None, :], session.extend(ids[1:])[:-1]]), ids


def quality(reference, model) -> tuple[float, float]:
    agree, kl, count = 0, 0.0, 0
    for text in TEXTS:
        base, _ = rows(reference, text)
        other, _ = rows(model, text)
        agree += int((base.argmax(1) == other.argmax(1)).sum())
        p = np.exp(base)
        kl += float(np.sum(np.where(p > 0, p * (base - other), 0.0)))
        count += len(base)
    return agree / count, kl / count


def enumeration_rate(model) -> float:
    """Prefixes forwarded per second by a fresh exact index for the top 2,000 two-token continuations."""
    prompt = model.encode("The capital of France is", chat=False)
    counted = CountingModel(model)
    ar = AutoregressiveEnumerable(counted, max_len=2, prompt=prompt)
    start = time.perf_counter()
    ar.top_k(2000)
    return counted.forwards / (time.perf_counter() - start)


def product_ms(model, rows: int, repeats: int = 5) -> tuple[float, float]:
    """(median ms, GFLOP/s) of every matrix product of one forward of ``model`` (the fused forward's) on
    ``rows`` random rows; (nan, nan) for a model without the fused forward."""
    import torch  # with the llm extra

    fused = getattr(model, "_fused", None)      # the fused forward's products, each timed as a forward calls it
    if fused is None:
        return float("nan"), float("nan")
    products = fused.products()
    inputs = {width: torch.randn(rows, width) for _, width in products}
    flops = 2 * rows * sum(width * product(inputs[width][:1]).shape[1] for product, width in products)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for product, width in products:
            product(inputs[width])
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return seconds * 1e3, flops / seconds / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 9, 16, 32, 155],
                        help="row counts at which to time the products of one forward")
    args = parser.parse_args()
    keep_freed_memory()
    bandwidth = triad_gb_per_s()
    models = {dtype: speculum.load_model(dtype=dtype) for dtype in args.dtypes}
    reference = models.get("float32") or speculum.load_model(dtype="float32")
    ids = reference.encode("Summarise the following text.\n\n" + PASSAGE)
    for model in models.values():
        decode_ms(model, ids, 4)                                  # warm-up
        enumeration_rate(model)                                   # warm-up
    times: dict[str, list[float]] = {dtype: [] for dtype in models}
    rates: dict[str, list[float]] = {dtype: [] for dtype in models}
    for _ in range(args.rounds):
        for dtype, model in models.items():                        # alternating: drift hits every dtype alike
            times[dtype].append(decode_ms(model, ids, args.tokens))
            rates[dtype].append(enumeration_rate(model))
    print(f"# The target forward per dtype, SmolLM2-135M, {cpu_name()}, {os.cpu_count()} cores\n")
    print(f"memory bandwidth (triad, NumPy): {bandwidth:.1f} GB/s\n")
    print("| dtype | ms/token | x float32 | weights MB | effective GB/s | greedy agreement | mean KL (nats) | "
          "enumeration prefixes/s | enumeration x float32 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = statistics.median(times[args.dtypes[0]])
    for dtype, model in models.items():
        ms = statistics.median(times[dtype])
        size = weight_bytes(model)
        agree, kl = (1.0, 0.0) if model is reference else quality(reference, model)
        speed_up = statistics.median(r / r0 for r, r0 in zip(rates[dtype], rates[args.dtypes[0]]))
        print(f"| {dtype} | {ms:.1f} | {base / ms:.2f} | {size / 1e6:.0f} | {size / ms / 1e6:.1f} | "
              f"{agree:.4f} | {kl:.2e} | {statistics.median(rates[dtype]):.0f} | {speed_up:.2f} |")
    print("\nThe products of one forward (ms, GFLOP/s) at each row count:\n")
    print("| dtype | " + " | ".join(f"{rows} rows" for rows in args.rows) + " |")
    print("|---|" + "---:|" * len(args.rows))
    for dtype, model in models.items():
        cells = [product_ms(model, rows) for rows in args.rows]
        print(f"| {dtype} | " + " | ".join(f"{ms:.1f} ms, {gflops:.0f}" for ms, gflops in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
