"""Where the float32 rounding of a prompt's log-likelihood lies, and what removing it costs.

The lm-eval benchmark (benchmarks/eval.py) compares speculum's echoed log-likelihoods with lm-eval's `hf`
backend; both are float32 forwards of one checkpoint, each with its own rounding. This script measures,
on the same 5-shot arithmetic task (every choice's context + continuation, tokenized as one string), the
continuation's log-likelihood from:

- transformers in float32 with a float32 log-softmax (what lm-eval's `hf` computes at batch size 1), and
  in float64 (the reference);
- speculum's prompt scorer (`PromptScorer`, the server's echo path), as shipped;
- the same scorer with some of its computation in float64 (``--variants``): the vocabulary head; the
  head, the attention output and the MLP down projection; every product; attention; attention with the
  head, the attention output and the MLP down projection.

It prints each one's distance to float64 and to transformers' float32, and each variant's scorer time
against float32 (one prompt at a time, each after the last: engine time only).

    .venv/bin/python benchmarks/eval_precision.py --items 200      # the 800 requests of eval.py (~25 min)
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from support.eval_tasks import write_arithmetic_tasks  # noqa: E402


def requests(tokenizer, items: int) -> list[tuple[list[int], int]]:
    """(token ids of context + continuation, index of the continuation's first token) per choice."""
    folder = write_arithmetic_tasks(Path(tempfile.mkdtemp()), items=items, shots=5)
    rows = [json.loads(line) for line in open(folder / "arith_mc.jsonl")]
    shots = [json.loads(line) for line in open(folder / "arith_fewshot.jsonl")][:5]
    context = "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)
    out = []
    for row in rows:
        start = len(tokenizer(context + f"Question: {row['question']}\nAnswer:")["input_ids"])
        for choice in row["choices"]:
            out.append((tokenizer(context + f"Question: {row['question']}\nAnswer: " + choice)["input_ids"], start))
    return out


# The scorer's float64 variants: (products in float64 by block field, head in float64, attention in float64).
VARIANTS = {"head": ((), True, False), "head-out-down": (("out", "down"), True, False),
            "products": (("qkv", "out", "gate_up", "down"), True, False), "attention": ((), False, True),
            "attention-head-out-down": (("out", "down"), True, True)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=200, help="questions (4 choices each)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="the scorer's float64 variants to measure")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    import speculum
    from speculum.models.prompt_scores import PromptScorer

    hf_logging.disable_progress_bar()
    target = speculum.load_model("smollm2-135m")
    checkpoint = target.module.config._name_or_path
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    reqs = requests(tokenizer, args.items)

    def continuation(logits: torch.Tensor, ids: list[int], start: int) -> float:
        # In the forward's own dtype, as lm-eval's `hf` model computes its log-softmax.
        rows = torch.log_softmax(logits, dim=-1)
        return float(sum(float(rows[j - 1, ids[j]]) for j in range(start, len(ids))))

    references = {}
    for dtype in (torch.float64, torch.float32):
        module = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()
        with torch.no_grad():
            references[dtype] = np.array([continuation(module(torch.tensor([ids])).logits[0], ids, start)
                                          for ids, start in reqs])
        del module
    truth, hf = references[torch.float64], references[torch.float32]

    def scored() -> tuple[np.ndarray, float]:
        scorer = PromptScorer(target)
        started = time.perf_counter()
        values = np.array([np.sum(scorer.score(ids).logprobs[start:]) for ids, start in reqs])
        return values, time.perf_counter() - started

    # The fused forward's products, swapped for float64 ones (a diagnostic: the shipped forward is float32).
    fused, module = target._fused, target.module
    shipped_blocks, shipped_head = list(fused.blocks), fused.head

    def float64_product(layers: list) -> object:
        weight = torch.cat([layer.weight.detach() for layer in layers]).double()
        return lambda rows: (rows.double() @ weight.T).float()

    def products(layer) -> dict:
        attn, mlp = layer.self_attn, layer.mlp
        return {"qkv": [attn.q_proj, attn.k_proj, attn.v_proj], "out": [attn.o_proj],
                "gate_up": [mlp.gate_proj, mlp.up_proj], "down": [mlp.down_proj]}

    from speculum.models.hf.forward import attention as row_attention

    shipped_attention = (row_attention.RowAttention.__call__, row_attention.SlotRows.__call__)

    def in_float64(call):
        def attend(self, q, keys, values, scale):
            plan = copy.copy(self)                                      # the same plan, float64 masks
            plan.groups = [(*group[:-1], group[-1].double()) for group in self.groups]
            return call(plan, q.double(), keys.double(), values.double(), scale).float()
        return attend

    def swap(names: tuple, head: bool, attention: bool = False) -> None:
        fused.blocks = [dataclasses.replace(block, **{n: float64_product(products(layer)[n]) for n in names})
                        for block, layer in zip(shipped_blocks, module.model.layers)]
        fused.head = float64_product([module.lm_head]) if head else shipped_head
        calls = [in_float64(call) for call in shipped_attention] if attention else shipped_attention
        row_attention.RowAttention.__call__, row_attention.SlotRows.__call__ = calls

    print(f"{cpu_name()}; {len(reqs)} requests, continuation log-likelihoods in nats\n")
    print("| forward | max vs float64 | median vs float64 | max vs transformers f32 | median vs transformers f32 |")
    print("|---|---:|---:|---:|---:|")

    def row(name: str, values: np.ndarray) -> None:
        to_truth, to_hf = np.abs(values - truth), np.abs(values - hf)
        print(f"| {name} | {to_truth.max():.2e} | {np.median(to_truth):.2e} | {to_hf.max():.2e} | "
              f"{np.median(to_hf):.2e} |", flush=True)

    row("transformers float32 (lm-eval `hf`)", hf)
    PromptScorer(target).score(reqs[0][0])           # warm-up: the load-time checks of the packed forward
    shipped, seconds32 = scored()
    row("speculum scorer (float32)", shipped)
    for name in args.variants:
        swap(*VARIANTS[name])
        values, seconds64 = scored()
        row(f"speculum scorer, {name} in float64", values)
        print(f"(scorer time {seconds64:.1f} s against {seconds32:.1f} s in float32: {seconds64 / seconds32:.2f}x)",
              flush=True)
    swap((), False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
