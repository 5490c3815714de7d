"""Serving benchmark: `speculum serve` on SmolLM2-135M-Instruct (PyTorch, float32) under concurrent load.

The server runs in this process as `speculum serve` runs it (the same app on uvicorn on a localhost port,
the engine on the main thread, HTTP on another, glibc's freed memory kept); clients are threads sending
greedy `/v1/completions` requests over HTTP with the real `openai` client, grounded prompts (summarise /
rewrite a given text, where prompt lookup pays). For each concurrency level and each draft (`none` = plain
decoding, `lookup` = prompt lookup with `gamma="auto"`, or `--drafts`) it reports aggregate tokens/s
and p50 / p95 request latency, side by side in one run, and checks every response against the solo greedy
output (end-of-sequence disabled, so each request emits exactly `--max-tokens` tokens). A new request's
prompt is fed inside the next packed step, so a level's prompt cost is estimated from each prompt's
prefill alone ("prompts alone s"), and "decoding phase" is tokens over the wall time minus that.

The peer is llama-cpp-python's own OpenAI-compatible server (`python -m llama_cpp.server`, the `[server]`
extra) on the same GGUF file (Q4_1 weights, which llama.cpp computes with quantised kernels, while speculum
runs the de-quantised float32 weights), driven by the same clients with the same prompt text; it serves one
request at a time. Its tokens/s count the tokens it returned (it may stop at end-of-sequence).

    .venv/bin/python benchmarks/serving.py                          # concurrency 1 4 8 16 (~10 min, 2 cores)
    .venv/bin/python benchmarks/serving.py --concurrency 1 4 --requests 8
    .venv/bin/python benchmarks/serving.py --batch-invariant        # each request in its own forward
    .venv/bin/python benchmarks/serving.py --drafts int8 --no-peer  # a draft model (the int8 twin) under load
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import openai  # noqa: E402
import uvicorn  # noqa: E402

from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)

import speculum  # noqa: E402
from speculum.cli.demo import PASSAGE  # noqa: E402
from speculum.models.memory.allocator import keep_freed_memory  # noqa: E402
from speculum.drafts import make_draft  # noqa: E402
from speculum.serving import Engine, create_app, serve_on_this_thread  # noqa: E402

PROMPTS = [
    f"Summarise the following text in three sentences.\n\n{PASSAGE}",
    f"Rewrite the following text for a ten-year-old.\n\n{PASSAGE}",
    f"List the facts stated in the following text, one per line.\n\n{PASSAGE}",
    f"Translate the key sentence of the following text into plain English.\n\n{PASSAGE}",
]


def run_levels(target, draft, args: argparse.Namespace, expected: list[str], prefill: list[float],
               levels: list[int]) -> list[dict]:
    """The concurrency ``levels`` against `speculum serve`'s app with ``draft``: the engine on this (the
    main) thread, HTTP on another, as the command runs them; the clients drive from a third."""
    engine = Engine(target, draft=draft, gamma="auto", eos_token_id=None,
                    max_batch=max(args.concurrency), max_waiting=1024, batch_invariant=args.batch_invariant,
                    background=False)
    app = create_app(engine, "smollm2-135m", encode_text=lambda text: target.encode(text, chat=True))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    results: list[dict] = []

    def drive() -> None:
        try:
            deadline = time.monotonic() + 60
            while not server.started:
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not start")
                time.sleep(0.05)
            url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"
            load(url, 1, 1, 4, expected=[""] * len(PROMPTS))            # warm-up
            results.extend(load(url, c, max(args.requests, c), args.max_tokens, expected, engine=engine,
                                prefill=prefill) for c in levels)
        finally:
            server.should_exit = True

    driver = threading.Thread(target=drive)
    driver.start()
    serve_on_this_thread(server, engine)
    driver.join()
    if len(results) != len(levels):
        raise RuntimeError("the load did not finish (see the error above)")
    return results


def start_peer(gguf: str):
    """llama-cpp-python's server on a free port; None when its [server] extra is not installed."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llama_cpp.server") is None:
        return None, None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
                                "--port", str(port), "--n_ctx", "2048", "--n_threads", str(os.cpu_count() or 2),
                                "--verbose", "False"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=5)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            client.models.list()
            return process, f"http://127.0.0.1:{port}/v1"
        except openai.APIConnectionError:
            time.sleep(0.5)
    process.terminate()
    return None, None


def solo_prefill_seconds(target) -> list[float]:
    """Each prompt's prefill alone (median of 3), what a request's prompt costs wherever it is fed."""
    seconds = []
    for prompt in PROMPTS:
        ids = target.encode(prompt, chat=True)[:-1]
        runs = []
        for _ in range(3):
            started = time.perf_counter()
            target.start(ids)
            runs.append(time.perf_counter() - started)
        seconds.append(statistics.median(runs))
    return seconds


