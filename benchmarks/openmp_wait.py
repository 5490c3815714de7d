"""How PyTorch's OpenMP threads wait, and which thread runs the serving engine: decode throughput of each.

PyTorch's CPU kernels run on an OpenMP thread team per calling thread. Between two parallel operations the
team's idle threads either spin for a while (GNU OpenMP's default, ~3 ms) or sleep at once
(``OMP_WAIT_POLICY=PASSIVE``), and a sleeping thread costs a futex wake-up (tens of microseconds) at the next
operation. A decode step of a small model is hundreds of short operations, so the policy matters; and GNU
OpenMP cuts the spinning to almost nothing as soon as it runs more threads than cores, which happens when a
second thread (an engine thread beside the main thread that loaded the model) starts a team of its own.

Every configuration runs in its own process (the policy is read when torch loads), interleaved, each
``--repeats`` times (the best is kept): the same greedy requests (SmolLM2-135M-Instruct, PyTorch float32,
a ~190-token grounded prompt, 48 tokens each, end-of-sequence off) through a
:class:`~speculum.serving.Engine` at concurrency 1 and 8, with OpenMP's default policy or
``OMP_WAIT_POLICY=PASSIVE``, and the engine on the main thread (``background=False``, as ``speculum serve``
runs it) or on a thread of its own. ``--busy-core`` keeps one core busy with another process throughout
(a shared machine). No HTTP: the engine alone.

    .venv/bin/python benchmarks/openmp_wait.py                 # ~8 min on 2 cores
    .venv/bin/python benchmarks/openmp_wait.py --busy-core
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from machine import cpu_name  # (benchmarks/machine.py)

POLICIES = {"default": None, "passive": "PASSIVE"}


def measure(target, prompt: list[int], *, main_thread: bool, concurrency: int, requests: int,
            max_tokens: int) -> float:
    """Tokens/s of ``requests`` greedy requests at ``concurrency`` through an engine."""
    from speculum.serving import Engine, GenerationRequest

    engine = Engine(target, eos_token_id=None, max_batch=concurrency, max_waiting=1024, background=not main_thread)
    result: list[float] = []

    def one(_: int) -> None:
        for _delta in engine.submit(GenerationRequest(prompt_ids=prompt, max_tokens=max_tokens, temperature=0.0)):
            pass

    def drive() -> None:
        try:
            one(0)                                              # warm-up
            started = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(one, range(requests)))
            result.append(requests * max_tokens / (time.perf_counter() - started))
        finally:
            engine.close()

    if main_thread:
        driver = threading.Thread(target=drive)
        driver.start()
        engine.run()
        driver.join()
    else:
        drive()
    return result[0]


def child(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from speculum.cli.demo import PASSAGE
    from speculum.models.memory.allocator import keep_freed_memory
    from speculum.models.backends import load_model

    keep_freed_memory()
    target = load_model(progress=False)
    prompt = target.encode(f"Summarise the following text in three sentences.\n\n{PASSAGE}", chat=True)
    print(json.dumps({str(c): measure(target, prompt, main_thread=args.thread == "main", concurrency=c,
                                      requests=args.requests, max_tokens=args.max_tokens) for c in (1, 8)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--busy-core", action="store_true", help="keep one core busy with another process")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--thread", choices=("main", "own"), default="main", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy_core else None
    runs: dict[str, list[dict]] = {}
    try:
        for _ in range(args.repeats):
            for policy, value in POLICIES.items():
                for thread in ("main", "own"):
                    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
                    if value is not None:
                        env["OMP_WAIT_POLICY"] = value
                    out = subprocess.run([sys.executable, __file__, "--child", "--thread", thread,
                                          "--requests", str(args.requests), "--max-tokens", str(args.max_tokens)],
                                         env=env, capture_output=True, text=True, check=True).stdout
                    runs.setdefault(f"{policy} / {thread}", []).append(json.loads(out.strip().splitlines()[-1]))
    finally:
        if busy is not None:
            busy.kill()
    best = {key: {c: max(r[c] for r in reports) for c in ("1", "8")} for key, reports in runs.items()}
    report = {"cpu": cpu_name(), "busy_core": args.busy_core, "best_tokens_per_second": best, "runs": runs}
    if args.json:
        print(json.dumps(report))
        return
    where = "one core busy with another process" if args.busy_core else "nothing else running"
    print(f"CPU: {report['cpu']}; {args.requests} greedy requests of {args.max_tokens} tokens per level; "
          f"best of {args.repeats}; {where}")
    print(f"{'OpenMP wait / engine thread':>28} | {'c=1 tok/s':>9} | {'c=8 tok/s':>9} | c=8 / c=1")
    for key, rates in best.items():
        print(f"{key:>28} | {rates['1']:>9.1f} | {rates['8']:>9.1f} | {rates['8'] / rates['1']:.2f}x")


if __name__ == "__main__":
    main()
