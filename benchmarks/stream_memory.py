"""Benchmark: memory of streaming an exact enumeration (``iter_ranked``) against the in-memory index.

TinyTransformer V=50, L=6, d_model 16, one layer (50^6 continuations; a smaller network than
``benchmarks/enumeration.py`` part a, so that the stream's repeated passes take about a minute): the stream
yields the first ``--items`` items with ``--max-items`` held at a time; the index is built to the same rank
(``unrank(items - 1)``). Each runs in its own process, which reports its peak resident memory above
what it held after loading (``ru_maxrss``) and, with ``--tracemalloc``, its traced Python peak (slower).
The parent compares the two runs' items at the first ``--check`` ranks and at ten ranks spread over the
rest: same sequences in the same order, log-probs equal bitwise or within the last bits that a batched
float matmul moves between batch compositions.

    .venv/bin/python benchmarks/stream_memory.py                      # 1e6 items: about a minute on 2 cores
    .venv/bin/python benchmarks/stream_memory.py --items 100000       # a quick check
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

# Small float64 products run faster on one BLAS thread than on shared cores (as the test suite pins it).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from counting import CountingModel  # noqa: E402  (benchmarks/counting.py)
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)

from speculum.enumeration import AutoregressiveEnumerable  # noqa: E402

# Log-probs of the two runs may differ by the rounding of batched matmuls, a few ulps of values ~ -20.
LOGPROB_TOLERANCE = 1e-12


def _enumerable(args) -> tuple[CountingModel, AutoregressiveEnumerable]:
    from speculum.models import TinyTransformer

    model = CountingModel(TinyTransformer(args.vocab, d_model=args.d_model, n_layers=args.layers, seed=0))
    return model, AutoregressiveEnumerable(model, max_len=args.length, prompt=[0], batch_size=args.batch_size)


def _ranks(args) -> list[int]:
    """The ranks compared: the first ``check`` and ten more spread up to the last."""
    spread = [args.items * j // 10 for j in range(1, 10)] + [args.items - 1]
    return sorted(set(range(min(args.check, args.items))) | {r for r in spread if r < args.items})


def _max_rss() -> int:
    """Peak resident memory of this process so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_phase(args) -> None:
    """One measurement in this (child) process; writes its report and items to ``args.out``."""
    import tracemalloc

    model, ar = _enumerable(args)
    baseline = _max_rss()
    wanted = set(_ranks(args))
    items: dict[int, tuple[list[int], float]] = {}
    passes = [0]
    if args.tracemalloc:
        tracemalloc.start()
    start = time.perf_counter()
    if args.phase == "stream":
        def progress(event) -> None:
            passes[0] = event.passes
            print(f"    pass {event.passes}: {event.emitted:,} items, {event.forwards:,} forwards",
                  file=sys.stderr, flush=True)

        count = 0
        for rank, (seq, lp) in enumerate(ar.iter_ranked(max_items=args.max_items, progress=progress)):
            if rank in wanted:
                items[rank] = (list(seq), lp)
            count = rank + 1
            if count == args.items:
                break
    else:
        ar.unrank(args.items - 1)                       # the index that answers every rank below items
        count = ar.seek_index().index.total
    wall = time.perf_counter() - start
    traced = tracemalloc.get_traced_memory()[1] if args.tracemalloc else None
    if args.phase == "index":
        # Read after the measurement: unrank over a built index forwards nothing and adds little memory.
        items = {rank: (list(seq), lp) for rank, (seq, lp) in ((r, ar.unrank(r)) for r in sorted(wanted))}
        index = ar.seek_index()
        extra = {"index_mib": index.nbytes() / 2**20, "stored_nodes": sum(len(lv) for lv in index.tree.levels)}
    else:
        extra = {"passes": passes[0]}
    report = {"phase": args.phase, "wall_s": wall, "forwards": model.forwards, "count": count,
              "rss_mib": (_max_rss() - baseline) / 2**20, "traced_mib": None if traced is None else traced / 2**20,
              "items": {str(r): v for r, v in items.items()}, **extra}
    with open(args.out, "w") as out:
        json.dump(report, out)


