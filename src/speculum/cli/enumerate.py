"""``speculum enumerate`` and ``speculum rank``: a model's most probable continuations, and one's rank.

``enumerate`` lists the top-K continuations of a prompt with the TARGET's exact log-probs: exactly
(``--draft none``: the exact index on the target) or speculatively (a draft builds the index, the target
rescores the pulled window in one batched call, with a certificate). ``rank`` places continuations
among all continuations of their token length and reports their exposure (Carlini et al., "The Secret
Sharer"). With ``--regex`` / ``--choices-file`` both run constrained (:mod:`speculum.cli.constrained`).
Formatting only: the work is in :mod:`speculum.enumeration`.
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import json
import math
import os
import sys
import time
from typing import Any

from speculum.cli import constrained
from speculum.cli.checks import CLIError, check_at_least, check_draft, utf8_text
from speculum.cli.generate import add_cache_argument, add_dtype_argument, load_target_model
from speculum.cli.progress import index_bar
from speculum.distributed.ray_pool import ClusterUnreachableError, ModelSpec, RayPool, check_address, ray_install_hint
from speculum.drafts import ENUMERATION, make_enumeration_draft
from speculum.enumeration import AutoregressiveEnumerable, RescoredIndex
from speculum.enumeration.enumerable import DEFAULT_MAX_NODES, ForwardBudgetError
from speculum.enumeration.estimation.exposure import estimate_rank
from speculum.enumeration.rescored import DEFAULT_RERANK_WINDOW
from speculum.validation import InputError

DEFAULT_TARGET = "smollm2-135m"
DEFAULT_WINDOW = DEFAULT_RERANK_WINDOW


def register(subparsers: Any) -> None:
    enum = subparsers.add_parser(
        "enumerate", help="the K most probable continuations of a prompt (exact target scores)",
        description="List a prompt's most probable continuations with the target's exact log-probs. A draft "
                    "(--draft) builds the index; the target rescores the candidates in one batched call. "
                    "--regex: only the members of a format, exact; --choices-file: every label of a set.")
    enum.add_argument("prompt", help="prompt text (token ids separated by spaces for models without a tokenizer)")
    # One of --length, --eos, --regex, --choices-file is required: checked in run_enumerate.
    size = enum.add_mutually_exclusive_group()
    size.add_argument("--length", type=int, help="enumerate continuations of exactly this many tokens (one of "
                                                 "--length, --eos, --regex, --choices-file is required)")
    size.add_argument("--eos", action="store_true", help="enumerate continuations ending in the model's eos "
                                                         "(with --regex / --choices-file: each member then eos)")
    enum.add_argument("--max-len", type=int, default=None,
                      help="with --eos or --regex: longest continuation (tokens)")
    enum.add_argument("--top-k", type=int, default=None,
                      help="how many continuations to list (required; with --choices-file default: all)")
    constrained.add_enumerate_arguments(enum)
    enum.add_argument("--draft", default="none",
                      help="none (exact index on the target), ngram (fitted to target samples), llamacpp (the "
                           "embedded GGUF on llama.cpp; llamacpp:FILE.gguf for another), int8, bf16, "
                           "layers:K, or a model PATH with the target's tokenizer (default: none)")
    enum.add_argument("--certify", action="store_true",
                      help="grow the rerank window until the answer is certified (needs --assumed-gap)")
    enum.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="rerank window (default: 64)")
    enum.add_argument("--max-window", type=int, default=4096, help="largest window --certify may reach")
    enum.add_argument("--assumed-gap", type=float, default=None,
                      help="assumed bound (nats) on |target - draft| log-prob, which certificates rest on")
    enum.add_argument("--max-nodes", type=int, default=DEFAULT_MAX_NODES,
                      help=f"most prefix-tree nodes the index may store, ~60 bytes each (default: "
                           f"{DEFAULT_MAX_NODES:,}); a query that needs more stops with an error")
    _common(enum)
    enum.set_defaults(handler=run_enumerate)

    rank = subparsers.add_parser(
        "rank", help="a continuation's rank among all continuations of its length, and its exposure",
        description="Rank of a continuation among all vocab^length continuations of its token length, its "
                    "log-prob and exposure log2(V^L) - log2(rank+1) (Carlini et al., 'The Secret Sharer'): "
                    "exact when the rank is small, else a sampled-envelope estimate with a bracket. With "
                    "--regex: among the members of a format, exact or a certified bracket.")
    rank.add_argument("prompt", help="prompt text (token ids for models without a tokenizer)")
    canary = rank.add_mutually_exclusive_group(required=True)
    canary.add_argument("--text", help="the continuation (token ids for models without a tokenizer)")
    canary.add_argument("--file", help="rank every line of this file (one continuation per line; leading "
                                       "spaces count, empty lines are skipped)")
    rank.add_argument("--max-canaries", type=int, default=constrained.DEFAULT_MAX_CANARIES, metavar="N",
                      help=f"with --file: most lines the file may hold; it may be at most N x "
                           f"{constrained.LINE_BYTES:,} bytes (default: {constrained.DEFAULT_MAX_CANARIES:,})")
    rank.add_argument("--n-paths", type=int, default=16, help="sampled paths of the envelope (default: 16)")
    rank.add_argument("--exact-limit", type=int, default=1000,
                      help="count exactly when the rank is at most this (default: 1000)")
    constrained.add_rank_arguments(rank)
    _common(rank)
    rank.set_defaults(handler=run_rank)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET, help=f"target model name or path (default: {DEFAULT_TARGET})")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap the prompt in the chat template (default when the tokenizer has one)")
    mode.add_argument("--raw", dest="chat", action="store_false", help="use the prompt text as is")
    parser.add_argument("--seed", type=int, default=0, help="seed of every sampler (default: 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--workers", type=int, default=None,
                        help="run the target's forwards on N Ray actors, each holding the model (a local Ray "
                             "cluster on this machine unless --ray-address); answers are unchanged")
    parser.add_argument("--ray-address", default=None, metavar="ADDR",
                        help="join the Ray cluster at ADDR (HOST:PORT, ray://HOST:PORT or auto) instead of "
                             "starting one; --workers defaults to 1 there")
    add_dtype_argument(parser)
    add_cache_argument(parser)


# ------------------------------------------------------------------------------------------ helpers
def load_target(spec: str, *, verify: bool = False, dtype: str | None = None, command: str = "enumerate") -> Any:
    """The ``--target`` model (tests replace this function to run on a tiny reference model)."""
    return load_target_model(spec, command=command, dtype=dtype, verify=verify)


def _worker_spec(args: argparse.Namespace) -> Any:
    """What each Ray actor loads for ``--target`` (tests replace this function with a reference model's
    factory, as they replace ``load_target``)."""

    return ModelSpec(args.target)


def _check_workers(args: argparse.Namespace) -> None:
    """``--workers`` and ``--ray-address``, before the model loads or Ray starts: at most one worker per CPU
    of this machine for a local cluster, Ray installed, and a cluster address that accepts a connection."""
    check_at_least(args.workers, 1, "--workers")
    if args.workers is None and args.ray_address is None:
        return
    cpus = os.cpu_count() or 1
    if args.ray_address is None and args.workers > cpus:
        # The local cluster has one Ray CPU per core, and each worker takes at least one.
        raise CLIError(f"--workers {args.workers}: at most {cpus} on this machine (one per CPU of the local Ray "
                       f"cluster); give --ray-address to run more on a cluster")

    try:
        importlib.import_module("ray")              # said before any model loads
    except ImportError:
        raise CLIError(f"--workers needs Ray. {ray_install_hint()}") from None
    if args.ray_address is not None:
        try:
            check_address(args.ray_address)
        except (ClusterUnreachableError, InputError) as exc:
            raise CLIError(f"--ray-address: {exc}") from None


def _on_workers(args: argparse.Namespace, target: Any) -> Any:
    """The target itself, or with ``--workers`` / ``--ray-address`` a :class:`RayPool` of it (the loaded
    target stays the pool's local copy: tokenizer, sessions)."""
    if args.workers is None and args.ray_address is None:
        return target

    try:
        pool = RayPool(_worker_spec(args), args.workers or 1, address=args.ray_address, local=target)
    except ClusterUnreachableError as exc:
        raise CLIError(str(exc)) from None
    atexit.register(pool.close)
    return pool


def encode_text(model: Any, text: str, *, chat: bool | None, prompt: bool) -> list[int]:
    if getattr(model, "tokenizer", None) is None:
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            raise CLIError(f"{getattr(model, 'name', 'this model')} has no tokenizer: give token ids") from None
    if prompt:
        return model.encode(text, chat=chat)
    return [int(t) for t in model.tokenizer(text, add_special_tokens=False)["input_ids"]]


def _text(model: Any, tokens) -> str:
    # Special tokens stay in (an eos is part of what is ranked); the table prints the text repr-escaped.
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        return " ".join(str(t) for t in tokens)
    return tokenizer.decode([int(t) for t in tokens], skip_special_tokens=False)


# ---------------------------------------------------------------------------------------- enumerate
def run_enumerate(args: argparse.Namespace) -> int:
    for name in ("length", "max_len", "top_k", "max_window", "max_nodes"):
        check_at_least(getattr(args, name), 1, f"--{name.replace('_', '-')}")
    check_at_least(args.window, 0, "--window")
    check_at_least(args.assumed_gap, 0, "--assumed-gap")
    check_at_least(args.seed, 0, "--seed")
    check_draft(args.draft, purpose=ENUMERATION)   # a draft *model* (never fixed proposals), loading nothing
    if args.certify and args.assumed_gap is None and args.draft.strip().lower() != "none":
        raise CLIError("--certify needs --assumed-gap: a certificate rests on a bound on |target - draft|")
    constraint = constrained.check_enumerate(args)
    if args.max_len is not None and not args.eos and args.regex is None:
        raise CLIError("--max-len goes with --eos or --regex (use --length for fixed-length continuations)")
    _check_workers(args)
    prompt_text = utf8_text(args.prompt, "prompt", "enumerate")
    target = _on_workers(args, load_target(args.target, verify=args.verify_cache, dtype=args.dtype,
                                                  command=args.command))
    prompt = encode_text(target, prompt_text, chat=args.chat, prompt=True)
    eos = constrained.eos_id(target) if args.eos else None
    if args.regex is not None:
        return constrained.enumerate_format(args, target, prompt, eos, constraint)
    if constraint is not None:
        return constrained.enumerate_choices(args, target, prompt, eos, constraint)
    max_len = args.length if args.length is not None else args.max_len
    started = time.perf_counter()
    draft = make_enumeration_draft(args.draft, target, prompt=prompt, length=max_len or 16, eos=eos,
                                   seed=args.seed)
    # A bar on stderr while the index is built, only on a terminal (it would litter logs and pipes).
    index_options = dict(max_len=max_len, eos=eos, prompt=prompt, max_nodes=args.max_nodes,
                         progress=index_bar(leave=False) if sys.stderr.isatty() else None,
                         # An eos listing may lie arbitrarily deep (eos unlikely): bounded like --regex.
                         max_forwards=None if eos is None else constrained.listing_forwards(args))
    try:
        result = _listing(args, target, draft, index_options)
    except ForwardBudgetError as exc:
        capped = "" if args.max_len is None else f" within --max-len {args.max_len}"
        raise constrained.over_forward_limit(f"the top {args.top_k:,} continuations ending in eos{capped}", exc,
                                             "lower --top-k or cap --max-len") from None
    seconds = time.perf_counter() - started
    rows = [{"rank": r, "tokens": list(seq), "text": _text(target, seq), "target_log_prob": lp,
             "draft_log_prob": dlp}
            for r, ((seq, lp), dlp) in enumerate(zip(result["items"], result["draft_log_probs"]))]
    report = {"draft": args.draft, "certified": result["certified"], "reason": result["reason"],
              "window": result["window"], "observed_gap": result["gap"], "target_calls": result["target_calls"],
              "seconds": seconds, "items": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{'rank':>4}  {'target lp':>10}  {'draft lp':>10}  text")
    for row in rows:
        print(f"{row['rank']:>4}  {row['target_log_prob']:>10.4f}  {row['draft_log_prob']:>10.4f}  "
              f"{row['text']!r}")
    verdict = {True: "yes", False: "no", None: "unknown"}[result["certified"]]
    print(f"certified: {verdict} ({result['reason']}); window {result['window']}, observed gap "
          f"{result['gap']:.4f} nats, target calls {result['target_calls']}, {seconds:.2f} s")
    return 0


def _listing(args: argparse.Namespace, target: Any, draft: Any, index_options: dict) -> dict:
    """The top ``--top-k`` of an unconstrained run: the exact index on the target, or a draft's rescored."""
    if draft is None:
        items = AutoregressiveEnumerable(target, **index_options).top_k(args.top_k)
        return {"items": items, "draft_log_probs": [lp for _, lp in items], "certified": True,
                "reason": "exact index on the target", "window": 0, "gap": 0.0, "target_calls": None}
    draft_index = AutoregressiveEnumerable(draft, **index_options)
    index = RescoredIndex(draft_index, target, rerank_window=args.window, assumed_gap=args.assumed_gap,
                          certify=args.certify, max_window=max(args.max_window, args.window))
    return index.top_k(args.top_k)


# --------------------------------------------------------------------------------------------- rank
def run_rank(args: argparse.Namespace) -> int:
    check_at_least(args.n_paths, 1, "--n-paths")
    check_at_least(args.exact_limit, 0, "--exact-limit")
    check_at_least(args.seed, 0, "--seed")
    check_at_least(args.max_canaries, 1, "--max-canaries")
    regex = constrained.check_rank(args)
    prompt_text = utf8_text(args.prompt, "prompt", "rank")
    if args.text is not None:
        texts = [utf8_text(args.text, "--text", "rank")]
    else:
        texts = constrained.read_bounded_lines(args.file, "--file", "rank", limit=args.max_canaries,
                                               limit_flag="--max-canaries", nouns=("line", "lines"))
    _check_workers(args)
    target = _on_workers(args, load_target(args.target, verify=args.verify_cache, dtype=args.dtype,
                                                  command=args.command))
    prompt = encode_text(target, prompt_text, chat=args.chat, prompt=True)
    if regex is not None:
        return constrained.rank_format(args, target, prompt, texts, regex,
                                       lambda text: encode_text(target, text, chat=None, prompt=False))
    reports = [_rank_one(args, target, prompt, text) for text in texts]
    if args.json:
        print(json.dumps(reports[0] if args.text is not None else {"prompt": args.prompt, "items": reports}))
        return 0
    for data in reports:
        low, high = data["exposure_bracket"]
        lo, hi = data["rank_bracket"]
        space = data["length"] * math.log2(target.vocab_size)
        print(f"continuation: {_text(target, data['tokens'])!r} ({data['length']} tokens, 2^{space:.1f} "
              f"continuations)")
        print(f"rank: {data['rank']:.4g} in [{lo:.4g}, {hi:.4g}] ({data['method']})")
        print(f"log-prob: {data['log_prob']:.4f} nats; exposure: {data['exposure_bits']:.2f} bits "
              f"in [{low:.2f}, {high:.2f}]; {data['seconds']:.2f} s")
    return 0


def _rank_one(args: argparse.Namespace, target: Any, prompt: list[int], text: str) -> dict:
    """One continuation's rank among all continuations of its token length, as the JSON fields."""

    continuation = encode_text(target, text, chat=None, prompt=False)
    if not continuation:
        raise CLIError("--text encodes to no tokens" if args.text is not None else f"{text!r} encodes to no tokens")
    started = time.perf_counter()
    report = estimate_rank(target, continuation, prompt=prompt, exact_limit=args.exact_limit,
                           n_paths=args.n_paths, seed=args.seed)
    return {"tokens": continuation, "length": report.length, "rank": report.rank,
            "rank_bracket": [report.rank_lo, report.rank_hi], "log_prob": report.log_prob,
            "exposure_bits": report.exposure_bits, "exposure_bracket": list(report.exposure_bracket),
            "method": report.method, "seconds": time.perf_counter() - started}
