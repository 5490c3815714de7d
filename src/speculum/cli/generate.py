"""``speculum generate PROMPT``: speculative text generation from the command line.

Loads a target (the embedded SmolLM2-135M-Instruct by default, or a local model directory), builds the
draft named by ``--draft`` (``speculum.drafts.make_draft``), streams the text as the target
accepts it and ends with a short statistics table (stderr), or prints one JSON object with ``--json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

import speculum
from speculum.cli.checks import CLIError, check_draft, check_sampling, read_stdin, utf8_text, warn
from speculum.cli.progress import loading_progress
from speculum.decoding.text import TextStream
from speculum.drafts import DRAFT_KINDS, is_twin_draft, make_draft
from speculum.models import backends
from speculum.models.backends import BACKENDS, DEFAULT_BACKEND, backend_named, backend_names

__all__ = ["register", "run", "format_stats", "parse_gamma", "TextStream", "add_draft_argument",
           "add_gamma_argument", "drafts_help", "load_target_model"]

DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_DRAFT = "lookup"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text with speculative decoding (exactly the target's output distribution)",
        description=(
            "Generate a continuation of PROMPT with speculative decoding: the draft proposes tokens, the "
            "target verifies them in one forward. The output has exactly the target's distribution; at "
            "--temperature 0 it is identical to plain greedy decoding. Text streams as it is accepted; "
            "statistics follow on stderr."
        ),
        epilog=f"{drafts_help()}\n\nexample:\n  speculum generate 'Summarise: ...' --draft lookup --gamma auto",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("prompt", metavar="PROMPT", help="the prompt text ('-' reads it from stdin)")
    add_model_arguments(parser)
    add_draft_argument(parser)
    add_decoding_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, statistics)")
    parser.set_defaults(handler=run)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--target``, ``--backend``, ``--dtype`` (shared with ``speculum demo``)."""
    opens = " or ".join(dict.fromkeys(kind for backend in BACKENDS.values() for kind in backend.opens.split(" or ")))
    parser.add_argument("--target", default="smollm2-135m", metavar="MODEL",
                        help=f"embedded model name or {opens} (default: smollm2-135m)")
    parser.add_argument("--backend", choices=tuple(BACKENDS), default=DEFAULT_BACKEND,
                        help="; ".join(f"{name}: {backend.summary}{' (default)' if name == DEFAULT_BACKEND else ''}"
                                       for name, backend in BACKENDS.items()))
    add_dtype_argument(parser)
    add_cache_argument(parser)


# Every precision a backend loads (speculum.models.backends), in table order.
DTYPES = tuple(dict.fromkeys(dtype for backend in BACKENDS.values() for dtype in backend.dtypes))


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--dtype`` (every command that loads a PyTorch target)."""
    # Default None, read as the backend's default: an explicit --dtype on a backend without dtypes gets a warning.
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help=f"the target's precision on the {' / '.join(backend_names(lambda b: b.takes_dtype))} "
                             "backend: float32 (default), bfloat16, float16, or "
                             "int8 (weight-only, one scale per output channel); each is a target of its own, "
                             "every guarantee holds relative to it (docs/backends.md: which to pick)")


def load_target_model(spec: str, *, command: str, backend: str = DEFAULT_BACKEND, dtype: str | None = None,
                      verify: bool = False) -> Any:
    """``load_model(spec, backend=..., dtype=...)`` with a progress line where the backend reports one,
    warning (one line) where ``dtype`` is likely slower than the backend's default on this CPU."""
    entry = backend_named(backend)
    options: dict[str, Any] = {}
    if entry.takes_dtype:
        options["dtype"] = dtype = dtype or entry.dtypes[0]
        advice = entry.dtype_advice(dtype) if dtype != entry.dtypes[0] else None
        if advice is not None:
            warn(command, f"--dtype {dtype}: {advice}")
    if "progress" in entry.options:
        options["progress"] = loading_progress()
    if "verify" in entry.options:
        options["verify"] = verify
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="dtype=", category=RuntimeWarning)   # said above, once
        return backends.load_model(spec, backend=backend, **options)


def add_cache_argument(parser: argparse.ArgumentParser) -> None:
    """``--verify-cache`` (every command that loads a model)."""
    parser.add_argument("--verify-cache", action="store_true",
                        help="check the checksum of every file of the embedded model's converted cache before "
                             "loading (sizes and file stamps are always checked; a damaged cache is rebuilt)")


def drafts_help() -> str:
    """The epilog's list of draft kinds (``generate`` and ``serve``)."""
    return "drafts (--draft):\n" + "\n".join(f"  {name:<10} {text}" for name, text in DRAFT_KINDS.items())


def add_draft_argument(parser: argparse.ArgumentParser) -> None:
    """``--draft`` (``generate`` and ``serve``)."""
    parser.add_argument("--draft", default=DEFAULT_DRAFT, metavar="DRAFT",
                        help=f"none | lookup | ngram | int8 | bf16 | layers:K | PATH (default: {DEFAULT_DRAFT})")


