"""lm-evaluation-harness on `speculum serve` against lm-eval's own `hf` backend, on SmolLM2-135M-Instruct.

A 5-shot multiple-choice task made here (tests/eval_tasks.py: arithmetic, 4 choices, the same five
examples before every question), run three ways on the same cached float32 checkpoint, in one process
each, side by side:

- lm-eval `hf` (transformers, batch size 1: every choice re-runs its context; and batch size 8);
- lm-eval `local-completions` on `speculum serve` (remote tokenizer), `num_concurrent` 1 and 8.

Reported: wall time of each; the tokens the server forwarded to score the prompts with prefix sharing
against the tokens one-request-at-a-time scoring feeds (every prompt whole, from `/metrics`); the largest
per-item log-likelihood difference from `hf` (goal: below 1e-4 nats), greediness and accuracy equal;
whether the echoed log-likelihoods at concurrency 1 and 8 are bitwise identical.

    .venv/bin/python benchmarks/eval.py                 # 200 items (~10 min on 2 cores)
    .venv/bin/python benchmarks/eval.py --items 40      # a quick look
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from eval_tasks import write_arithmetic_tasks  # noqa: E402

RUNNER = """
import json, sys, time
import lm_eval
from lm_eval.tasks import TaskManager
model, model_args, include = sys.argv[1:4]
started = time.perf_counter()
result = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["arith_mc"],
                                 task_manager=TaskManager(include_path=include), log_samples=True)
seconds = time.perf_counter() - started
print("RESULT " + json.dumps({"seconds": seconds, "acc": result["results"]["arith_mc"]["acc,none"],
                              "resps": [r[0] for s in result["samples"]["arith_mc"] for r in s["resps"]],
                              "args": [list(a) for s in result["samples"]["arith_mc"] for a in s["arguments"]]}))
"""


def lm_eval(model: str, model_args: str, include: Path) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, "-c", RUNNER, model, model_args, str(include)], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-4000:])
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}


def serve_and_run(include: Path, concurrency: int) -> tuple[dict, dict]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "speculum", "serve", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        out = lm_eval("local-completions", f"model=smollm2-135m,base_url={url}/v1/completions,"
                      f"tokenizer_backend=remote,num_concurrent={concurrency},max_retries=1", include)
        return out, metrics(url)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


def float64_check(checkpoint: Path, args: list, ours: list[float], hf: list[float], top: int = 20) -> str:
    """On the ``top`` requests where speculum and lm-eval's ``hf`` differ most, each one's distance to the
    same checkpoint's forward in float64 (tokenized as lm-eval's ``_encode_pair`` does)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    worst = sorted(range(len(ours)), key=lambda i: -abs(ours[i] - hf[i]))[:top]
    ours_err, hf_err = [], []
    for i in worst:
        context, continuation = args[i]
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
        start = len(tokenizer(context, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            rows = torch.log_softmax(model(torch.tensor([whole[:-1]])).logits[0], dim=-1)
        exact = float(sum(rows[j - 1, whole[j]] for j in range(start, len(whole))))
        ours_err.append(abs(ours[i] - exact))
        hf_err.append(abs(hf[i] - exact))
    return (f"on the {top} requests where they differ most, distance to the float64 forward: speculum max "
            f"{max(ours_err):.2e} (median {sorted(ours_err)[top // 2]:.2e}), hf max {max(hf_err):.2e} "
            f"(median {sorted(hf_err)[top // 2]:.2e})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--shots", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import speculum
    from speculum.models.paths import cache_dir

    speculum.load_model()
    checkpoint = next(Path(cache_dir()).glob("smollm2-135m-float32*"))
    include = write_arithmetic_tasks(Path(tempfile.mkdtemp()) / "tasks", items=args.items, shots=args.shots)
    hf = lm_eval("hf", f"pretrained={checkpoint},dtype=float32,device=cpu,batch_size=1", include)
    hf8 = lm_eval("hf", f"pretrained={checkpoint},dtype=float32,device=cpu,batch_size=8", include)
    runs = {c: serve_and_run(include, c) for c in (1, 8)}
    print(f"# lm-eval on speculum serve, {args.items} items x 4 choices, {args.shots}-shot, {cpu_name()}\n")
    print("| run | wall s | x hf | accuracy | max |loglik - hf| |")
    print("|---|---:|---:|---:|---:|")
    print(f"| lm-eval hf (batch 1) | {hf['seconds']:.1f} | 1.00 | {hf['acc']:.3f} | 0 |")
    diff8 = max(abs(a[0] - b[0]) for a, b in zip(hf8["resps"], hf["resps"]))
    print(f"| lm-eval hf (batch 8) | {hf8['seconds']:.1f} | {hf['seconds'] / hf8['seconds']:.2f} | "
          f"{hf8['acc']:.3f} | {diff8:.2e} |")
    for concurrency, (out, _) in runs.items():
        diff = max(abs(a[0] - b[0]) for a, b in zip(out["resps"], hf["resps"]))
        print(f"| local-completions, num_concurrent {concurrency} | {out['seconds']:.1f} | "
              f"{hf['seconds'] / out['seconds']:.2f} | {out['acc']:.3f} | {diff:.2e} |")
    for concurrency, (_, m) in runs.items():
        forwarded, reused = m["speculum_scored_tokens_forwarded_total"], m["speculum_scored_tokens_reused_total"]
        print(f"\nnum_concurrent {concurrency}: scoring forwarded {forwarded:,.0f} tokens in "
              f"{m['speculum_scoring_forwards_total']:,.0f} forwards for {m['speculum_prompts_scored_total']:,.0f} "
              f"prompts; one request at a time feeds {forwarded + reused:,.0f} "
              f"({(forwarded + reused) / forwarded:.1f}x more)")
    ours = [r[0] for r in runs[8][0]["resps"]]
    print("\n" + float64_check(checkpoint, hf["args"], ours, [r[0] for r in hf["resps"]]))
    same = runs[1][0]["resps"] == runs[8][0]["resps"]
    print(f"\nlog-likelihoods at concurrency 1 and 8 bitwise identical: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
