"""What an echo costs against a prefill of the same length, side by side on one machine.

An `echo` request (OpenAI's prompt log-probs, what lm-eval asks a server for) teacher-forces the prompt
through the engine's scoring rounds and keeps every position's exact log-prob and likeliest tokens; a
generation's prefill runs the same forward but keeps only the last row. The goal: an echo costs at most
1.5x a prefill of its length. Each echo and prefill gets a prompt of its own (random token ids: nothing
is shared with a scored prompt), alternating, `--rounds` times; medians.

    .venv/bin/python benchmarks/echo_cost.py               # 2,048-token prompts, 3 rounds (~1.5 min)
    .venv/bin/python benchmarks/echo_cost.py --tokens 512 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)
from speculum.cli.generate import load_target_model
from speculum.serving import Engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length (default: 2048)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    parser.add_argument("--top", type=int, default=1, help="likeliest tokens kept per position (default: 1)")
    args = parser.parse_args()
    target = load_target_model("smollm2-135m", command="serve")
    rng = np.random.default_rng(0)

    def prompt() -> list[int]:
        return [1] + rng.integers(100, target.vocab_size - 100, args.tokens - 1).tolist()

    engine = Engine(target, decode=lambda ids: "", background=True)
    try:
        engine.score(prompt()[:64], top=args.top).result()           # warm: the packing check, first rounds
        prefill, echo = [], []
        for _ in range(args.rounds):
            ids = prompt()
            started = time.perf_counter()
            target.start(ids).next_logprobs()
            prefill.append(time.perf_counter() - started)
            ids = prompt()
            started = time.perf_counter()
            engine.score(ids, top=args.top).result()
            echo.append(time.perf_counter() - started)
    finally:
        engine.close()
    print(json.dumps({"cpu": cpu_name(), "tokens": args.tokens, "prefill_s": [round(s, 3) for s in prefill],
                      "echo_s": [round(s, 3) for s in echo],
                      "echo_over_prefill": round(statistics.median(echo) / statistics.median(prefill), 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
