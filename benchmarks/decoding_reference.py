"""Speculative decoding on reference models: target forwards per token and wall-clock speed-up.

Target: a TinyTransformer (vocabulary 512, d_model 256, 6 layers, NumPy float64). Drafts:
* ``truncated-1``: the target's first layer only (cheap, weakly correlated: a layer-truncated self-draft);
* ``perturbed-0.05``: the target with 5 % weight noise (well correlated, but as expensive as the target);
* ``prompt-lookup``: :class:`speculum.models.PromptLookup` (free, point-mass verification).
Plain decoding and every (draft, γ) run side by side in one process, interleaved, repeated; the speed-up is
the median over repetitions of plain time / speculative time. Greedy runs are checked token-identical
to plain greedy decoding.

    .venv/bin/python benchmarks/decoding_reference.py [--tokens 128] [--repeats 3]
"""
from __future__ import annotations

import os

# One BLAS thread: on a shared 2-core machine, multi-threaded GEMM in the multi-token verification
# forward thrashes against other processes and makes timings meaningless (10x swings).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from speculum.decoding import generate  # noqa: E402
from speculum.models import PromptLookup, TinyTransformer  # noqa: E402

GAMMAS = (1, 2, 4, 8, "auto")


def verify_cost_curve(target, prompt, sizes=(1, 2, 4, 8, 16), repeats=5) -> dict[int, float]:
    """Seconds to extend a cached context by n tokens, relative to one decode step (v(γ) = curve[γ+1])."""
    session = target.start(prompt)
    seconds = {}
    for n in sizes:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            session.extend(list(range(n)))
            times.append(time.perf_counter() - t0)
            session.rollback(n)
        seconds[n] = statistics.median(times)
    return {n: s / seconds[1] for n, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    target = TinyTransformer(512, d_model=256, n_layers=6, n_heads=4, seed=0, max_len=1024)
    drafts = {
        "truncated-1": target.truncated(1),
        "perturbed-0.05": target.perturbed(0.05, seed=1),
        "prompt-lookup": None,        # stateful: a fresh PromptLookup per run
    }
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 512, 24)]
    curve = verify_cost_curve(target, prompt)
    print("verification cost v (n tokens in one forward, in decode steps): "
          + ", ".join(f"{n}: {v:.2f}" for n, v in curve.items()))

    for temperature in (0.0, 1.0):
        plain_times, rows = [], {}
        plain_tokens = None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            plain = generate(target, prompt, max_new_tokens=args.tokens, temperature=temperature, seed=0)
            plain_times.append(time.perf_counter() - t0)
            plain_tokens = plain.tokens
            for name, draft in drafts.items():
                for gamma in GAMMAS:
                    draft_model = PromptLookup() if draft is None else draft
                    t0 = time.perf_counter()
                    result = generate(target, prompt, draft=draft_model, gamma=gamma, max_new_tokens=args.tokens,
                                      temperature=temperature, seed=0)
                    elapsed = time.perf_counter() - t0
                    if temperature == 0.0 and result.tokens != plain_tokens:
                        raise SystemExit(f"greedy mismatch for {name} gamma={gamma}")
                    rows.setdefault((name, gamma), []).append((elapsed, result.stats))
        plain_median = statistics.median(plain_times)
        print(f"\ntemperature {temperature:g}: plain decoding {args.tokens / plain_median:.0f} tokens/s "
              f"({1000 * plain_median / args.tokens:.2f} ms/token)")
        print(f"{'draft':<16}{'gamma':>6}{'accept':>8}{'tok/fwd':>9}{'fwd/tok':>9}{'speed-up':>10}")
        for (name, gamma), runs in rows.items():
            stats = runs[-1][1]
            speedup = statistics.median(plain_times[i] / runs[i][0] for i in range(len(runs)))
            print(f"{name:<16}{gamma!s:>6}{stats.acceptance_rate:>8.2f}{stats.tokens_per_target_forward:>9.2f}"
                  f"{stats.target_forwards / max(stats.emitted, 1):>9.2f}{speedup:>9.2f}x")


if __name__ == "__main__":
    main()
