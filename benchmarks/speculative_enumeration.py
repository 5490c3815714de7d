"""Speculative enumeration on SmolLM2-135M: exact target index vs RescoredIndex over a draft index.

For each prompt, the top-K length-L continuations: (a) the exact index built on the target, (b) a
RescoredIndex over an exact index built on each draft of ``--drafts``: ``llamacpp`` (the same Q4_1 GGUF
the float32 target is dequantised from, on llama.cpp with ``--llamacpp-threads``), ``bf16`` (the bf16
twin), ``ngram`` (fitted to target samples), ``int8`` (the int8 twin). Reported side by side: target calls (batched invocations), target positions (rows of
next-token distributions the target computed: prefixes forwarded, or distinct prefixes teacher-forced),
wall time, recall of the true top-K, certified verdict. Then `speculum rank`'s estimator on a length-8
continuation: time to an exposure estimate and its bracket.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/speculative_enumeration.py [--top-k 100] [--length 3]

The certificate is conditional on ``--assumed-gap`` (a bound on |target - draft| log-prob per sequence);
each row prints the gap observed on what was rescored, so a violated assumption is visible.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Passive OpenMP waiting, the setting of this script's figures in RESULTS.md (docs/backends.md: OpenMP waiting).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from counting import CountingModel  # noqa: E402  (benchmarks/counting.py)

PROMPTS = ["The capital of France is", "My favourite food is", "Once upon a time"]


def run_rescored(name, draft_model, counting, prompt, truth, args, build_seconds=0.0):
    from speculum.enumeration import AutoregressiveEnumerable, RescoredIndex

    started = time.perf_counter()
    draft_index = AutoregressiveEnumerable(draft_model, max_len=args.length, prompt=prompt)
    index = RescoredIndex(draft_index, counting, rerank_window=args.window, assumed_gap=args.assumed_gap,
                          certify=True, max_window=args.max_window)
    result = index.top_k(args.top_k)
    seconds = time.perf_counter() - started + build_seconds
    got = {seq for seq, _ in result["items"]}
    recall = len(got & {seq for seq, _ in truth}) / len(truth)
    return {"method": name, "target_calls": counting.calls, "target_positions": counting.positions,
            "seconds": seconds, "recall": recall, "certified": result["certified"], "window": result["window"],
            "gap": result["gap"], "draft_forwards": draft_index.seek_index().forwards}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top-k", type=int, default=100)
    parser.add_argument("--length", type=int, default=3)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--max-window", type=int, default=512)
    parser.add_argument("--assumed-gap", type=float, default=0.75, help="the certificate's assumption (nats)")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--drafts", nargs="+", default=["llamacpp", "bf16", "ngram"],
                        choices=["llamacpp", "bf16", "ngram", "int8"])
    parser.add_argument("--llamacpp-threads", type=int, default=None,
                        help="llama.cpp threads (default: all cores; 1 is faster on a machine shared by others)")
    args = parser.parse_args()

    import speculum
    from speculum.enumeration import AutoregressiveEnumerable
    from speculum.drafts import make_enumeration_draft
    from speculum.enumeration.estimation.exposure import estimate_rank
    from speculum.drafts import make_draft

    target = speculum.load_model(progress=False)
    twins = {}
    if "llamacpp" in args.drafts:
        from speculum.models.llamacpp import load_llamacpp_model

        twins["llamacpp"] = load_llamacpp_model("smollm2-135m", n_threads=args.llamacpp_threads, draft_for=target)
    for name in ("bf16", "int8"):
        if name in args.drafts:
            twins[name] = make_draft(name, target)
    counting = CountingModel(target)
    rows = []
    for text in PROMPTS[: args.prompts]:
        prompt = target.encode(text, chat=False)
        counting.reset()
        started = time.perf_counter()
        truth = AutoregressiveEnumerable(counting, max_len=args.length, prompt=prompt).top_k(args.top_k)
        exact = {"method": "exact index on target", "target_calls": counting.calls,
                 "target_positions": counting.positions, "seconds": time.perf_counter() - started,
                 "recall": 1.0, "certified": True, "window": 0, "gap": 0.0}
        results = [exact]
        for name in args.drafts:
            counting.reset()
            if name == "ngram":
                started = time.perf_counter()
                ngram = make_enumeration_draft("ngram", counting, prompt=prompt, length=args.length, seed=0)
                results.append(run_rescored("rescored over n-gram draft", ngram, counting, prompt, truth, args,
                                            time.perf_counter() - started))
            else:
                results.append(run_rescored(f"rescored over {name} draft", twins[name], counting, prompt, truth, args))
        for r in results:
            r["prompt"] = text
            rows.append(r)
            print(f"{text!r:28} {r['method']:28} calls {r['target_calls']:4d}  positions {r['target_positions']:6d}  "
                  f"{r['seconds']:7.2f} s  recall {r['recall']:.2f}  certified {r['certified']}  "
                  f"window {r['window']}  gap {r['gap']:.3f}  draft forwards {r.get('draft_forwards', 0)}", flush=True)
        base = results[0]
        for r in results[1:]:
            print(f"    {r['method']}: {base['target_positions'] / max(r['target_positions'], 1):.1f}x fewer target "
                  f"positions, {base['target_calls'] / max(r['target_calls'], 1):.1f}x fewer target calls, "
                  f"{base['seconds'] / r['seconds']:.1f}x less wall time", flush=True)

    prompt = target.encode(PROMPTS[0], chat=False)
    continuation = target.tokenizer(" Paris, the city of light and love.", add_special_tokens=False)["input_ids"][:8]
    started = time.perf_counter()
    report = estimate_rank(target, continuation, prompt=prompt)
    low, high = report.exposure_bracket
    print(f"speculum rank, length-{len(continuation)} continuation: rank {report.rank:.3g} in "
          f"[{report.rank_lo:.3g}, {report.rank_hi:.3g}] ({report.method}), exposure {report.exposure_bits:.1f} bits "
          f"in [{low:.1f}, {high:.1f}], {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
