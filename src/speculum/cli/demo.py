"""``speculum demo``: speculative decoding on the embedded SmolLM2-135M-Instruct, end to end.

For an open-ended chat prompt and a summarising prompt it streams a greedy speculative generation with
prompt lookup (``gamma="auto"``), prints the statistics table, then decodes the same prompt plainly and
reports whether the tokens are identical (they must be: greedy speculative decoding is exact) and the
measured speed-up. This is what ``make demo`` runs.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import speculum
from speculum.cli.checks import check_draft, check_sampling
from speculum.cli.generate import TextStream, add_cache_argument, format_stats, parse_gamma
from speculum.cli.progress import loading_progress
from speculum.drafts import make_draft

__all__ = ["register", "run", "DEMO_PROMPTS"]

PASSAGE = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 individual "
    "reefs and 900 islands stretching over 2,300 kilometres. The reef is located in the Coral Sea, off "
    "the coast of Queensland, Australia. It can be seen from outer space and is the world's biggest "
    "single structure made by living organisms. The reef is built by billions of tiny organisms known as "
    "coral polyps. It supports a wide diversity of life and was selected as a World Heritage Site in "
    "1981. Climate change, pollution and crown-of-thorns starfish outbreaks threaten the health of the "
    "reef, and mass coral bleaching events have become more frequent."
)
# (title, prompt): an open chat turn (little to copy: lookup should back off) and a summary (much to copy).
DEMO_PROMPTS = (
    ("open-ended chat", "What are three tips for staying focused while studying?"),
    ("summarising a passage", f"Summarise the following passage in a few sentences.\n\n{PASSAGE}"),
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="speculative vs plain greedy decoding on the embedded SmolLM2-135M (what `make demo` runs)",
        description=(
            "Stream a greedy speculative generation on the embedded SmolLM2-135M-Instruct for a chat prompt "
            "and a summarising prompt, print the statistics, and check that plain greedy decoding gives the "
            "same tokens (and how much slower it is). The first run converts the embedded model (~30 s)."
        ),
    )
    parser.add_argument("--draft", default="lookup", metavar="DRAFT",
                        help="none | lookup | ngram | int8 | bf16 | layers:K | PATH (default: lookup)")
    parser.add_argument("--gamma", default="auto", metavar="N|auto", type=parse_gamma,
                        help="draft tokens per forward (default: auto)")
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="tokens per prompt (default: 128)")
    parser.add_argument("--no-compare", dest="compare", action="store_false",
                        help="skip the plain-decoding comparison (halves the run time)")
    add_cache_argument(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    check_sampling(args)  # before the banner: a bad flag fails at once
    check_draft(args.draft)
    print("loading the embedded SmolLM2-135M-Instruct (float32, PyTorch)...", file=sys.stderr)
    target = speculum.load_model(progress=loading_progress(), verify=args.verify_cache)
    all_identical = True
    for title, prompt in DEMO_PROMPTS:
        prompt_ids = target.encode(prompt)
        print(f"\n=== {title} ===\n>>> {prompt}\n", flush=True)
        draft = make_draft(args.draft, target)  # fresh per prompt: proposers keep per-context state
        text, stats, stop_reason = TextStream(target), None, None
        for chunk in speculum.stream(target, prompt_ids, draft=draft, max_new_tokens=args.max_new_tokens,
                                     gamma=args.gamma, temperature=0, eos_token_id=target.eos_token_id,
                                     target_logprobs=False):
            sys.stdout.write(text.add(chunk.tokens))
            sys.stdout.flush()
            stats, stop_reason = chunk.stats, chunk.stop_reason
        print(text.flush() + "\n")
        if stats is None:  # nothing was generated (--max-new-tokens 0)
            continue
        print(format_stats(stats, draft=args.draft, gamma=args.gamma, stop_reason=stop_reason))
        if args.compare:
            plain = speculum.generate(target, prompt_ids, max_new_tokens=args.max_new_tokens, temperature=0,
                                      eos_token_id=target.eos_token_id)
            plain_seconds = plain.stats.total_seconds
            identical = plain.tokens == text.tokens
            all_identical &= identical
            speedup = plain_seconds / stats.total_seconds if stats.total_seconds else float("nan")
            print(f"plain greedy decoding: {len(plain.tokens)} tokens in {plain_seconds:.2f} s; "
                  f"identical tokens: {'yes' if identical else 'NO'}; speculative speed-up {speedup:.2f}x")
    return 0 if all_identical else 1
