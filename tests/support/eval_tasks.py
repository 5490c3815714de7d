"""Offline lm-evaluation-harness tasks that the repository makes itself: arithmetic questions written to a
JSONL file with task YAMLs beside it (run with ``--include_path``).

Not a test module: imported by test_eval.py and benchmarks/eval.py.

* ``arith_mc``: multiple choice, "What is a + b?" with four numeric answers (``shots`` examples first,
  always the same ones: ``fewshot_config: sampler: first_n``, so every item shares its few-shot context);
* ``arith_ll``: ``loglikelihood`` of the right answer after the question;
* ``next_mc``: multiple choice with a short context, "What comes after Tuesday?" over days, months,
  letters and number words, four answers from the same sequence (``shots`` first-n examples);
* ``paragraphs_ppl``: ``loglikelihood_rolling`` (perplexity) of given paragraphs of text.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["write_arithmetic_tasks", "write_letter_tasks", "write_next_tasks", "write_rolling_task"]

_SEQUENCES = {
    "the days of the week": "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split(),
    "the months": ("January February March April May June July August September October November "
                   "December").split(),
    "the alphabet": list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"),
    "counting": ("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                 "sixteen seventeen eighteen nineteen twenty").split(),
}


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


def _fewshot(folder: Path, name: str, examples: list[dict], shots: int) -> tuple[str, str]:
    """Write ``examples`` as ``<name>_fewshot`` (the train split); returns the YAML of the data files (the
    test split left as ``DATA``) and of the few-shot settings (empty for zero shots)."""
    _write(folder, f"{name}_fewshot", examples, "")
    fewshot = str((folder / f"{name}_fewshot.jsonl").resolve())
    shots_block = (f"num_fewshot: {shots}\nfewshot_split: train\nfewshot_config:\n  sampler: first_n\n"
                   if shots else "")
    return f"dataset_kwargs:\n  data_files:\n    test: DATA\n    train: {fewshot}\n", shots_block


def write_arithmetic_tasks(folder: Path, *, items: int = 20, shots: int = 0, seed: int = 0) -> Path:
    """``arith_mc`` and ``arith_ll`` in ``folder`` (created), ``items`` questions each plus ``shots`` few-shot
    examples (drawn from their own split)."""
    folder.mkdir(parents=True, exist_ok=True)
    pool = _arithmetic(items + shots, seed)
    files, shots_block = _fewshot(folder, "arith", pool[items:], shots)
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


def _next_items(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        kind = rng.choice(sorted(_SEQUENCES))
        sequence = _SEQUENCES[kind]
        at = rng.randrange(len(sequence) - 1)
        right = sequence[at + 1]
        choices = [right, *rng.sample([w for w in sequence if w != right], 3)]
        rng.shuffle(choices)
        items.append({"question": f"In {kind}, what comes after {sequence[at]}?", "choices": choices,
                      "gold": choices.index(right)})
    return items


def write_next_tasks(folder: Path, *, items: int = 56, shots: int = 3, seed: int = 0) -> Path:
    """``next_mc`` in ``folder`` (created): ``items`` short questions with four answers each, after the
    same ``shots`` examples (drawn from their own split)."""
    folder.mkdir(parents=True, exist_ok=True)
    pool = _next_items(items + shots, seed)
    files, shots_block = _fewshot(folder, "next", pool[items:], shots)
    _write(folder, "next_mc", pool[:items],
           "task: next_mc\ndataset_path: json\n" + files + "test_split: test\noutput_type: multiple_choice\n"
           'doc_to_text: "Q: {{question}}\\nA:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{gold}}"\n'
           + shots_block + "metric_list:\n  - metric: acc\n")
    return folder


def write_rolling_task(folder: Path, paragraphs: list[str]) -> Path:
    """``paragraphs_ppl`` in ``folder`` (created): the rolling log-likelihood of each of ``paragraphs``."""
    folder.mkdir(parents=True, exist_ok=True)
    _write(folder, "paragraphs_ppl", [{"text": text} for text in paragraphs],
           "task: paragraphs_ppl\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: DATA\n"
           "test_split: test\noutput_type: loglikelihood_rolling\n"
           'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
           "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    return folder