def load(url: str, concurrency: int, requests: int, max_tokens: int, expected: list[str],
         prompts: list[str] | None = None, engine=None, prefill: list[float] | None = None) -> dict:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

    def one(i: int) -> tuple[float, int, bool]:
        started = time.perf_counter()
        reply = client.completions.create(model="smollm2-135m", prompt=(prompts or PROMPTS)[i % len(PROMPTS)],
                                          max_tokens=max_tokens, temperature=0)
        return (time.perf_counter() - started, reply.usage.completion_tokens,
                reply.choices[0].text == expected[i % len(PROMPTS)])

    before = (engine.metrics.draft_proposed, engine.metrics.target_forwards,
              engine.metrics.draft_accepted) if engine is not None else (0, 0, 0)
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - started
    latencies = sorted(r[0] for r in results)
    # The worker is busy throughout (the clients keep it fed); the prompts are fed inside the packed
    # steps, so the decoding phase is estimated as the wall time minus what the prompts cost alone.
    prefill = sum(prefill[i % len(PROMPTS)] for i in range(requests)) if prefill else 0.0
    proposed = engine.metrics.draft_proposed - before[0] if engine is not None else 0
    forwards = engine.metrics.target_forwards - before[1] if engine is not None else 0
    accepted = engine.metrics.draft_accepted - before[2] if engine is not None else 0
    tokens = sum(r[1] for r in results)
    return {"concurrency": concurrency, "requests": requests, "tokens_per_second": tokens / wall,
            "prefill_seconds": prefill, "decode_tokens_per_second": tokens / max(wall - prefill, 1e-9),
            "p50": statistics.median(latencies), "p95": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))],
            "all_identical": all(r[2] for r in results),
            # Draft tokens verified per block (a block is one request's part of a forward): gamma="auto"
            # drafts less where verifying proposals costs more than the tokens they bring.
            "proposed_per_block": proposed / forwards if forwards else 0.0,
            "acceptance": accepted / proposed if proposed else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--batch-invariant", action="store_true", help="each request in its own forward")
    parser.add_argument("--drafts", nargs="+", default=["none", "lookup"],
                        help="drafts to serve with, each beside plain decoding (`none`, first) (default: none lookup)")
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="skip llama-cpp-python's server")
    parser.add_argument("--dtype", default="float32", help="the target's precision (float32, bfloat16, q8, ...)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from speculum.models.backends import load_model

    keep_freed_memory()
    target = load_model(dtype=args.dtype)
    expected = [target.decode(speculum.generate(target, target.encode(p, chat=True), max_new_tokens=args.max_tokens,
                                                temperature=0, eos_token_id=None).tokens) for p in PROMPTS]
    prefill = solo_prefill_seconds(target)
    report = {"cpu": cpu_name(), "max_tokens": args.max_tokens, "batch_invariant": args.batch_invariant,
              "prefill_seconds_per_prompt": prefill, "runs": {}}
    drafts = ["none"] + [d for d in args.drafts if d != "none"]
    built = {draft: make_draft(draft, target) for draft in drafts}
    report["runs"] = {draft: [] for draft in drafts}
    # Level by level, every draft in turn: the runs a ratio compares are a minute apart at most, so the
    # drift of a shared machine moves both.
    for level in args.concurrency:
        for draft in drafts:
            report["runs"][draft].extend(run_levels(target, built[draft], args, expected, prefill, [level]))
    if args.peer:
        from speculum.models.paths import embedded_gguf_path

        process, url = start_peer(str(embedded_gguf_path()))
        if process is not None:
            # The same text the speculum runs tokenise (the chat template applied), as a raw prompt.
            texts = [target.tokenizer.decode(target.encode(p, chat=True)) for p in PROMPTS]
            load(url, 1, 1, 4, expected=[""] * len(PROMPTS), prompts=texts)
            report["runs"]["llama.cpp server"] = [load(url, c, max(args.requests, c), args.max_tokens,
                                                       [""] * len(PROMPTS), prompts=texts) for c in args.concurrency]
            process.terminate()
            process.wait(30)
    if args.json:
        print(json.dumps(report))
        return
    mode = "batch-invariant (one forward per request)" if args.batch_invariant else "packed batched forward"
    print(f"CPU: {report['cpu']}; greedy, {args.max_tokens} tokens per request, PyTorch {args.dtype}, {mode}")
    plain = report["runs"]["none"]
    for draft in drafts:
        runs = report["runs"][draft]
        print(f"draft {draft}: concurrency | tok/s | p50 s | p95 s | vs plain | vs c=1 | prompts alone s | decoding phase "
              f"tok/s | draft tokens per block | acceptance | identical")
        for run, base in zip(runs, plain):
            print(f"{run['concurrency']:>11} | {run['tokens_per_second']:>6.1f} | {run['p50']:>5.2f} | "
                  f"{run['p95']:>5.2f} | {run['tokens_per_second'] / base['tokens_per_second']:>6.2f}x | "
                  f"{run['tokens_per_second'] / runs[0]['tokens_per_second']:>5.2f}x | "
                  f"{run['prefill_seconds']:>5.1f} | "
                  f"{run['decode_tokens_per_second']:>6.1f} | {run['proposed_per_block']:>5.2f} | "
                  f"{run['acceptance']:.2f} | {run['all_identical']}")
    for peer in report["runs"].get("llama.cpp server", []):
        print(f"llama.cpp server, concurrency {peer['concurrency']}: {peer['tokens_per_second']:.1f} tok/s, "
              f"p50 {peer['p50']:.2f} s, p95 {peer['p95']:.2f} s")


if __name__ == "__main__":
    main()
