"""Benchmark: exact enumeration (speculum) versus the quantised enumeration of PyPI mixle 0.8.2.

Part a — TinyTransformer (V=50, L=6): build the index to rank 1e6, its memory, time per unrank after.
Part b — SmolLM2-135M, length-2 continuations of a fixed prompt: threshold(100_000) and unrank(99_999),
wall time and forwards, side by side with ``mixle.enumeration.AutoregressiveEnumerable`` on the same
model in the same run, and how many of mixle's first 1000 ranks are out of exact order.

    .venv/bin/python benchmarks/enumeration.py --part a
    .venv/bin/python benchmarks/enumeration.py --part b      # needs the llm extra (+ mixle==0.8.2)

mixle's forward cache keeps two vocabulary-sized arrays per prefix (~0.8 MB at V=49152), so its run
stops past ``--mixle-max-forwards`` rather than exhaust the machine's memory.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Passive OpenMP waiting, the setting of this script's figures in RESULTS.md (docs/backends.md: OpenMP waiting).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from counting import CountingModel  # noqa: E402  (benchmarks/counting.py)

from speculum.enumeration import AutoregressiveEnumerable  # noqa: E402

PROMPT_TEXT = "The capital of France is"


def part_a(rank: int, queries: int, seed: int) -> dict:
    from speculum.models import TinyTransformer

    model = CountingModel(TinyTransformer(50, d_model=32, n_layers=2, seed=0))
    ar = AutoregressiveEnumerable(model, max_len=6, prompt=[0])
    tracemalloc.start()
    start = time.perf_counter()
    seq, logprob = ar.unrank(rank - 1)
    build_s = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    index = ar.seek_index()
    forwards = model.forwards
    ranks = np.random.default_rng(seed).integers(0, rank, size=queries)
    start = time.perf_counter()
    for i in ranks.tolist():
        ar.unrank(i)
    unrank_s = (time.perf_counter() - start) / queries
    start = time.perf_counter()
    for i in ranks[:200].tolist():
        ar.rank(ar.unrank(i)[0])
    rank_s = (time.perf_counter() - start) / 200
    assert model.forwards == forwards, "queries after the build must not forward"
    return {
        "rank": rank, "build_s": build_s, "forwards": forwards, "reforwards": index.tree.reforwards,
        "certified": index.index.total, "stored_nodes": sum(len(level) for level in index.tree.levels),
        "index_mb": index.nbytes() / 2**20, "peak_traced_mb": peak / 2**20,
        "unrank_ms": unrank_s * 1e3, "rank_ms": rank_s * 1e3, "last": (seq, logprob),
    }


class ForwardLimitExceeded(RuntimeError):
    pass


def _mixle_enumerable(model, prompt: list[int], batch_size: int, max_forwards: int):
    from mixle.enumeration import AutoregressiveEnumerable as MixleEnumerable

    tokens = np.arange(model.vocab_size)

    def rows_for(prefixes):
        # mixle caches two vocabulary-sized arrays per prefix (~0.8 MB at V=49152): stop before that
        # exhausts the shared machine's memory.
        if model.forwards + len(prefixes) > max_forwards:
            raise ForwardLimitExceeded(f"mixle needed more than {max_forwards:,} forwards")
        return model.next_logprobs([prompt + list(p) for p in prefixes])

    def next_logprobs(prefix):
        return tokens, rows_for([prefix])[0]

    def batch_next_logprobs(prefixes):
        return [(tokens, row) for row in rows_for(prefixes)]

    return MixleEnumerable(next_logprobs, max_len=2, batch_next_logprobs=batch_next_logprobs,
                           batch_size=batch_size)


def _log(event) -> None:
    print(f"    level {event.level}: {event.forwards:,} forwards, budget {event.budget_bits:.2f} bits",
          file=sys.stderr, flush=True)


def part_b_at(target, prompt: list[int], rank: int, batch_size: int, max_forwards: int, head: int) -> dict:
    """speculum and mixle, one after the other on the same model: threshold(rank) + unrank(rank - 1)."""
    out: dict = {"rank": rank}
    model = CountingModel(target)
    ar = AutoregressiveEnumerable(model, max_len=2, prompt=prompt, batch_size=batch_size, progress=_log)
    start = time.perf_counter()
    threshold = ar.threshold(rank)
    seq, logprob = ar.unrank(rank - 1)
    out["speculum"] = {"wall_s": time.perf_counter() - start, "forwards": model.forwards,
                       "threshold": threshold, "unrank": (seq, logprob)}
    print(f"[b] rank {rank:,} speculum: {out['speculum']}", file=sys.stderr, flush=True)
    exact_head = ar.slice(0, head)
    try:
        import mixle  # noqa: F401
    except ImportError:
        out["mixle"] = None
        return out
    model = CountingModel(target)
    mx = _mixle_enumerable(model, prompt, batch_size, max_forwards)
    start = time.perf_counter()
    try:
        mx_threshold = mx.threshold(rank)
        mx_seq, mx_logprob = mx.unrank(rank - 1)
    except ForwardLimitExceeded as exc:
        out["mixle"] = {"aborted": str(exc), "wall_s": time.perf_counter() - start, "forwards": model.forwards}
        return out
    wall = time.perf_counter() - start
    mx_head = [mx.unrank(i) for i in range(head)]
    out["mixle"] = {
        "wall_s": wall, "forwards": model.forwards, "threshold": mx_threshold,
        "unrank": (tuple(int(t) for t in mx_seq), float(mx_logprob)),
        # Ranks whose sequence differs from the exact order, and adjacent pairs in increasing probability.
        "out_of_order": sum(tuple(int(t) for t in m[0]) != e[0] for m, e in zip(mx_head, exact_head)),
        "adjacent_inversions": sum(b[1] > a[1] for a, b in zip(mx_head, mx_head[1:])),
    }
    return out


def part_b(ranks: list[int], batch_size: int, max_forwards: int, head: int):
    import speculum

    target = speculum.load_model("smollm2-135m")
    prompt = list(target.tokenizer.encode(PROMPT_TEXT))
    target.next_logprobs([prompt])   # warm-up: both runs find the prompt encoded alike
    for rank in ranks:
        yield part_b_at(target, prompt, rank, batch_size, max_forwards, head)


def _print_b(result: dict, head: int) -> None:
    s, m, rank = result["speculum"], result["mixle"], result["rank"]
    print(f"[b] SmolLM2-135M, prompt {PROMPT_TEXT!r}, length 2: threshold({rank:,}) + unrank({rank - 1:,})")
    print(f"[b]   speculum: {s['wall_s']:.1f} s, {s['forwards']:,} forwards, threshold {s['threshold']:.4f}")
    if m is None:
        print("[b]   mixle not installed (pip install mixle==0.8.2): no side-by-side")
    elif "aborted" in m:
        print(f"[b]   mixle 0.8.2: aborted after {m['wall_s']:.1f} s and {m['forwards']:,} forwards ({m['aborted']})")
    else:
        print(f"[b]   mixle 0.8.2: {m['wall_s']:.1f} s, {m['forwards']:,} forwards, threshold {m['threshold']:.4f}")
        print(f"[b]   wall time mixle / speculum: {m['wall_s'] / s['wall_s']:.2f}x; mixle's first {head} ranks: "
              f"{m['out_of_order']} not in exact order ({m['adjacent_inversions']} adjacent inversions)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["a", "b", "all"], default="all")
    parser.add_argument("--rank-a", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--ranks-b", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--mixle-max-forwards", type=int, default=6_000,
                        help="stop mixle past this many forwards (its cache holds ~0.8 MB per prefix)")
    parser.add_argument("--head", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.part in ("a", "all"):
        a = part_a(args.rank_a, args.queries, args.seed)
        print(f"[a] TinyTransformer V=50 L=6, build to rank {a['rank']:,}: {a['build_s']:.1f} s, "
              f"{a['forwards']:,} forwards ({a['reforwards']:,} repeated), {a['certified']:,} sequences "
              f"certified, {a['stored_nodes']:,} nodes stored")
        print(f"[a] index arrays {a['index_mb']:.1f} MiB; traced peak during build {a['peak_traced_mb']:.1f} MiB")
        print(f"[a] unrank after build: {a['unrank_ms']:.3f} ms/query; rank: {a['rank_ms']:.3f} ms/query")
    if args.part in ("b", "all"):
        for result in part_b(args.ranks_b, args.batch_size, args.mixle_max_forwards, args.head):
            _print_b(result, args.head)
            sys.stdout.flush()


if __name__ == "__main__":
    main()
