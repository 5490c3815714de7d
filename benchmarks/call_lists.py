"""A forward's kernel calls run by one C call (call lists) against the same calls made from Python, side by side.

The embedded model decodes the grounded prompts of `serving_peers.py` (96 new tokens, greedy) on the decoding
scheduler, `--concurrency` at once, plainly and with prompt lookup (`gamma="auto"`), in one process: rounds
alternate the two ways of making the calls (call lists on the kept buffers, or every call from Python), and
each run's tokens and log-probs are compared bitwise with the other way's (after one untimed run each way,
which binds the buffers of every row count the runs use). Reported: the decode steps' tokens
a second (the prompt-reading steps excluded), medians over the rounds, and their ratio.

    .venv/bin/python benchmarks/call_lists.py --dtype q8 --concurrency 1 8
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)
from serving_peers import TASKS  # noqa: E402  (benchmarks/serving_peers.py)
from speculum.cli.demo import PASSAGE
from speculum.decoding.scheduler import Scheduler
from speculum.drafts import PromptLookup
from speculum.models.backends import load_model
from speculum.models.hf.forward import glued

PROMPT_STEPS = 3            # the scheduler reads these prompts in its first 3 steps (up to 8 at once)


def decode(target, prompts: list[list[int]], lookup: bool) -> tuple[float, list[tuple[list[int], bytes]]]:
    """Tokens a second of the decode steps (after the prompts are read), and each request's tokens and their
    log-probs (bytes)."""
    scheduler = Scheduler(target)
    ids = [scheduler.add(prompt, max_new_tokens=96, temperature=0, eos_token_id=None, target_logprobs=True,
                         draft=PromptLookup() if lookup else None, gamma="auto" if lookup else 4)
           for prompt in prompts]
    tokens: dict[int, list[int]] = {request: [] for request in ids}
    logprobs: dict[int, bytes] = {request: b"" for request in ids}
    seconds, emitted = [], []
    while scheduler.active:
        start = time.perf_counter()
        chunks = scheduler.step()
        seconds.append(time.perf_counter() - start)
        emitted.append(sum(len(chunk.tokens) for _, chunk in chunks))
        for request, chunk in chunks:
            tokens[request] += chunk.tokens
            logprobs[request] += b"" if chunk.target_logprobs is None else chunk.target_logprobs.tobytes()
    return sum(emitted[PROMPT_STEPS:]) / sum(seconds[PROMPT_STEPS:]), [(tokens[r], logprobs[r]) for r in ids]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file or model folder (default: the embedded model)")
    parser.add_argument("--dtype", default="q8")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    target = (load_model(args.model, dtype=args.dtype, progress=False) if args.model
              else load_model(dtype=args.dtype, progress=False))
    chat = target.tokenizer.chat_template is not None           # a GGUF file may carry none: raw prompts then
    prompts = [target.encode(f"{task}\n\n{PASSAGE}", chat=chat) for task in TASKS]
    rows = {}
    for concurrency in args.concurrency:
        for lookup in (False, True):
            times: dict[bool, list[float]] = {True: [], False: []}
            outputs: dict[bool, list] = {}
            for listed in (True, False):             # every row count bound, both ways, before the timed rounds
                glued.use_call_lists = listed
                decode(target, prompts[:concurrency], lookup)
            for round_ in range(args.rounds):
                for listed in ((True, False) if round_ % 2 == 0 else (False, True)):
                    glued.use_call_lists = listed
                    rate, out = decode(target, prompts[:concurrency], lookup)
                    times[listed].append(rate)
                    outputs.setdefault(listed, out)
            glued.use_call_lists = True
            same = outputs[True] == outputs[False]
            listed, python = statistics.median(times[True]), statistics.median(times[False])
            name = f"c={concurrency} {'lookup' if lookup else 'plain'}"
            rows[name] = {"call_lists_tok_s": listed, "python_tok_s": python, "speedup": listed / python,
                          "same_bits": same}
            if not args.json:
                print(f"{name:12s}  call lists {listed:6.1f} tok/s  from Python {python:6.1f} tok/s  "
                      f"{listed / python:.3f}x  same tokens and log-probs: {same}", flush=True)
            if not same:
                print("the two ways gave different outputs", file=sys.stderr)
                return 1
    if args.json:
        print(json.dumps({"cpu": cpu_name(), "model": args.model or "embedded", "dtype": args.dtype,
                          "rounds": args.rounds, "rows": rows}, indent=2))
    else:
        print(f"CPU: {cpu_name()}, {args.model or 'the embedded model'}, dtype {args.dtype}, {args.rounds} rounds "
              "(medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