def add_gamma_argument(parser: argparse.ArgumentParser) -> None:
    """``--gamma`` (``generate``, ``demo`` and ``serve``)."""
    parser.add_argument("--gamma", default="auto", metavar="N|auto", type=parse_gamma,
                        help="draft tokens per target forward, or 'auto' to adapt it (default: auto)")


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """Sampling and speculation options (shared with ``speculum demo``)."""
    add_gamma_argument(parser)
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                        help=f"most tokens to generate (default: {DEFAULT_MAX_NEW_TOKENS})")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (default); > 0 samples exactly from the tempered target")
    parser.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K most likely tokens")
    parser.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus sampling with mass P")
    parser.add_argument("--seed", type=int, default=None, help="random seed (sampling is reproducible with it)")
    chat = parser.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap PROMPT in the tokenizer's chat template (default when it has one)")
    chat.add_argument("--raw", dest="chat", action="store_false", help="feed PROMPT as plain text")


def parse_gamma(value: str) -> int | str:
    """argparse type for ``--gamma``: a positive integer or ``"auto"``."""
    if value == "auto":
        return value
    try:
        gamma = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', got {value!r}") from None
    if gamma < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', got {value!r}")
    return gamma


def load_target(args: argparse.Namespace) -> Any:
    """The target model named by ``--target / --backend / --dtype``."""
    return load_target_model(args.target, command=args.command, backend=args.backend, dtype=args.dtype,
                             verify=args.verify_cache)


def check_args(args: argparse.Namespace) -> None:
    """Every check that needs no model, run before one loads; warns about flags that will have no effect."""
    check_sampling(args)
    check_draft(args.draft)
    backend = backend_named(args.backend)
    if not backend.twin_drafts and is_twin_draft(args.draft):
        raise CLIError(f"--draft {args.draft.strip()} is built from the target's PyTorch weights: "
                       f"it needs --backend {' or '.join(backend_names(lambda b: b.twin_drafts))}")
    if args.temperature == 0:
        unused = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p), ("--seed", args.seed))
                  if value is not None]
        if unused:
            warn("generate", f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect at "
                             f"--temperature 0 (greedy decoding)")
    if not backend.takes_dtype and args.dtype is not None:
        warn("generate", f"--dtype has no effect with --backend {backend.name} ({backend.fixed_dtype})")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    prompt_text = read_stdin("generate") if args.prompt == "-" else utf8_text(args.prompt, "PROMPT", "generate")
    target = load_target(args)
    prompt_ids = target.encode(prompt_text, chat=args.chat)
    draft = make_draft(args.draft, target)
    chunks = speculum.stream(
        target, prompt_ids, draft=draft, max_new_tokens=args.max_new_tokens, gamma=args.gamma,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        eos_token_id=target.eos_token_id, seed=args.seed, target_logprobs=args.json,
    )
    text = TextStream(target)
    stats, stop_reason = None, None
    token_logprobs: list[float] = []       # the target's own log-prob of each token (exact, free)
    for chunk in chunks:
        if chunk.target_logprobs is not None:
            token_logprobs += [float(row[token]) for token, row in zip(chunk.tokens, chunk.target_logprobs)]
        piece = text.add(chunk.tokens)
        if not args.json and piece:
            sys.stdout.write(piece)
            sys.stdout.flush()
        stats, stop_reason = chunk.stats, chunk.stop_reason
    if args.json:
        json.dump({
            "target": getattr(target, "name", args.target), "draft": args.draft, "gamma": args.gamma,
            "prompt_tokens": len(prompt_ids), "tokens": text.tokens, "text": text.text(),
            "token_logprobs": token_logprobs, "stop_reason": stop_reason, "stats": stats.as_dict() if stats else None,
        }, sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(text.flush() + "\n")
        if stats is not None:
            print(format_stats(stats, draft=args.draft, gamma=args.gamma, stop_reason=stop_reason), file=sys.stderr)
    return 0


def format_stats(stats: Any, *, draft: str, gamma: Any, stop_reason: str | None = None) -> str:
    """A short table of one generation's ``DecodingStats`` (the CLI's only place that formats metrics)."""
    rows = [
        ("draft", f"{draft} (gamma {gamma})"),
        ("tokens", f"{stats.emitted} in {stats.total_seconds:.2f} s = {stats.tokens_per_second:.1f} tokens/s"
                   + (f" (stop: {stop_reason})" if stop_reason else "")),
        ("acceptance rate", f"{stats.acceptance_rate:.1%} ({stats.accepted}/{stats.proposed} draft tokens)"),
        ("tokens/target forward", f"{stats.tokens_per_target_forward:.2f} ({stats.target_forwards} forwards)"),
        ("draft vs target time", f"{stats.draft_seconds:.2f} s vs {stats.target_seconds:.2f} s"),
    ]
    if getattr(stats, "draft_skipped", None):
        rows.append(("draft skipped", stats.draft_skipped))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
