"""Speculative decoding on SmolLM2-135M-Instruct (float32, PyTorch): speculum vs transformers, side by side.

For each task (open-ended chat, summarising a passage, rewriting code) and greedy decoding of a fixed
number of new tokens, measures tokens/s of

* our plain decoding and transformers' plain ``generate``;
* ours with each draft (prompt lookup, online n-gram, int8 twin, bf16 twin, first-K-layers self-draft),
  at a fixed γ and at ``gamma="auto"``;
* transformers' assisted generation with the same drafts (``prompt_lookup_num_tokens=`` for lookup,
  ``assistant_model=`` for the twins; it has no n-gram draft),

prints ratios to our plain decoding and to transformers' assisted generation with the same draft, and
asserts that every greedy output equals plain greedy decoding. End-of-sequence is disabled on both sides
so every run emits exactly the same number of tokens.

    .venv/bin/python benchmarks/decoding_llm.py                      # full run (~6-10 min idle, 2 cores)
    .venv/bin/python benchmarks/decoding_llm.py --repeats 3          # median of 3 per run (~30 min)
    .venv/bin/python benchmarks/decoding_llm.py --tasks summarise --max-new-tokens 32 --drafts lookup
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import speculum  # noqa: E402
from speculum.cli.demo import PASSAGE  # noqa: E402
from speculum.models.select import make_draft  # noqa: E402

CODE = '''def load_scores(path):
    scores = {}
    f = open(path)
    for line in f.readlines():
        parts = line.strip().split(",")
        name = parts[0]
        score = int(parts[1])
        if name in scores:
            scores[name] = scores[name] + score
        else:
            scores[name] = score
    f.close()
    return scores'''

TASKS = {
    "chat": "What are some good ways to spend a rainy weekend at home? Give me a few ideas.",
    "summarise": f"Summarise the following passage.\n\n{PASSAGE}",
    "rewrite": f"Rewrite this Python function to use a with statement and collections.defaultdict, "
               f"keeping everything else the same.\n\n{CODE}",
}
DRAFTS = ("lookup", "ngram", "int8", "bf16", "layers:8")
# Fixed γ per draft, chosen from field.md's costs: cheap proposers can afford long blocks (verifying 8 tokens
# costs ~1.7 decode steps), the twins cost ~0.5-0.6 steps a token, so short blocks.
FIXED_GAMMA = {"lookup": 8, "ngram": 4, "int8": 2, "bf16": 3, "layers:8": 2}
HF_PROMPT_LOOKUP_TOKENS = 10  # transformers' documented default for prompt_lookup_num_tokens


@dataclass
class Run:
    label: str
    seconds: float
    tokens: list[int]
    tokens_per_forward: float | None = None

    def rate(self) -> float:
        return len(self.tokens) / self.seconds


def ours(target, prompt_ids, n, *, draft=None, gamma=4) -> Run:
    """Our greedy decoding; ``draft`` is a model, None, or a zero-argument factory (proposers are stateful,
    so each run gets a fresh one: an online n-gram must not learn from the previous run's output)."""
    draft = draft() if callable(draft) else draft
    started = time.perf_counter()
    result = speculum.generate(target, prompt_ids, draft=draft, max_new_tokens=n, gamma=gamma, temperature=0,
                               eos_token_id=None)
    seconds = time.perf_counter() - started
    return Run("", seconds, result.tokens, result.stats.tokens_per_target_forward)


def transformers_generate(target, prompt_ids, n, **assist) -> Run:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        started = time.perf_counter()
        # An explicit all-ones mask: otherwise transformers infers one from pad_token_id (== eos == <|im_end|>)
        # and masks the chat template's own <|im_end|> tokens out of the prompt.
        out = target.module.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                     eos_token_id=None, pad_token_id=target.eos_token_id, **assist)
        seconds = time.perf_counter() - started
    return Run("", seconds, out[0, len(prompt_ids):].tolist())


