"""lm-evaluation-harness on `speculum serve` against lm-eval's own `hf` backend, on SmolLM2-135M-Instruct.

Three task shapes made here (tests/support/eval_tasks.py), nothing downloaded:

- `arith_mc`: 5-shot multiple choice, arithmetic, 4 choices, the same five examples before every question;
- `next_mc`: 3-shot multiple choice with a short context ("In the months, what comes after June?"),
  4 choices, 56 questions (224 requests);
- `paragraphs_ppl`: `loglikelihood_rolling` (perplexity) of 8 paragraphs of the repository's docs.

Each runs on the same cached float32 checkpoint, one lm-eval process per run, side by side: lm-eval `hf`
(transformers, batch size 1, and batch size 8 with `--hf-batch 8`) and lm-eval `local-completions` on
`speculum serve` (remote tokenizer) at `num_concurrent` 1 and 8.

lm-eval indexes only the tasks made here (``TaskManager(include_defaults=False)``): its index of the thousands
of tasks it ships takes 6-8 s on 2 cores, the same for every backend, and is not what is compared. The wall
time still holds the rest of lm-eval's own start (importing torch and transformers, collecting its environment
report: about 4 s), the same for every backend.

Reported per shape: wall time of each and its ratio to `hf` (batch 1); accuracy (or word perplexity) both
ways; the largest per-request log-likelihood difference from `hf`; the largest distance of each backend's
per-request log-likelihoods to the same checkpoint's forward in float64 (every request; goal: below 1e-4
nats); the tokens the server forwarded against those one-request-at-a-time scoring feeds (`/metrics`);
whether the log-likelihoods at concurrency 1 and 8 are bitwise identical.

    .venv/bin/python benchmarks/eval.py                  # all three shapes (~15 min on 2 cores)
    .venv/bin/python benchmarks/eval.py --items 40 --shapes next_mc,paragraphs_ppl
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
from support.eval_tasks import write_arithmetic_tasks, write_next_tasks, write_rolling_task  # noqa: E402

PREFIX = 1      # the token before a rolling window: SmolLM2's BOS, lm-eval hf's default, named to the server's
RUNNER = """
import json, sys, time
import lm_eval
from lm_eval.tasks import TaskManager
model, model_args, include, task = sys.argv[1:5]
started = time.perf_counter()
result = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task],
                                 task_manager=TaskManager(include_path=include, include_defaults=False),
                                 log_samples=True)
seconds = time.perf_counter() - started
metrics = result["results"][task]
score = metrics.get("acc,none", metrics.get("word_perplexity,none"))
def flat(r):                  # (loglik, is_greedy) for a choice, a bare loglik for a rolling request
    while isinstance(r, (list, tuple)):
        r = r[0]
    return r
print("RESULT " + json.dumps({"seconds": seconds, "score": score,
                              "resps": [flat(r) for s in result["samples"][task] for r in s["resps"]],
                              "args": [list(a) for s in result["samples"][task] for a in s["arguments"]]}))
