"""Speculative decoding on the llama.cpp backend versus llama-cpp-python itself.

One run, side by side, on SmolLM2-135M-Instruct Q4_1 (or any GGUF given with --gguf), greedy:

* ``llama.cpp plain``: llama-cpp-python's ``create_completion`` (temperature 0, no repeat penalty) with
  the settings speculum's backend uses (flash attention on);
* ``llama.cpp default``: the same with llama-cpp-python's default settings (flash attention off);
* ``speculum plain``: ``speculum.generate`` with no draft on :class:`LlamaCppModel`;
* ``speculum lookup``: ``speculum.generate`` with ``PromptLookup`` and ``gamma="auto"``;
* ``llama.cpp lookup``: ``create_completion`` on a ``Llama`` with
  ``draft_model=LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=10)``.

Every method sees the prompt already in its KV cache (a warm-up run precedes the timed rounds and every
implementation reuses the cached prefix), so the figures are decoding throughput. Rounds interleave the
methods so that load from other processes spreads over all of them; the median round is reported.
The verify-cost curve (seconds to append n tokens with all their logits, relative to one decode step)
is measured first: it is what ``gamma="auto"`` has to work with on this backend.

Usage:
    .venv/bin/python benchmarks/decoding_llamacpp.py [--max-new-tokens 128] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import speculum
from speculum.models import PromptLookup
from speculum.models.llamacpp import load_llamacpp_model

PASSAGE = (
    "The city council met on Tuesday to discuss the new public library. The library will be built on the "
    "site of the old train station, which has been empty for ten years. Council members said the library "
    "will have a children's reading room, a computer lab, and a large hall for community events. The "
    "building will use solar panels on the roof and will collect rain water for its gardens. Work on the "
    "library will start in the spring and should be finished in two years. The council expects the "
    "library to cost twelve million dollars, paid for by the city and by a grant from the state."
)
ROUGH_DRAFT = (
    "me and my team was working on the project for three weeks and we finded that the old system are "
    "very slow, so we decided to rewrite the data loader, the cache and the report generator. the new "
    "data loader is two times faster and the cache use less memory. we still has to test the report "
    "generator before we can ship it to the customers next month."
)
TASKS: dict[str, list[str]] = {
    "summarise": [
        f"{PASSAGE}\n\nSummarise the text above in a few sentences.",
        f"Summarise this paragraph, keeping its key facts:\n\n{ROUGH_DRAFT}",
    ],
    "rewrite": [
        f"Rewrite the following text with correct grammar, keeping its meaning:\n\n{ROUGH_DRAFT}",
        f"Rewrite this text in a formal tone:\n\n{PASSAGE}",
    ],
    "chat": [
        "What are some good tips for someone who wants to learn to cook at home?",
        "Write a short story about a robot who learns to paint.",
    ],
}
METHODS = ("llama.cpp default", "llama.cpp plain", "speculum plain", "speculum lookup", "llama.cpp lookup")


def verify_cost_curve(model, context_ids: list[int], sizes=(1, 2, 4, 8, 16), repeats: int = 5) -> dict[int, float]:
    """Median seconds to append ``n`` tokens (all their logits) after ``context_ids``, per n."""
    session = model.start(context_ids)
    costs = {}
    for n in sizes:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            session.extend(context_ids[:n])
            times.append(time.perf_counter() - started)
            session.rollback(n)
        costs[n] = statistics.median(times)
    return costs


def run_llama(llama, prompt_ids: list[int], max_new_tokens: int) -> tuple[str, int, float]:
    started = time.perf_counter()
    out = llama.create_completion(prompt_ids, max_tokens=max_new_tokens, temperature=0.0, repeat_penalty=1.0)
    seconds = time.perf_counter() - started
    return out["choices"][0]["text"], int(out["usage"]["completion_tokens"]), seconds


def run_speculum(model, prompt_ids: list[int], max_new_tokens: int, draft) -> tuple[str, int, float, object]:
    started = time.perf_counter()
    result = speculum.generate(
        model, prompt_ids, draft=draft, max_new_tokens=max_new_tokens, gamma="auto", temperature=0,
        eos_token_id=model.eos_token_id,
    )
    seconds = time.perf_counter() - started
    tokens = list(result.tokens)
    if tokens and tokens[-1] == model.eos_token_id:
        tokens = tokens[:-1]  # create_completion does not count or print the end-of-generation token
    return model.tokenizer.decode(tokens, skip_special_tokens=True), len(tokens), seconds, result.stats


def benchmark(gguf: str, max_new_tokens: int, rounds: int, n_ctx: int, n_threads: int | None) -> dict:
    """Run every method on every prompt; returns the measurements as data (printed by ``main``)."""
    import llama_cpp

    model = load_llamacpp_model(gguf, n_ctx=n_ctx, n_threads=n_threads)
    common = dict(model_path=model.model_path, n_ctx=n_ctx, n_threads=model.n_threads,
                  n_threads_batch=model.n_threads, verbose=False)
    llama_default = llama_cpp.Llama(**common)
    common["flash_attn"] = True  # what LlamaCppModel uses (batch-independent logits)
    llama_plain = llama_cpp.Llama(**common)
    llama_lookup = llama_cpp.Llama(
        **common, draft_model=llama_cpp.llama_speculative.LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=10)
    )
    chat_ids = model.tokenizer.apply_chat_template([{"role": "user", "content": TASKS["summarise"][0]}])
    curve = verify_cost_curve(model, chat_ids[:128])
    report = {"verify_cost": curve, "prompts": []}
    for task, prompts in TASKS.items():
        for prompt in prompts:
            ids = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            runners = {
                "llama.cpp default": lambda: run_llama(llama_default, ids, max_new_tokens),
                "llama.cpp plain": lambda: run_llama(llama_plain, ids, max_new_tokens),
                "speculum plain": lambda: run_speculum(model, ids, max_new_tokens, None),
                "speculum lookup": lambda: run_speculum(model, ids, max_new_tokens, PromptLookup()),
                "llama.cpp lookup": lambda: run_llama(llama_lookup, ids, max_new_tokens),
            }
            texts, counts, stats, times = {}, {}, {}, {m: [] for m in METHODS}
            for round_index in range(rounds + 1):  # round 0 warms the prompt caches and is not timed
                for method in METHODS:
                    text, count, seconds, *extra = runners[method]()
                    texts[method], counts[method] = text, count
                    if extra:
                        stats[method] = extra[0]
                    if round_index:
                        times[method].append(seconds)
            report["prompts"].append({
                "task": task,
                "prompt_tokens": len(ids),
                "tokens": counts,
                "seconds": {m: statistics.median(t) for m, t in times.items()},
                "same_as_plain": {m: texts[m] == texts["speculum plain"] for m in METHODS},
                "tokens_per_target_forward": stats["speculum lookup"].tokens_per_target_forward,
                "acceptance_rate": stats["speculum lookup"].acceptance_rate,
            })
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default="smollm2-135m", help="GGUF file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per prompt (median reported)")
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: os.cpu_count())")
    args = parser.parse_args()
    report = benchmark(args.gguf, args.max_new_tokens, args.rounds, args.n_ctx, args.threads)

    step = report["verify_cost"][1]
    print("verify cost on a 128-token context (append n tokens, all logits):")
    for n, seconds in report["verify_cost"].items():
        print(f"  n={n:2d}: {1000 * seconds:6.1f} ms  = {seconds / step:4.2f} decode steps")
    print()
    header = (f"{'task':10s} {'prompt':>6s} | " + " | ".join(f"{m:>17s}" for m in METHODS)
              + " | ours/llama plain | lookup/plain | ours/llama lookup | tok/fwd | same text as plain")
    print(header)
    print("-" * len(header))
    rates = {m: [] for m in METHODS}
    for row in report["prompts"]:
        rate = {m: row["tokens"][m] / row["seconds"][m] for m in METHODS}
        for m in METHODS:
            rates[m].append(rate[m])
        same = ", ".join(f"{m}: {'yes' if row['same_as_plain'][m] else 'NO'}" for m in METHODS if m != "speculum plain")
        print(
            f"{row['task']:10s} {row['prompt_tokens']:6d} | "
            + " | ".join(f"{rate[m]:12.1f} tok/s" for m in METHODS)
            + f" | {rate['speculum plain'] / rate['llama.cpp plain']:16.2f}x"
            + f" | {rate['speculum lookup'] / rate['speculum plain']:11.2f}x"
            + f" | {rate['speculum lookup'] / rate['llama.cpp lookup']:16.2f}x"
            + f" | {row['tokens_per_target_forward']:7.2f} | {same}"
        )
    geo = {m: float(np.exp(np.mean(np.log(rates[m])))) for m in METHODS}
    print(
        f"geometric means: ours/llama plain {geo['speculum plain'] / geo['llama.cpp plain']:.2f}x, "
        f"lookup/plain {geo['speculum lookup'] / geo['speculum plain']:.2f}x, "
        f"ours/llama lookup {geo['speculum lookup'] / geo['llama.cpp lookup']:.2f}x"
    )


if __name__ == "__main__":
    main()