def median_run(repeats: int, measure) -> Run:
    """The run with the median time of ``repeats`` calls of ``measure()`` (outputs must agree): one-off
    stalls of a shared machine move a single measurement by ±25 %."""
    runs = sorted((measure() for _ in range(repeats)), key=lambda run: run.seconds)
    assert all(run.tokens == runs[0].tokens for run in runs), "repeated runs produced different outputs"
    return runs[len(runs) // 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--drafts", nargs="+", default=list(DRAFTS), help=f"subset of {DRAFTS}")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="time each run this many times, keep the median")
    parser.add_argument("--no-transformers", dest="transformers", action="store_false",
                        help="skip transformers' runs (ours only)")
    args = parser.parse_args(argv)

    target = speculum.load_model("smollm2-135m")
    print(f"SmolLM2-135M-Instruct float32, {torch.get_num_threads()} threads, greedy, "
          f"{args.max_new_tokens} new tokens, eos disabled", flush=True)
    # Model drafts are built once and shared by every task (their sessions carry no state between runs).
    model_drafts = {spec: make_draft(spec, target) for spec in args.drafts if spec not in ("lookup", "ngram")}
    # transformers runs the model as users load it: PyTorch's default kernels, not our pre-packed oneDNN
    # Linear layers (speculum.models.prepack), and its assistants are built from that copy.
    tf_target = speculum.load_model("smollm2-135m", prepack=False) if args.transformers else None
    tf_drafts = {spec: make_draft(spec, tf_target) for spec in model_drafts} if args.transformers else {}
    warm = target.encode("Hello")  # first calls pay one-off initialisation: keep it out of the timings
    ours(target, warm, 4)
    for draft in model_drafts.values():
        ours(target, warm, 4, draft=draft, gamma=2)
    if args.transformers:
        transformers_generate(tf_target, warm, 4)

    mismatches, goals = [], []
    for task in args.tasks:
        prompt_ids = target.encode(TASKS[task])
        n = args.max_new_tokens
        print(f"\n## {task} ({len(prompt_ids)} prompt tokens)", flush=True)
        R = args.repeats
        plain = median_run(R, lambda: ours(target, prompt_ids, n))
        rows = [("ours plain", plain, None)]
        hf_plain = median_run(R, lambda: transformers_generate(tf_target, prompt_ids, n)) if args.transformers else None
        if hf_plain:
            rows.append(("transformers plain", hf_plain, None))
        for spec in args.drafts:
            draft = model_drafts.get(spec) or (lambda spec=spec: make_draft(spec, target))
            fixed = median_run(R, lambda: ours(target, prompt_ids, n, draft=draft, gamma=FIXED_GAMMA.get(spec, 4)))
            auto = median_run(R, lambda: ours(target, prompt_ids, n, draft=draft, gamma="auto"))
            hf = None
            if args.transformers and spec != "ngram":
                assist = ({"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS} if spec == "lookup"
                          else {"assistant_model": tf_drafts[spec].module})
                try:
                    hf = median_run(R, lambda: transformers_generate(tf_target, prompt_ids, n, **assist))
                except Exception as exc:  # report, keep measuring the rest
                    print(f"transformers {spec}: failed: {type(exc).__name__}: {exc}".splitlines()[0])
            rows += [(f"ours {spec} γ={FIXED_GAMMA.get(spec, 4)}", fixed, hf), (f"ours {spec} auto", auto, hf)]
            print(f"  measured {spec}: ours fixed {fixed.rate():.2f}, auto {auto.rate():.2f}, transformers "
                  f"{hf.rate() if hf else float('nan'):.2f} tokens/s (plain {plain.rate():.2f})", flush=True)
            if hf:
                rows.append((f"transformers {spec}", hf, None))
        print(f"{'method':<26}{'tokens/s':>9}{'x ours plain':>14}{'x tf same draft':>17}{'tok/fwd':>9}  same")
        for label, run, hf in rows:  # printed once the task's runs are done: ratios need the whole row set
            same = run.tokens == plain.tokens
            if not same:
                mismatches.append((task, label))
            vs_hf = f"{run.rate() / hf.rate():.2f}" if hf else "-"
            tpf = f"{run.tokens_per_forward:.2f}" if run.tokens_per_forward else "-"
            print(f"{label:<26}{run.rate():>9.2f}{run.rate() / plain.rate():>14.2f}{vs_hf:>17}{tpf:>9}  "
                  f"{'yes' if same else 'NO'}", flush=True)
        goals += goal_checks(task, rows, plain, hf_plain)
    print("\n## goals (issue 3)")
    for ok, text in goals:
        print(f"{'met ' if ok else 'MISS'}  {text}")
    if mismatches:
        print(f"\nOutputs differing from plain greedy decoding: {mismatches}")
    # Ours (every draft) and transformers' plain generate must match exactly; transformers' assisted runs are
    # reported above but not asserted (its batched verification may flip float32 near-ties, field.md).
    strict = [m for m in mismatches if m[1].startswith("ours") or m[1] == "transformers plain"]
    assert not strict, f"greedy outputs differ from plain greedy decoding: {strict}"
    return 0


def goal_checks(task: str, rows, plain: Run, hf_plain: Run | None) -> list[tuple[bool, str]]:
    """The issue's performance goals for one task, as (met, description) pairs."""
    checks = []
    if hf_plain:
        ratio = plain.rate() / hf_plain.rate()
        checks.append((ratio >= 1.0, f"{task}: ours plain {ratio:.2f}x transformers plain (goal >= 1)"))
    for label, run, hf in rows:
        if not label.startswith("ours ") or label == "ours plain":
            continue
        speedup = run.rate() / plain.rate()
        if label.startswith("ours lookup") and task in ("summarise", "rewrite"):
            checks.append((speedup >= 2.0, f"{task}: {label} {speedup:.2f}x ours plain (goal >= 2.0)"))
        if label.endswith(" auto"):
            checks.append((speedup >= 0.95, f"{task}: {label} {speedup:.2f}x ours plain (goal >= 0.95)"))
        if hf is not None:
            needed = 1.25 if hf_plain is not None and hf.rate() < hf_plain.rate() else 1.0
            ratio = run.rate() / hf.rate()
            checks.append((ratio >= needed, f"{task}: {label} {ratio:.2f}x transformers with the same draft "
                                            f"(goal >= {needed})"))
    return checks


if __name__ == "__main__":
    sys.exit(main())