"""


def lm_eval(model: str, model_args: str, include: Path, task: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, "-c", RUNNER, model, model_args, str(include), task], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-4000:])
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}


def serve_and_run(include: Path, task: str, concurrency: int) -> tuple[dict, dict]:
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
                      f"tokenizer_backend=remote,num_concurrent={concurrency},max_retries=1,"
                      f"custom_prefix_token_id={PREFIX}", include, task)
        return out, metrics(url)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


def float64_distances(checkpoint: Path, args: list, runs: dict[str, list[float]]) -> dict[str, float]:
    """Per run, the largest distance of its per-request log-likelihoods to the checkpoint's forward in
    float64 (tokenized as lm-eval does: ``_encode_pair`` for a context and continuation, the prefix token
    then the text for a rolling request), over every request."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    worst = {name: 0.0 for name in runs}
    for i, request in enumerate(args):
        if len(request) == 1 or not request[0]:          # rolling: the whole text after the prefix token
            whole = [PREFIX] + tokenizer(request[-1], add_special_tokens=False)["input_ids"]
            start = 1
        else:
            context, continuation = request[0], request[1]
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
            start = len(tokenizer(context, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            rows = torch.log_softmax(model(torch.tensor([whole[:-1]])).logits[0], dim=-1)
        exact = float(sum(rows[j - 1, whole[j]] for j in range(start, len(whole))))
        for name, values in runs.items():
            worst[name] = max(worst[name], abs(values[i] - exact))
    return worst


def doc_paragraphs(count: int = 8) -> list[str]:
    """``count`` prose paragraphs of the repository's docs (no tables, lists, code or headings), 400 to
    1,500 characters each, in a fixed order."""
    found = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for block in path.read_text(encoding="utf-8").split("\n\n"):
            text = " ".join(block.split())
            if 400 <= len(text) <= 1500 and text[0].isalpha() and "|" not in text and "```" not in text:
                found.append(text)
    return found[:count]


def run_shape(task: str, include: Path, checkpoint: Path, hf_batches: list[int]) -> None:
    hf = {b: lm_eval("hf", f"pretrained={checkpoint},dtype=float32,device=cpu,batch_size={b}", include, task)
          for b in hf_batches}
    runs = {c: serve_and_run(include, task, c) for c in (1, 8)}
    base = hf[hf_batches[0]]
    score = "accuracy" if task.endswith("_mc") else "word perplexity"
    print(f"\n## {task}: {len(base['resps'])} requests\n")
    print(f"| run | wall s | x hf | {score} | max abs(loglik - hf) |")
    print("|---|---:|---:|---:|---:|")
    named = {}
    for b, out in hf.items():
        named[f"lm-eval hf (batch {b})"] = out
    for c, (out, _) in runs.items():
        named[f"local-completions, num_concurrent {c}"] = out
    for name, out in named.items():
        diff = max(abs(a - b) for a, b in zip(out["resps"], base["resps"]))
        print(f"| {name} | {out['seconds']:.1f} | {base['seconds'] / out['seconds']:.2f} | {out['score']:.4f} | "
              f"{diff:.2e} |")
    for c, (_, m) in runs.items():
        forwarded, reused = m["speculum_scored_tokens_forwarded_total"], m["speculum_scored_tokens_reused_total"]
        print(f"\nnum_concurrent {c}: scoring forwarded {forwarded:,.0f} tokens in "
              f"{m['speculum_scoring_forwards_total']:,.0f} forwards for {m['speculum_prompts_scored_total']:,.0f} "
              f"prompts; one request at a time feeds {forwarded + reused:,.0f} "
              f"({(forwarded + reused) / max(forwarded, 1):.1f}x more)")
    distances = float64_distances(checkpoint, base["args"], {name: out["resps"] for name, out in named.items()})
    print("\nlargest distance to the float64 forward, over every request: " +
          "; ".join(f"{name} {value:.2e}" for name, value in distances.items()))
    one, eight = runs[1][0]["resps"], runs[8][0]["resps"]
    differing = [abs(a - b) for a, b in zip(one, eight) if a != b]
    print(f"log-likelihoods at concurrency 1 and 8 bitwise identical: {not differing and len(one) == len(eight)}"
          + (f" ({len(differing)} of {len(one)} differ, by at most {max(differing):.2e})" if differing else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=200, help="arith_mc questions (default: 200)")
    parser.add_argument("--shots", type=int, default=5, help="arith_mc examples (default: 5)")
    parser.add_argument("--next-items", type=int, default=56, help="next_mc questions (default: 56)")
    parser.add_argument("--shapes", default="arith_mc,next_mc,paragraphs_ppl")
    parser.add_argument("--hf-batch", default="1", help="lm-eval hf batch sizes, the first one the baseline")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import speculum
    from speculum.models.paths import cache_dir

    speculum.load_model()
    checkpoint = next(Path(cache_dir()).glob("smollm2-135m-float32*"))
    include = Path(tempfile.mkdtemp()) / "tasks"
    write_arithmetic_tasks(include, items=args.items, shots=args.shots)
    write_next_tasks(include, items=args.next_items, shots=3)
    write_rolling_task(include, doc_paragraphs())
    print(f"# lm-eval on speculum serve against lm-eval hf, {cpu_name()}")
    for task in args.shapes.split(","):
        run_shape(task, include, checkpoint, [int(b) for b in args.hf_batch.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
