"""How far the 8-bit targets are from float32: speculum's ``q8`` beside llama.cpp's Q8_0, on one fixed text set.

The reference is speculum's float32 target (the embedded SmolLM2 file's weights, expanded exactly). Each
text is teacher-forced through every model; at every position the next-token law is compared with the
reference's: mean KL(float32 || other) in nats a token, and how often the other's likeliest token is the
reference's (greedy-token agreement).

* ``speculum q8``: ``load_model(dtype="q8")``, 8-bit activations in blocks of 32 times the file's groups;
* ``llama.cpp Q8_0``: the float32 weights written as F32 GGUF by llama.cpp's converter and quantised to Q8_0
  with ``llama_model_quantize`` (8-bit weights; llama.cpp's products quantise activations to 8 bits too),
  evaluated by llama-cpp-python with every position's logits;
* ``llama.cpp Q4_1``: the embedded file itself on llama.cpp, for scale.

Two fixed text sets: 12 short texts written here, and the docstrings of 19 standard-library modules (the first
1,200 characters of each), whose thousands of positions make a 1 % difference in agreement tell.

Usage:
    .venv/bin/python benchmarks/q8_quality.py [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from machine import cpu_name  # noqa: E402
from speculum.models import load_model  # noqa: E402
from speculum.models.paths import cache_dir, embedded_gguf_path  # noqa: E402

TEXTS = [
    "The city council met on Tuesday to discuss the new public library. The library will be built on the site "
    "of the old train station, which has been empty for ten years.",
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n    return total / "
    "len(values)\n",
    "Meeting notes: the team agreed to ship the new data loader next month, after the report generator passes "
    "its tests. Maria will write the release notes.",
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon dioxide and "
    "water, giving off oxygen as a by-product.",
    "Q: What is the capital of France?\nA: The capital of France is Paris, a city known for its art, food and "
    "history.",
    "Train 42 leaves the central station at 08:15 and arrives in the harbour district at 08:47, stopping at "
    "the museum, the university and the old market.",
    "Dear customer, thank you for your order. Your package was shipped this morning and should arrive within "
    "three to five working days. You can follow its progress with the tracking number in this email.",
    "To make a simple tomato sauce, warm two spoons of olive oil in a pan, add a chopped onion and a clove of "
    "garlic, cook them until soft, then add the tomatoes, a pinch of salt and a few leaves of basil.",
    "SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON orders.customer_id = customers.id GROUP BY "
    "name ORDER BY orders DESC LIMIT 10;",
    "The Roman Empire was one of the largest empires of the ancient world. At its height it stretched from "
    "Britain in the north to Egypt in the south, and its roads, laws and language shaped Europe for centuries.",
    "User: Can you help me plan a weekend trip to the mountains?\nAssistant: Of course! First, decide how far "
    "you want to drive, then pick a town with a few good walks and a place to stay near the trails.",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes the air pressure is lower, so water "
    "boils at a lower temperature and food takes longer to cook.",
]


# A second, larger fixed set: the docstrings of standard-library modules (fixed for a Python version), each
# cut to its first 1,200 characters; more positions make a 1 % difference in greedy agreement tell.
DOCSTRING_MODULES = ("argparse", "bisect", "calendar", "collections", "csv", "difflib", "fractions", "functools",
                     "heapq", "json", "logging", "random", "shlex", "statistics", "string",
                     "textwrap", "threading", "unittest", "zipfile")


def docstrings() -> list[str]:
    import importlib

    texts = []
    for name in DOCSTRING_MODULES:
        doc = importlib.import_module(name).__doc__ or ""
        texts.append(" ".join(doc.split())[:1200])
    return [text for text in texts if text]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def speculum_rows(model, ids: list[int]) -> np.ndarray:
    """Log-probs of positions 1 .. n-1 of ``ids`` (the law after each prefix), teacher-forced."""
    session = model.start(ids[:1])
    return np.vstack([session.next_logprobs()[None], session.extend(ids[1:])[:-1]])


def llama_rows(llama, ids: list[int]) -> np.ndarray:
    llama.reset()
    llama.eval(ids)
    return log_softmax(np.asarray(llama.scores[: len(ids) - 1]))


def q8_0_file() -> Path:
    """SmolLM2 as a Q8_0 GGUF made by llama.cpp's own tools from the float32 checkpoint (cached)."""
    import llama_cpp
    from peers import vendored_tree

    out = cache_dir() / "q8-quality"
    q8 = out / "smollm2-135m-q8_0.gguf"
    if q8.exists():
        return q8
    out.mkdir(parents=True, exist_ok=True)
    f32 = out / "smollm2-135m-f32.gguf"
    tree = vendored_tree(cache_dir() / "peers")
    (out / "sentencepiece.py").write_text("class SentencePieceProcessor:\n    pass\n")
    checkpoint = next(cache_dir().glob("smollm2-135m-float32*"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "gguf-py"), str(out)]), NO_LOCAL_GGUF="")
    subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", "f32",
                    "--outfile", str(f32)], env=env, check=True, capture_output=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    if llama_cpp.llama_model_quantize(str(f32).encode(), str(q8).encode(), params) != 0:
        raise SystemExit("llama_model_quantize failed")
    f32.unlink()
    return q8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()

    import llama_cpp

    reference = load_model(progress=False)
    others = {"speculum q8": ("speculum", load_model(dtype="q8", progress=False))}
    for name, path in (("llama.cpp Q8_0", q8_0_file()), ("llama.cpp Q4_1 (the file)", embedded_gguf_path())):
        others[name] = ("llama", llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=True, verbose=False))
    report = {"cpu": cpu_name(), "sets": {}}
    for set_name, texts in (("short texts", TEXTS), ("standard-library docstrings", docstrings())):
        totals = {name: [0.0, 0, 0] for name in others}            # KL sum, agreeing positions, positions
        for text in texts:
            ids = reference.encode(text, chat=False)[:500]         # llama.cpp's context here: 512
            exact = speculum_rows(reference, ids)
            for name, (kind, model) in others.items():
                rows = speculum_rows(model, ids) if kind == "speculum" else llama_rows(model, ids)
                kl = (np.exp(exact) * (exact - rows)).sum(axis=-1)
                totals[name][0] += float(kl.sum())
                totals[name][1] += int((rows.argmax(axis=-1) == exact.argmax(axis=-1)).sum())
                totals[name][2] += len(kl)
        report["sets"][set_name] = {
            "texts": len(texts), "positions": next(iter(totals.values()))[2],
            "against_float32": {name: {"mean_kl_nats": kl / n, "greedy_agreement": agree / n, "agreeing": agree}
                                for name, (kl, agree, n) in totals.items()}}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for set_name, result in report["sets"].items():
        print(f"{set_name}: against speculum float32, {result['positions']} positions of {result['texts']} texts "
              f"({report['cpu']}):")
        for name, row in result["against_float32"].items():
            print(f"  {name:<26} mean KL {row['mean_kl_nats']:.2e} nats   greedy agreement "
                  f"{row['greedy_agreement']:.1%} ({row['agreeing']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
