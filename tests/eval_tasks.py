"""Offline lm-evaluation-harness tasks that the repository makes itself: arithmetic questions written to a
JSONL file with task YAMLs beside it (run with ``--include_path``).

Not a test module: imported by test_eval.py and benchmarks/eval.py.

* ``arith_mc``: multiple choice, "What is a + b?" with four numeric answers (``shots`` examples first,
  always the same ones: ``fewshot_config: sampler: first_n``, so every item shares its few-shot context);
* ``arith_ll``: ``loglikelihood`` of the right answer after the question.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["write_arithmetic_tasks", "write_letter_tasks"]


def _arithmetic(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        right = a + b
        wrong = rng.sample([right + d for d in (-11, -10, -2, -1, 1, 2, 10, 11) if right + d > 0], 3)
        choices = [str(c) for c in [right, *wrong]]
        rng.shuffle(choices)
        items.append({"question": f"What is {a} + {b}?", "choices": choices, "gold": choices.index(str(right)),
                      "answer": str(right)})
    return items


def _write(folder: Path, name: str, items: list[dict], yaml: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
    (folder / f"{name}.yaml").write_text(yaml.replace("DATA", str(data.resolve())), encoding="utf-8")


def write_arithmetic_tasks(folder: Path, *, items: int = 20, shots: int = 0, seed: int = 0) -> Path:
    """``arith_mc`` and ``arith_ll`` in ``folder`` (created), ``items`` questions each plus ``shots`` few-shot
    examples (drawn from their own split)."""
    folder.mkdir(parents=True, exist_ok=True)
    pool = _arithmetic(items + shots, seed)
    _write(folder, "arith_fewshot", pool[items:], "")
    fewshot = str((folder / "arith_fewshot.jsonl").resolve())
    shots_block = (f"num_fewshot: {shots}\nfewshot_split: train\nfewshot_config:\n  sampler: first_n\n"
                   if shots else "")
    files = f"dataset_kwargs:\n  data_files:\n    test: DATA\n    train: {fewshot}\n"
    _write(folder, "arith_mc", pool[:items],
           "task: arith_mc\ndataset_path: json\n" + files + "test_split: test\noutput_type: multiple_choice\n"
           'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\n'
           'doc_to_target: "{{gold}}"\n' + shots_block + "metric_list:\n  - metric: acc\n")
    _write(folder, "arith_ll", pool[:items],
           "task: arith_ll\ndataset_path: json\n" + files + "test_split: test\noutput_type: loglikelihood\n"
           'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: " {{answer}}"\n'
           "metric_list:\n  - metric: perplexity\n  - metric: acc\n")
    return folder


def write_letter_tasks(folder: Path, alphabet: str, *, items: int = 12, seed: int = 0) -> Path:
    """The same two kinds of task over a toy model's alphabet (no spaces, no delimiters): ``toy_mc`` and
    ``toy_ll``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    pool = []
    for _ in range(items):
        context = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
        choices = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(3)]
        pool.append({"context": context, "choices": choices, "gold": rng.randrange(3), "answer": choices[0]})
    plain = 'target_delimiter: ""\nfewshot_delimiter: ""\n'
    files = "dataset_kwargs:\n  data_files:\n    test: DATA\n"
    _write(folder, "toy_mc", pool,
           "task: toy_mc\ndataset_path: json\n" + files + "test_split: test\noutput_type: multiple_choice\n"
           'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{gold}}"\n' + plain
           + "metric_list:\n  - metric: acc\n")
    _write(folder, "toy_ll", pool,
           "task: toy_ll\ndataset_path: json\n" + files + "test_split: test\noutput_type: loglikelihood\n"
           'doc_to_text: "{{context}}"\ndoc_to_target: "{{answer}}"\n' + plain
           + "metric_list:\n  - metric: perplexity\n  - metric: acc\n")
    return folder
