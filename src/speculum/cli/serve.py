"""``speculum serve``: an OpenAI-compatible HTTP server (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``, ``/metrics``) over speculative decoding, on FastAPI + uvicorn.

The target and draft are chosen as for ``speculum generate``. Up to ``--max-batch`` requests are generated
together, one block each per step, admitted in arrival order from a bounded queue (429 beyond it); each
is exactly the target's law, and a seeded request's output does not depend on the others (with a draft
whose proposals depend on the context only, e.g. ``lookup``).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import threading
from typing import Any

from speculum.cli.checks import CLIError, check_at_least, check_draft
from speculum.drafts import make_draft
from speculum.models.vocabulary import token_bytes
from speculum.serving import Engine, create_app, serve_on_this_thread
from speculum.models.prompt_scores import DEFAULT_CACHE_TOKENS
from speculum.validation import InputError
from speculum.cli.generate import (add_draft_argument, add_gamma_argument, add_model_arguments, drafts_help,
                                   load_target)

# Named here as well as in speculum.serving.schema (which needs pydantic): --help must work without the extra.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
DEFAULT_SHUTDOWN_SECONDS = 5.0

__all__ = ["register", "run", "build_server"]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the target over an OpenAI-compatible HTTP API, with speculative decoding",
        description=(
            "Serve the target over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions "
            "with streaming, /v1/models, /health, /metrics). Every response has exactly the target's "
            "output distribution; temperature 0 gives the tokens of plain greedy decoding. Up to "
            "--max-batch requests are generated together; more than --max-waiting waiting get HTTP 429."
        ),
        epilog=(f"{drafts_help()}\n\nexample:\n  speculum serve --port 8000 &\n"
                "  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\\n"
                "       -d '{\"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}'"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    add_draft_argument(parser)
    add_gamma_argument(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model name clients send and /v1/models lists (default: --target)")
    parser.add_argument("--max-batch", type=int, default=8, metavar="N",
                        help="requests generated together, one block each per step (default: 8)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="verify each request in its own forward: greedy output identical to the request "
                             "alone, whatever else runs (slower under load; the PyTorch backend's fused forward "
                             "gives that in its packed forward, which it keeps)")
    parser.add_argument("--prompt-tokens-per-step", type=int, default=512, metavar="N",
                        help="prompt tokens fed per step at most, with the running requests' blocks; a longer "
                             "prompt is fed over several steps, so the others keep streaming (default: 512)")
    parser.add_argument("--max-waiting", type=int, default=64, metavar="N",
                        help="requests that may wait while --max-batch run; more get HTTP 429 (default: 64)")
    parser.add_argument("--default-max-tokens", type=int, default=256, metavar="N",
                        help="max_tokens of a request that sets none (default: 256)")
    parser.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                        help="largest request body; a larger one gets HTTP 413 before it is read (default: sized "
                             "to the context window, ~6x its longest prompt in UTF-8, plus 64 KiB)")
    parser.add_argument("--max-stop", type=int, default=MAX_STOP_STRINGS, metavar="N",
                        help=f"stop strings a request may give (default: {MAX_STOP_STRINGS}, as OpenAI)")
    parser.add_argument("--max-stop-chars", type=int, default=MAX_STOP_CHARS, metavar="N",
                        help=f"characters of one stop string at most (default: {MAX_STOP_CHARS})")
    parser.add_argument("--prefix-cache-tokens", type=int, default=DEFAULT_CACHE_TOKENS, metavar="N",
                        help="tokens of recently scored echo prompts kept for reuse by prompts sharing their "
                             f"prefix (their KV caches; least recently used evicted; default: {DEFAULT_CACHE_TOKENS})")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_SECONDS, metavar="SECONDS",
                        help="on SIGINT / SIGTERM, seconds the open responses may still take; those left then "
                             "end with an error event and [DONE] (default: 5)")
    parser.set_defaults(handler=run)


def check_args(args: argparse.Namespace) -> None:
    check_draft(args.draft)
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in 0..65535, got {args.port}")
    check_at_least(args.max_batch, 1, "--max-batch")
    check_at_least(args.max_waiting, 0, "--max-waiting")
    check_at_least(args.prompt_tokens_per_step, 1, "--prompt-tokens-per-step")
    check_at_least(args.default_max_tokens, 1, "--default-max-tokens")
    check_at_least(args.max_body_bytes, 1024, "--max-body-bytes")
    check_at_least(args.max_stop, 0, "--max-stop")
    check_at_least(args.max_stop_chars, 1, "--max-stop-chars")
    check_at_least(args.prefix_cache_tokens, 0, "--prefix-cache-tokens")
    if not args.shutdown_timeout >= 0:
        raise CLIError(f"--shutdown-timeout must be at least 0 seconds, got {args.shutdown_timeout}")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    try:
        import uvicorn    # the serve extra, loaded only by this command
    except ImportError:
        raise ImportError("speculum serve needs FastAPI and uvicorn: pip install 'speculum[serve]'") from None

    # The engine runs on this thread, which loaded the model (see Engine's `background`); HTTP on another.
    engine, app = build_server(args, background=False)
    # SIGINT / SIGTERM: refuse new requests, let open responses end within --shutdown-timeout, end the rest
    # with an error event; uvicorn waits a little longer so that those last events reach their clients.
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                           timeout_graceful_shutdown=math.ceil(args.shutdown_timeout) + 2))
    if not serve_on_this_thread(server, engine, grace=args.shutdown_timeout):
        raise CLIError(f"could not serve on {args.host}:{args.port} (see the error above)")
    return 0


def build_server(args: argparse.Namespace, *, background: bool) -> tuple[Engine, Any]:
    """The engine and the HTTP app ``serve`` runs for ``args`` (checked): the target loaded, its draft built,
    its unpacked block weights given back. ``background``: see :class:`~speculum.serving.Engine`."""
    target = load_target(args)
    draft = make_draft(args.draft, target)
    # The draft is built: nothing the server runs reads the target's unpacked block weights any more.
    release = getattr(target, "release_unfused_weights", None)
    if release is not None:
        release()
    engine = Engine(target, draft=draft, gamma=args.gamma, max_batch=args.max_batch, max_waiting=args.max_waiting,
                    batch_invariant=args.batch_invariant, prompt_tokens_per_step=args.prompt_tokens_per_step,
                    prefix_cache_tokens=args.prefix_cache_tokens, background=background)
    name = args.served_model_name or args.target
    pieces = _token_bytes(target)
    # The HTTP side encodes with a tokenizer of its own: a long prompt never waits for, nor blocks, the
    # engine's decoding (fast tokenizers refuse concurrent use of one object).
    encoder = _encoding_twin(target)
    app = create_app(engine, name, encode_text=lambda text: encoder.encode(text, chat=False),
                     encode_chat=chat_encoder(encoder), default_max_tokens=args.default_max_tokens,
                     token_bytes=pieces, limits=server_limits(args, target, pieces),
                     encode_lock=threading.Lock() if encoder is not target else None,
                     decode_text=encoder.decode, **tokenizer_routes(encoder))
    return engine, app


def server_limits(args: argparse.Namespace, target: Any, pieces: Any) -> Any:
    """The request limits: sized to the target's context window and longest token, overridden by flags."""
    from speculum.serving.schema import default_body_limit     # pydantic: the serve extra

    longest = max((len(p) for p in pieces if p), default=None) if pieces is not None else None
    limits = default_body_limit(getattr(target, "max_context", None), longest)
    return dataclasses.replace(limits, max_stop=args.max_stop, max_stop_chars=args.max_stop_chars,
                               max_body_bytes=args.max_body_bytes or limits.max_body_bytes)


