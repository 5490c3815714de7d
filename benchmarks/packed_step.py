"""Packed-forward benchmark: what the KV store and deferred prompts change, side by side, on SmolLM2-135M.

1. One packed forward (`HFModel.extend_sessions`) of B requests at ~190 tokens of context: the requests'
   caches in one KV store (`speculum.models.hf.kv.store`, one attention call per layer) against caches of
   their own (attention per request; the store turned off by `ARENA_BUDGET_BYTES = 0`), for one-token
   blocks (plain decoding) and ragged blocks of 1-8 tokens (prompt lookup under load). The two alternate
   call by call; medians.
2. The scheduler generating 16 requests (8 at a time, 48 greedy tokens each, grounded prompts), with new
   prompts fed inside the packed step (`start_deferred`) or by forwards of their own, the requests
   arriving one per step or all at once; plain decoding and prompt lookup. Alternating rounds, medians.
3. A ~1,300-token prompt joining 7 running generations: the longest wait between two of their tokens,
   with the prompt fed whole or at most 512 / 256 prompt tokens per step (chunked prefill).

    .venv/bin/python benchmarks/packed_step.py                 # ~5 min on 2 cores
    .venv/bin/python benchmarks/packed_step.py --rounds 5 --json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)

from speculum.cli.demo import PASSAGE  # noqa: E402
from speculum.decoding.scheduler import Scheduler  # noqa: E402
from speculum.models import PromptLookup  # noqa: E402
from speculum.models.hf import model as hf_module  # noqa: E402
from speculum.models.memory.allocator import keep_freed_memory  # noqa: E402

TASKS = ["Summarise the following text in three sentences.", "Rewrite the following text for a ten-year-old.",
         "List the facts stated in the following text, one per line.",
         "Translate the key sentence of the following text into plain English."]
BLOCKS = {"one-token blocks": [1], "ragged blocks": [1, 6, 1, 3, 8, 1, 2, 5]}


def packed_step_ms(target, prompt: list[int], block_lengths: list[int], repeats: int) -> tuple[float, float]:
    """Median milliseconds of one packed forward extending each session by its block (then rolled back),
    with caches of their own and in the store: the two alternate call by call, so drift moves both."""
    budget = hf_module.ARENA_BUDGET_BYTES
    blocks = [[5] * n for n in block_lengths]
    sets = {}
    for store in (False, True):
        hf_module.ARENA_BUDGET_BYTES = budget if store else 0
        sets[store] = [target.start(prompt) for _ in block_lengths]
        target.extend_sessions(sets[store], blocks)                  # the store path moves its sessions in
        for session, n in zip(sets[store], block_lengths):
            session.rollback(n)
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for repeat in range(repeats):
            for store in ((False, True) if repeat % 2 else (True, False)):
                hf_module.ARENA_BUDGET_BYTES = budget if store else 0
                started = time.perf_counter()
                target.extend_sessions(sets[store], blocks)
                times[store].append(time.perf_counter() - started)
                for session, n in zip(sets[store], block_lengths):
                    session.rollback(n)
    finally:
        hf_module.ARENA_BUDGET_BYTES = budget
    return statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3


def scheduler_tokens_per_second(target, prompts: list[list[int]], *, defer: bool, lookup: bool,
                                staggered: bool, requests: int = 16, concurrency: int = 8) -> float:
    scheduler = Scheduler(target)
    scheduler.defer_prefill = defer and scheduler.defer_prefill
    started, tokens, added = time.perf_counter(), 0, 0
    while added < requests or scheduler.active:
        # Staggered: at most one arrival per step (a server's clients trickle in); else as many as fit.
        while added < requests and scheduler.active < concurrency:
            scheduler.add(prompts[added % len(prompts)], max_new_tokens=48, temperature=0, eos_token_id=None,
                          draft=PromptLookup() if lookup else None, gamma="auto" if lookup else 4)
            added += 1
            if staggered:
                break
        tokens += sum(len(chunk.tokens) for _, chunk in scheduler.step())
    return tokens / (time.perf_counter() - started)


def longest_wait(target, prompts: list[list[int]], long_prompt: list[int], prompt_tokens_per_step: int) -> float:
    """Seven generations running when a long prompt joins: the longest wait (seconds) between two tokens
    of a running generation, while the prompt is fed."""
    scheduler = Scheduler(target, prompt_tokens_per_step=prompt_tokens_per_step)
    running = {scheduler.add(prompts[i % len(prompts)], max_new_tokens=40, temperature=0, eos_token_id=None)
               for i in range(7)}
    for _ in range(3):
        scheduler.step()
    joined = scheduler.add(long_prompt, max_new_tokens=4, temperature=0, eos_token_id=None)
    last = time.perf_counter()
    longest, started = 0.0, False
    while not started:                       # until the long prompt is in (its first tokens come out)
        results = scheduler.step()
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
        started = any(request == joined and chunk.tokens for request, chunk in results)
        assert all(chunk.tokens for request, chunk in results if request in running)
    scheduler.close()
    return longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from speculum.models.backends import load_model

    keep_freed_memory()
    target = load_model()
    prompts = [target.encode(f"{task}\n\n{PASSAGE}", chat=True) for task in TASKS]
    report: dict = {"cpu": cpu_name(), "prompt_tokens": len(prompts[0]), "packed_step_ms": [], "scheduler": []}
    for name, pattern in BLOCKS.items():
        for batch in (1, 4, 8, 16):
            lengths = (pattern * batch)[:batch]
            own, store = packed_step_ms(target, prompts[0], lengths, repeats=10 * args.rounds)
            report["packed_step_ms"].append({"blocks": name, "batch": batch, "own_caches": own, "store": store})
    for lookup in (False, True):
        for staggered in (True, False):
            runs = {True: [], False: []}
            for _ in range(args.rounds):
                for defer in (False, True):
                    runs[defer].append(scheduler_tokens_per_second(target, prompts, defer=defer, lookup=lookup,
                                                                   staggered=staggered))
            report["scheduler"].append({"draft": "lookup" if lookup else "none", "staggered": staggered,
                                        "prompt_alone": statistics.median(runs[False]),
                                        "prompt_in_step": statistics.median(runs[True])})
    long_prompt = target.encode("Summarise the following text.\n\n" + "\n\n".join([PASSAGE] * 8), chat=True)
    report["long_prompt_tokens"] = len(long_prompt)
    report["longest_wait_s"] = {}
    for name, budget in (("whole", 10**9), ("512 per step", 512), ("256 per step", 256)):
        report["longest_wait_s"][name] = statistics.median(longest_wait(target, prompts, long_prompt, budget)
                                                           for _ in range(args.rounds))
    if args.json:
        print(json.dumps(report))
        return
    print(f"CPU: {report['cpu']}; SmolLM2-135M float32, prompts of {report['prompt_tokens']} tokens")
    print("packed forward | B | own caches ms | store ms | own / store")
    for row in report["packed_step_ms"]:
        print(f"{row['blocks']:>16} | {row['batch']:>2} | {row['own_caches']:>7.1f} | {row['store']:>7.1f} | "
              f"{row['own_caches'] / row['store']:.2f}x")
    print("scheduler, 16 requests at concurrency 8 | prompt alone tok/s | prompt in the step tok/s | ratio")
    for row in report["scheduler"]:
        arrivals = "one per step" if row["staggered"] else "all at once"
        print(f"{row['draft']:>6}, arrivals {arrivals:>12} | {row['prompt_alone']:>6.1f} | {row['prompt_in_step']:>6.1f} | "
              f"{row['prompt_in_step'] / row['prompt_alone']:.2f}x")
    print(f"a {report['long_prompt_tokens']}-token prompt joins 7 running generations: longest wait between two of "
          "their tokens while it is fed")
    for name, seconds in report["longest_wait_s"].items():
        print(f"{name:>14} | {seconds:.2f} s")


if __name__ == "__main__":
    main()
