"""A model ten times larger, for scale: a Llama with TinyLlama-1.1B's shape and seeded random weights,
as a Q4_K_M GGUF file, decoded by speculum and by llama.cpp, each in a process of its own.

Steps (each skipped where its output exists, under ``$SPECULUM_CACHE/large-model``):

1. ``build``: the Hugging Face folder: TinyLlama-1.1B's blocks (22 x hidden 2048, MLP 5632, 32 query heads
   over 4 key/value heads), SmolLM2's tokenizer and vocabulary (49,152: the converter needs a real
   tokenizer), weights drawn from a seeded normal at 0.02;
2. ``convert``: to an F16 GGUF with llama.cpp's converter (vendored in the llama-cpp-python sdist,
   ``benchmarks/peers.py``), then to Q4_K_M with ``llama_model_quantize`` (llama-cpp-python's own);
3. ``measure``: in a fresh process each, ms a greedy token (``gguf_decoding.py``'s difference of a long and a
   one-token run) and the resident memory after loading and decoding: speculum's float32 target over the
   file's groups with the unpacked weights given back (as ``speculum serve`` does), and llama.cpp on the
   file; then speculum's verification cost curve (products and the whole
   forward at 1, 2, 4, 8, 16 rows against 1 row). Random weights say nothing about acceptance, so the
   curve gives the acceptance at which a block of k drafted tokens breaks even: the verified forward of
   k + 1 rows must emit more tokens than its cost in single steps.

Usage:
    .venv/bin/python benchmarks/large_model.py [--tokens 32] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from machine import cpu_name  # noqa: E402
from speculum.models.paths import cache_dir  # noqa: E402

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False)


def folder() -> Path:
    return cache_dir() / "large-model"


def build(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out / "config.json").exists():
        return
    tokenizer_source = next(cache_dir().glob("smollm2-135m-float32*"))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **SHAPE)
    with torch.device("meta"):              # no initialisation pass over 1.1B weights: they are drawn below
        module = LlamaForCausalLM(config)
    module = module.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "norm" in name:
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, 0.02, generator=generator)
    module.save_pretrained(out)
    tokenizer.save_pretrained(out)


def convert(hf: Path, f16: Path, q4: Path) -> None:
    import llama_cpp
    from peers import vendored_tree

    if not f16.exists() and not q4.exists():
        tree = vendored_tree(cache_dir() / "peers")
        stub = folder() / "stubs"
        stub.mkdir(exist_ok=True)
        (stub / "sentencepiece.py").write_text("class SentencePieceProcessor:\n    pass\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "gguf-py"), str(stub)]), NO_LOCAL_GGUF="")
        subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f16",
                        "--outfile", str(f16)], env=env, check=True)
    if not q4.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.nthread = os.cpu_count() or 2
        if llama_cpp.llama_model_quantize(str(f16).encode(), str(q4).encode(), params) != 0:
            raise SystemExit("llama_model_quantize failed")
    f16.unlink(missing_ok=True)


def peak_resident_mb() -> float:
    """The process's peak resident memory, MB (what it needed to load and decode)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def resident_mb() -> float:
    """The process's resident memory now, MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure_one(kind: str, gguf: str, tokens: int, dtype: str = "float32") -> dict:
    """In this process: ms a token (median of 3) and peak resident memory, for ``kind``."""
    import numpy as np
    import torch

    from gguf_decoding import PROMPT, llama_tokens, speculum_tokens
    from speculum.models import load_model

    if kind == "speculum":
        model = load_model(gguf, dtype=dtype, progress=False)
        model.release_unfused_weights()          # what `speculum serve` does: one copy of the weights
        prompt, run, handle = model.encode(PROMPT, chat=False), speculum_tokens, model
    else:
        import llama_cpp
        from transformers import AutoTokenizer

        threads = torch.get_num_threads()
        handle = llama_cpp.Llama(model_path=gguf, n_ctx=512, n_threads=threads, n_threads_batch=threads,
                                 flash_attn=True, logits_all=True, verbose=False)
        prompt = AutoTokenizer.from_pretrained(folder() / "hf").encode(PROMPT)
        run = llama_tokens
    run(handle, prompt, 4)
    costs = []
    for _ in range(3):
        started = time.perf_counter()
        run(handle, prompt, 1)
        one = time.perf_counter() - started
        started = time.perf_counter()
        run(handle, prompt, tokens)
        costs.append((time.perf_counter() - started - one) / (tokens - 1))
    report = {"ms_per_token": 1000 * statistics.median(costs), "resident_mb": resident_mb(),
              "peak_resident_mb": peak_resident_mb()}
    if kind == "speculum":
        report["fused_forward"], report["grouped_layers"] = model.fused_forward, model.grouped_layers
        report["cost_curve"] = cost_curve(model, np)
    return report


def cost_curve(model, np) -> dict:
    """Seconds of the products, and of the whole forward, at k rows over 1 row, k in 1, 2, 4, 8, 16."""
    import torch

    forward = model.fused
    cache = model.new_cache()
    forward(torch.tensor([list(range(3, 67))]), cache)

    def best(run) -> float:
        run()
        times = []
        for _ in range(5):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    products, whole = {}, {}
    for rows in (1, 2, 4, 8, 16):
        products[rows] = sum(best(lambda p=p, x=torch.randn(rows, w): p(x)) for p, w in forward.products())

        def step(rows=rows) -> None:
            forward(torch.tensor([list(range(5, 5 + rows))]), cache)
            cache.trim(rows)

        whole[rows] = best(step)
    return {"products": {k: v / products[1] for k, v in products.items()},
            "forward": {k: v / whole[1] for k, v in whole.items()},
            # A block of k drafted tokens (k + 1 rows) emits on average (1 - a^(k+1)) / (1 - a) tokens at
            # acceptance a; it breaks even with plain steps where that equals its cost in steps.
            "break_even_acceptance": {k: break_even(whole[k + 1] / whole[1] if k + 1 in whole else None, k)
                                      for k in (1, 3, 7, 15)}}


def break_even(cost: float | None, drafted: int) -> float | None:
    """The acceptance a at which (1 - a^(k+1)) / (1 - a) = cost (in single steps; the draft free)."""
    if cost is None:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):
        a = (low + high) / 2
        emitted = sum(a ** i for i in range(drafted + 1))
        low, high = (a, high) if emitted < cost else (low, a)
    return round((low + high) / 2, 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens a timed run decodes")
    parser.add_argument("--dtype", default="float32", help="speculum's target (float32, or q8: 8-bit activations)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--one", choices=["speculum", "llama.cpp"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    q4 = folder() / "tinyllama-shape-random-q4_k_m.gguf"
    if args.one:
        print(json.dumps(measure_one(args.one, str(q4), args.tokens, args.dtype)))
        return 0
    folder().mkdir(parents=True, exist_ok=True)
    build(folder() / "hf")
    convert(folder() / "hf", folder() / "tinyllama-shape-random-f16.gguf", q4)
    report = {"cpu": cpu_name(), "file": str(q4), "file_mb": q4.stat().st_size / 2 ** 20, "dtype": args.dtype}
    for kind in ("speculum", "llama.cpp", "speculum", "llama.cpp"):     # twice, alternating: the median
        out = subprocess.run([sys.executable, __file__, "--one", kind, "--tokens", str(args.tokens), "--dtype",
                              args.dtype],
                             check=True, capture_output=True, text=True).stdout
        report.setdefault(kind, []).append(json.loads(out.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{q4.name} ({report['file_mb']:.0f} MB) on {report['cpu']}, speculum's target {args.dtype}")
    for kind in ("speculum", "llama.cpp"):
        runs = report[kind]
        print(f"  {kind:<10} {min(r['ms_per_token'] for r in runs):7.1f} ms/token (best of {len(runs)} processes)"
              f"   resident {max(r['resident_mb'] for r in runs):6.0f} MB (peak "
              f"{max(r['peak_resident_mb'] for r in runs):.0f} MB)")
    curve = report["speculum"][-1]["cost_curve"]
    print("  speculum's cost of k rows / 1 row: products " +
          ", ".join(f"{k}: {v:.2f}" for k, v in curve["products"].items()) + "; whole forward " +
          ", ".join(f"{k}: {v:.2f}" for k, v in curve["forward"].items()))
    print("  acceptance at which k drafted tokens break even: " +
          ", ".join(f"k={k}: {v}" for k, v in curve["break_even_acceptance"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