def tokenizer_routes(model: Any) -> dict:
    """``tokenize`` and ``tokenizer_info`` for ``create_app`` (the routes evaluators probe, e.g.
    lm-evaluation-harness' remote tokenizer), from a Hugging Face tokenizer; none for another backend."""
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None or not hasattr(tokenizer, "backend_tokenizer"):
        return {}
    info = {"eos_token": tokenizer.eos_token, "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": getattr(model, "max_context", None)}

    def tokenize(text: str, add_special_tokens: bool) -> list[int]:
        return [int(t) for t in tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]]

    return {"tokenize": tokenize, "tokenizer_info": info}


def _encoding_twin(target: Any) -> Any:
    """An object with the target's ``encode`` and ``tokenizer`` but a copy of its tokenizer (the target
    itself where the tokenizer cannot be copied)."""
    tokenizer = getattr(target, "tokenizer", None)
    # Only a Hugging Face fast tokenizer (pure Rust state) is copied; another may hold native handles.
    if tokenizer is None or not hasattr(tokenizer, "backend_tokenizer") or not hasattr(target, "encode"):
        return target
    try:
        twin = copy.copy(target)
        twin.tokenizer = copy.deepcopy(tokenizer)
    except Exception:           # a tokenizer bound to native state (llama.cpp's) is used as it is
        return target
    return twin


def _token_bytes(target: Any) -> Any:
    """Each token's bytes (the ``bytes`` of chat log-probs), or None where the tokenizer cannot tell them."""
    try:
        return token_bytes(target)
    except InputError:      # no tokenizer it can read: log-probs then give the UTF-8 of each token's text
        return None


def chat_encoder(target: Any) -> Any:
    """messages -> prompt ids through the tokenizer's chat template (None when it has none)."""
    tokenizer = getattr(target, "tokenizer", None)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None

    def encode(messages: list[dict]) -> list[int]:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(t) for t in ids]

    return encode
