"""`speculum serve` beside the strongest CPU serving peers, llama.cpp's `llama-server` and OpenVINO GenAI.

Every server is a subprocess on 127.0.0.1 driven by the same HTTP clients (`/v1/completions`, greedy,
grounded prompts that rewrite or extract from a passage, `--max-tokens` answers that stop at eos; prompt
processing included; `cache_prompt: false` for llama-server so it reuses nothing between requests), one
server at a time, the servers in turn within each round, `--rounds` rounds (median reported):

- speculum: `speculum serve` on the float32 checkpoint and on its int8, bfloat16 and q8 targets (`--dtype`), plain
  (`--draft none`) and `--draft lookup`;
- llama-server (`benchmarks/peers.py setup` builds it and the GGUF files) on F32 and Q8_0, plain,
  `--spec-type ngram-mod` and `--spec-type ngram-simple` (n 3, m 10), `-t 2 -tb 2 -np 8 -c 8192`;
- OpenVINO GenAI's `ContinuousBatchingPipeline` (the `[bench]` extra) behind a minimal HTTP front
  (`benchmarks/openvino_server.py`) on the F16 GGUF computed in float32 and on Q8_0 at its own precision,
  plain and with its prompt lookup.

Reported: aggregate tokens/s at each concurrency, ms per token of one stream, resident memory after the
run (VmRSS), and determinism: the prompts at concurrency 1 and then all at once; how many answers differ
from the concurrency-1 answer.

    .venv/bin/python benchmarks/peers.py setup                    # once (~16 min)
    .venv/bin/python benchmarks/serving_peers.py                  # ~15 min on 2 cores
    .venv/bin/python benchmarks/serving_peers.py --servers speculum-plain llama-f32 --rounds 1
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)
from peers import paths  # noqa: E402  (benchmarks/peers.py)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from speculum.cli.demo import PASSAGE  # noqa: E402

TASKS = ["Rewrite the following text in plain words.", "List the facts stated in the following text, one per line.",
         "Extract every number in the following text with what it counts.", "Summarise the following text in "
         "three sentences.", "Rewrite the following text for a ten-year-old.", "Copy the first two sentences of "
         "the following text.", "Quote the sentence of the following text that names a place.", "Rewrite the "
         "following text in the past tense."]


def servers() -> dict[str, list[str]]:
    found = paths()
    llama = [found["llama_server"], "-t", "2", "-tb", "2", "-np", "8", "-c", "8192", "--host", "127.0.0.1"]
    speculum = [sys.executable, "-m", "speculum", "serve", "--host", "127.0.0.1", "--max-batch", "8"]
    table = {"speculum-plain": speculum + ["--draft", "none"], "speculum-lookup": speculum + ["--draft", "lookup"],
             "speculum-int8-plain": speculum + ["--draft", "none", "--dtype", "int8"],
             "speculum-int8-lookup": speculum + ["--draft", "lookup", "--dtype", "int8"],
             "speculum-bf16-plain": speculum + ["--draft", "none", "--dtype", "bfloat16"],
             "speculum-bf16-lookup": speculum + ["--draft", "lookup", "--dtype", "bfloat16"],
             "speculum-q8-plain": speculum + ["--draft", "none", "--dtype", "q8"],
             "speculum-q8-lookup": speculum + ["--draft", "lookup", "--dtype", "q8"]}
    for kind in ("F32", "Q8_0"):
        base = llama + ["-m", found["gguf"][kind]]
        name = f"llama-{kind.lower().replace('_', '')}"
        table[name] = base
        table[f"{name}-ngram-mod"] = base + ["--spec-type", "ngram-mod"]
        table[f"{name}-ngram-simple"] = base + ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                                "--spec-ngram-simple-size-m", "10"]
    # OpenVINO GenAI reads F16 and Q8_0 GGUF files, not F32: its closest to the float32 target is F16 weights
    # computed in float32; on Q8_0 it picks its own precision (bfloat16 on CPUs with AMX or AVX-512 BF16).
    openvino = [sys.executable, str(Path(__file__).with_name("openvino_server.py")), "--max-batch", "8"]
    for name, kind, precision in (("openvino-f16", "F16", "f32"), ("openvino-q80", "Q8_0", "default")):
        base = openvino + ["--model", found["gguf"][kind], "--precision", precision]
        table[name] = base
        table[f"{name}-lookup"] = base + ["--prompt-lookup"]
    return table


def start(command: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(command + ["--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{command[0]} exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"{' '.join(command)} did not come up")


def resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def ask(url: str, prompt: str, max_tokens: int) -> tuple[str, int, float]:
    started = time.perf_counter()
    reply = httpx.post(f"{url}/v1/completions", timeout=600,
                       json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "cache_prompt": False})
    reply.raise_for_status()
    body = reply.json()
    return body["choices"][0]["text"], body["usage"]["completion_tokens"], time.perf_counter() - started


def level(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[float, list[str], float]:
    """Aggregate tokens/s with ``concurrency`` clients over all ``prompts``, the answers, and ms per token of
    the requests (their latency over their tokens, median)."""
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: ask(url, p, max_tokens), prompts))
    wall = time.perf_counter() - started
    per_token = statistics.median(seconds / max(tokens, 1) * 1e3 for _, tokens, seconds in results)
    return sum(tokens for _, tokens, _ in results) / wall, [text for text, _, _ in results], per_token


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", nargs="+", default=None, help="which servers (default: all)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    table = servers()
    chosen = args.servers or list(table)
    # The chat template of the embedded model, applied by hand so every server gets the same raw text.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import speculum

    target = speculum.load_model()
    prompts = [target.tokenizer.decode(target.encode(f"{task}\n\n{PASSAGE}", chat=True)) for task in TASKS]
    del target
    rates: dict[str, dict[int, list[float]]] = {name: {c: [] for c in args.concurrency} for name in chosen}
    stream_ms: dict[str, list[float]] = {name: [] for name in chosen}
    memory: dict[str, float] = {}
    changed: dict[str, int] = {}
    for round_ in range(args.rounds):
        for name in chosen:
            process, url = start(table[name])
            try:
                ask(url, prompts[0], 4)                                      # warm-up
                solo = None                                                  # the answers at concurrency 1
                for concurrency in args.concurrency:
                    rate, answers, per_token = level(url, prompts, concurrency, args.max_tokens)
                    rates[name][concurrency].append(rate)
                    if concurrency == 1:
                        stream_ms[name].append(per_token)
                        solo = answers
                    if concurrency == max(args.concurrency) and round_ == 0 and solo is not None:
                        changed[name] = sum(a != b for a, b in zip(answers, solo))
                memory[name] = max(memory.get(name, 0.0), resident_mib(process.pid))
            finally:
                process.terminate()
                process.wait(60)
    report = {"cpu": cpu_name(), "max_tokens": args.max_tokens, "rounds": args.rounds,
              "rows": {name: {"tok_s": {c: statistics.median(v) for c, v in rates[name].items()},
                              "ms_per_token": statistics.median(stream_ms[name]) if stream_ms[name] else None,
                              "resident_mib": memory[name],
                              f"changed_at_{max(args.concurrency)}": changed.get(name)} for name in chosen}}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"# Serving beside llama-server, {report['cpu']}, {os.cpu_count()} cores, {len(prompts)} grounded prompts, "
          f"{args.max_tokens}-token greedy answers, median of {args.rounds} rounds\n")
    head = " | ".join(f"c={c} tok/s" for c in args.concurrency)
    print(f"| server | {head} | ms/token, one stream | resident MiB | answers changed at c={max(args.concurrency)} |")
    print("|---|" + "---:|" * (len(args.concurrency) + 3))
    for name, row in report["rows"].items():
        cells = " | ".join(f"{row['tok_s'][c]:.1f}" for c in args.concurrency)
        stream = "" if row["ms_per_token"] is None else f"{row['ms_per_token']:.1f}"      # no concurrency 1
        changed_here = row[f"changed_at_{max(args.concurrency)}"]
        print(f"| {name} | {cells} | {stream} | {row['resident_mib']:.0f} | "
              f"{'' if changed_here is None else f'{changed_here} of {len(prompts)}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