def _child(args, phase: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        path = handle.name
    command = [sys.executable, __file__, "--phase", phase, "--out", path, "--items", str(args.items),
               "--max-items", str(args.max_items), "--check", str(args.check), "--vocab", str(args.vocab),
               "--length", str(args.length), "--d-model", str(args.d_model), "--layers", str(args.layers),
               "--batch-size", str(args.batch_size)]
    if args.tracemalloc:
        command.append("--tracemalloc")
    print(f"[{phase}] running ...", file=sys.stderr, flush=True)
    subprocess.run(command, check=True)
    try:
        with open(path) as report:
            return json.load(report)
    finally:
        os.unlink(path)


def compare(stream: dict, index: dict) -> dict:
    """Order and log-prob agreement of the two runs at the compared ranks."""
    order_mismatches = bitwise = 0
    worst = 0.0
    for rank, (seq, lp) in index["items"].items():
        got_seq, got_lp = stream["items"][rank]
        order_mismatches += got_seq != seq
        bitwise += got_lp == lp
        worst = max(worst, abs(got_lp - lp))
    return {"compared": len(index["items"]), "order_mismatches": order_mismatches, "bitwise_equal": bitwise,
            "max_logprob_diff": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=1_000_000, help="items to stream (and ranks to index)")
    parser.add_argument("--max-items", type=int, default=100_000, help="items the stream holds at a time")
    parser.add_argument("--check", type=int, default=10_000, help="leading ranks compared item by item")
    parser.add_argument("--vocab", type=int, default=50)
    parser.add_argument("--length", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=16)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--tracemalloc", action="store_true", help="also trace Python allocations (slower)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--phase", choices=["stream", "index"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        run_phase(args)
        return
    if args.items < 1 or args.max_items < 1 or args.vocab ** args.length < args.items:
        parser.error(f"--items must be between 1 and the support's {args.vocab ** args.length:,} continuations")
    stream, index = _child(args, "stream"), _child(args, "index")
    agreement = compare(stream, index)
    report = {"cpu": cpu_name(), "vocab": args.vocab, "length": args.length, "d_model": args.d_model,
              "layers": args.layers, "items": args.items,
              "max_items": args.max_items, "agreement": agreement,
              **{phase: {k: v for k, v in run.items() if k != "items"} for phase, run in
                 (("stream", stream), ("index", index))}}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"CPU: {report['cpu']}")
        print(f"TinyTransformer V={args.vocab} L={args.length} d_model={args.d_model} layers={args.layers}: first "
              f"{args.items:,} items, stream holding {args.max_items:,} at a time")
        print(f"  stream: {stream['wall_s']:.1f} s, {stream['forwards']:,} forwards "
              f"({stream['passes']} passes finished before the last item), "
              f"peak RSS +{stream['rss_mib']:.1f} MiB" + _traced(stream))
        print(f"  index:  {index['wall_s']:.1f} s, {index['forwards']:,} forwards, {index['stored_nodes']:,} nodes "
              f"({index['index_mib']:.1f} MiB of arrays), peak RSS +{index['rss_mib']:.1f} MiB" + _traced(index))
        ratio = stream["rss_mib"] / index["rss_mib"] if index["rss_mib"] > 0 else float("nan")
        line = f"  peak RSS stream / index: {ratio:.3f}"
        if stream["traced_mib"] is not None and index["traced_mib"]:
            line += f"; traced peak stream / index: {stream['traced_mib'] / index['traced_mib']:.3f}"
        print(line)
        print(f"  agreement at {agreement['compared']:,} ranks: {agreement['order_mismatches']} out of order, "
              f"{agreement['bitwise_equal']:,} log-probs bitwise equal, largest difference "
              f"{agreement['max_logprob_diff']:.2e}")
    if stream["count"] != args.items or agreement["order_mismatches"] or \
            agreement["max_logprob_diff"] > LOGPROB_TOLERANCE:
        sys.exit("the stream does not match the index")


def _traced(run: dict) -> str:
    return "" if run["traced_mib"] is None else f", traced peak {run['traced_mib']:.1f} MiB"


if __name__ == "__main__":
    main()
