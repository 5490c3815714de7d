"""Decoding on shared cores: how much speculum's decode step and transformers' slow down when other
CPU-bound jobs run beside them, measured paired in one run.

Each round times, in a shuffled order, greedy plain decoding of the same prompt (SmolLM2-135M-Instruct,
float32, end-of-sequence off) by speculum (its fused forward) and by transformers' ``generate`` on the
same weights with PyTorch's default kernels, first on a quiet machine and then with ``--jobs`` busy
processes (pure Python loops, one core each). The table gives the median ms a token of each and its
slowdown, loaded over quiet; the goal is that speculum slows no more than transformers does.

    .venv/bin/python benchmarks/shared_cores.py                     # 3 rounds, 2 busy jobs (~3 min, 2 cores)
    .venv/bin/python benchmarks/shared_cores.py --jobs 1 --rounds 5
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import speculum  # noqa: E402
from decoding_llm import TASKS, ours, transformers_generate  # noqa: E402
from machine import cpu_name  # noqa: E402

BUSY = "while True: pass"


def busy_jobs(count: int) -> list[subprocess.Popen]:
    """``count`` processes that each keep one core busy until killed."""
    return [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(count)]


def stop(jobs: list[subprocess.Popen]) -> None:
    for job in jobs:
        job.kill()
    for job in jobs:
        job.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="busy processes beside the decoders")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48, help="new tokens a run")
    parser.add_argument("--task", default="chat", choices=list(TASKS))
    parser.add_argument("--seed", type=int, default=0, help="seed of the run order within each round")
    parser.add_argument("--one-thread", action="store_true", help="also time speculum on one thread")
    args = parser.parse_args(argv)

    target = speculum.load_model("smollm2-135m")
    reference = speculum.load_model("smollm2-135m", prepack=False)
    prompt = target.encode(TASKS[args.task])
    threads = torch.get_num_threads()

    def on_one_thread():
        torch.set_num_threads(1)
        try:
            return ours(target, prompt, args.tokens)
        finally:
            torch.set_num_threads(threads)

    runners = {"speculum": lambda: ours(target, prompt, args.tokens),
               "transformers": lambda: transformers_generate(reference, prompt, args.tokens)}
    if args.one_thread and threads > 1:
        runners["speculum 1 thread"] = on_one_thread
    for run in runners.values():
        run()                                           # one-off initialisation out of the timings
    print(f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(default)')}; {args.task}, {args.tokens} tokens, "
          f"{args.jobs} busy jobs when loaded", flush=True)
    order = random.Random(args.seed)
    ms: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for load in ("quiet", "loaded"):
            jobs = busy_jobs(args.jobs) if load == "loaded" else []
            try:
                time.sleep(1.0)                         # let the jobs take their cores, or their exit settle
                names = list(runners)
                order.shuffle(names)
                for name in names:
                    run = runners[name]()
                    ms.setdefault((name, load), []).append(1000 * run.seconds / len(run.tokens))
            finally:
                stop(jobs)
    print(f"{'decoder':<20}{'quiet ms/token':>16}{'loaded ms/token':>17}{'slowdown':>10}")
    slowdown = {}
    for name in runners:
        quiet, loaded = (statistics.median(ms[name, load]) for load in ("quiet", "loaded"))
        slowdown[name] = loaded / quiet
        print(f"{name:<20}{quiet:>16.1f}{loaded:>17.1f}{slowdown[name]:>9.2f}x")
    ratio = slowdown["speculum"] / slowdown["transformers"]
    print(f"speculum's slowdown / transformers': {ratio:.2f} (goal <= 1.00)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
