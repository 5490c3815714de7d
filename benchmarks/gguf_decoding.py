"""Single-stream greedy decoding of a GGUF file: speculum's float32 target over the file's weight groups,
beside llama.cpp on the same file and transformers' generate on the converted checkpoint.

One run, side by side, rounds interleaved (load from other processes spreads over every method):

* ``speculum``: ``load_model(file)`` (the fused forward where the family is covered, multiplying by the
  file's groups), a session fed one greedy token at a time;
* ``llama.cpp``: llama-cpp-python's ``Llama`` on the same file (flash attention on, the machine's cores),
  ``eval`` of one token at a time;
* ``transformers``: ``generate(do_sample=False)`` on the float32 checkpoint speculum converted the file
  into (the checkpoint transformers' own GGUF loader would give).

Decode cost per token = (time for ``n`` tokens - time for 1) / (n - 1), each after the same prompt: the
prompt's prefill cancels out. Prints ms a token, each method's ratio to speculum, the greedy agreement of
the first tokens and the CPU.

Usage:
    .venv/bin/python benchmarks/gguf_decoding.py FILE.gguf [--tokens 64] [--rounds 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from machine import cpu_name
from speculum.models import load_model
from speculum.models.gguf_files import cache_key
from speculum.models.paths import cache_dir

PROMPT = "The history of the printing press begins"


def speculum_tokens(model, prompt: list[int], count: int) -> list[int]:
    session = model.start(prompt)
    row, out = session.next_logprobs(), []
    for _ in range(count):
        out.append(int(np.argmax(row)))
        if len(out) < count:
            row = session.advance([out[-1]])
    return out


def llama_tokens(llama, prompt: list[int], count: int) -> list[int]:
    llama.reset()
    llama.eval(prompt)
    out = []
    for _ in range(count):
        out.append(int(np.argmax(llama.scores[llama.n_tokens - 1])))
        if len(out) < count:
            llama.eval([out[-1]])
    return out


def transformers_tokens(module, prompt: list[int], count: int) -> list[int]:
    with torch.inference_mode():
        ids = module.generate(torch.tensor([prompt]), max_new_tokens=count, min_new_tokens=count, do_sample=False)
    return ids[0, len(prompt):].tolist()


def step_breakdown(model, rounds: int = 30) -> dict:
    """ms of one decode step's forward, and of its products alone (each at one row): the blocks' and the
    head's. The rest is attention, norms, rotations and the Python between them."""
    forward = model.fused
    if forward is None:
        return {}

    def best(run) -> float:
        run()
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return 1000 * statistics.median(times)

    products = forward.products()
    blocks = sum(best(lambda p=p, x=torch.randn(1, w): p(x)) for p, w in products[:-1])
    head, width = products[-1]
    head_ms = best(lambda: head(torch.randn(1, width)))
    cache = model.new_cache()
    forward(torch.tensor([model.encode(PROMPT, chat=False)]), cache)

    def step() -> None:
        forward(torch.tensor([[5]]), cache)
        cache.trim(1)

    whole = best(step)
    return {"forward_ms": whole, "block_products_ms": blocks, "head_product_ms": head_ms,
            "rest_ms": whole - blocks - head_ms}


def timed(run, *args) -> tuple[float, list[int]]:
    started = time.perf_counter()
    out = run(*args)
    return time.perf_counter() - started, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", help="the GGUF file")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens a timed run decodes")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is reported)")
    parser.add_argument("--no-transformers", action="store_true", help="leave transformers out (slow on big models)")
    parser.add_argument("--dtype", default="float32", help="speculum's target (float32, or q8: 8-bit activations)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()

    import llama_cpp
    from transformers import AutoModelForCausalLM

    model = load_model(args.gguf, dtype=args.dtype, progress=False)
    prompt = model.encode(PROMPT, chat=False)
    threads = torch.get_num_threads()
    llama = llama_cpp.Llama(model_path=args.gguf, n_ctx=512, n_threads=threads, n_threads_batch=threads,
                            flash_attn=True, logits_all=True, verbose=False)
    methods = {"speculum": (speculum_tokens, model), "llama.cpp": (llama_tokens, llama)}
    if not args.no_transformers:
        folder = cache_dir() / f"{cache_key(Path(args.gguf))}-float32"       # what load_model converted it into
        module = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        methods["transformers"] = (transformers_tokens, module)
    costs: dict[str, list[float]] = {name: [] for name in methods}
    firsts: dict[str, list[int]] = {}
    for name, (run, handle) in methods.items():          # warm-up: kernels built, caches touched
        firsts[name] = run(handle, prompt, 16)
    for _ in range(args.rounds):
        for name, (run, handle) in methods.items():
            one, _ = timed(run, handle, prompt, 1)
            many, _ = timed(run, handle, prompt, args.tokens)
            costs[name].append((many - one) / (args.tokens - 1))
    ms = {name: 1000 * statistics.median(values) for name, values in costs.items()}
    report = {
        "cpu": cpu_name(), "threads": threads, "file": args.gguf, "dtype": args.dtype, "fused_forward": model.fused_forward,
        "grouped_layers": model.grouped_layers, "tokens": args.tokens, "rounds": args.rounds,
        "ms_per_token": ms, "speculum_speedup": {name: ms[name] / ms["speculum"] for name in ms},
        "first_16_agree_with_speculum": {name: firsts[name] == firsts["speculum"] for name in firsts},
        "speculum_step": step_breakdown(model),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.gguf} ({args.dtype}) on {report['cpu']}, {threads} threads; fused forward {model.fused_forward}, "
          f"{model.grouped_layers} layers on weight groups")
    for name in ms:
        print(f"  {name:<13} {ms[name]:7.2f} ms/token   speculum {ms[name] / ms['speculum']:5.2f}x faster"
              f"   first 16 greedy tokens = speculum's: {firsts[name] == firsts['speculum']}")
    if report["speculum_step"]:
        print("  speculum's step: " + ", ".join(f"{k[:-3].replace('_', ' ')} {v:.2f} ms"
                                                for k, v in report["speculum_step"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
