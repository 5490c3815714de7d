"""Constrained ``speculum enumerate`` and ``speculum rank``: a format (``--regex``) or a label set
(``--choices-file``).

``enumerate --regex`` lists the K most probable members of a format with the target's exact log-probs
(token sequences, or with ``--strings`` strings summed over all their tokenizations), then the format's
size and a certified bracket on its mass. ``enumerate --choices-file`` scores every line of a file exactly
(ranks, log-probs, probabilities normalised over the set). ``rank --regex`` places canaries among the
format's members and reports their exposure ``log2 |format| - log2(rank + 1)``: exact ranks, or certified
brackets past ``--max-forwards``. Flag checks and formatting only: the work is in :mod:`speculum.enumeration`.

Example (on the embedded SmolLM2):
    speculum enumerate "My PIN is" --raw --regex " [0-9]{4}" --top-k 5 --strings
    speculum rank "My PIN is" --raw --regex " [0-9]{4}" --text " 1234" --strings
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

from speculum.cli.checks import CLIError, check_at_least, utf8_text, warn
from speculum.cli.counts import count_bits, count_json, count_text
from speculum.cli.progress import choices_bar, index_bar
from speculum.enumeration import AutoregressiveEnumerable, Choices, Regex, estimate_ranks, score_choices
from speculum.enumeration.formats.automaton import AutomatonBudgetError
from speculum.enumeration.formats.charfsm import compile_chars
from speculum.enumeration.enumerable import ForwardBudgetError, IndexBudgetError
from speculum.enumeration.estimation.exposure import DEFAULT_MAX_FORWARDS
from speculum.enumeration.rescored import DEFAULT_RERANK_WINDOW
from speculum.validation import InputError

__all__ = ["add_enumerate_arguments", "add_rank_arguments", "check_enumerate", "check_rank", "parse_regex",
           "read_lines", "read_bounded_lines", "eos_id", "listing_forwards", "over_forward_limit", "enumerate_format",
           "enumerate_choices", "rank_format", "MAX_LINE_CHARS", "DEFAULT_LISTING_FORWARDS", "DEFAULT_MAX_CHOICES",
           "DEFAULT_MAX_CANARIES", "LINE_BYTES"]

# Longest line of a --choices-file / --file, in characters: a label or canary, not a document.
MAX_LINE_CHARS = 1_000
# Share of a file's characters that may be invalid UTF-8 before it counts as binary, not text.
MAX_INVALID_SHARE = 0.05
# Most prefixes ``enumerate --regex`` / ``--eos`` forwards for its listing: ~0.1 s each for SmolLM2-135M on a
# CPU, so a listing whose top-K lies deep in the model's tail (a wide class, a rare script, an unlikely eos)
# stops within about a minute.
DEFAULT_LISTING_FORWARDS = 500
# Most lines of a --choices-file (a label set: each costs a few forwards) and of a canaries file (each canary
# costs a rank), and the bytes a line may take on average: a larger file is refused by its size, unread.
DEFAULT_MAX_CHOICES = 100_000
DEFAULT_MAX_CANARIES = 10_000
LINE_BYTES = 1024


# -------------------------------------------------------------------------------------------- flags
def add_enumerate_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--regex", metavar="PATTERN",
                       help="list only continuations whose text matches PATTERN in full (Python re syntax "
                            "without anchors, lookarounds or back-references), exact on the target; "
                            "--max-len caps their tokens, --eos makes them end in eos")
    which.add_argument("--choices-file", metavar="FILE",
                       help="score every line of FILE as a choice (a label set; leading spaces count, empty "
                            "lines are skipped): exact log-probs, ranks and probabilities over the set")
    parser.add_argument("--strings", action="store_true",
                        help="with --regex: items are strings, each scored over all its tokenizations "
                             "(default: token sequences)")
    parser.add_argument("--max-forwards", type=int, default=None, metavar="N",
                        help="with --regex or --eos: most prefixes the index may forward for the listing; a "
                             f"listing that needs more stops with an error (default: {DEFAULT_LISTING_FORWARDS:,})")
    parser.add_argument("--max-choices", type=int, default=DEFAULT_MAX_CHOICES, metavar="N",
                        help=f"with --choices-file: most choices the file may hold; it may be at most N x "
                             f"{LINE_BYTES:,} bytes (default: {DEFAULT_MAX_CHOICES:,})")
    parser.add_argument("--all-tokenizations", action="store_true",
                        help="with --choices-file: score each choice over every token sequence that spells it "
                             "(default: the tokenizer's own tokens)")


def add_rank_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--regex", metavar="PATTERN",
                        help="rank among the members of this format (Python re syntax) instead of among all "
                             "continuations of the same length; exposure uses the format's size")
    parser.add_argument("--strings", action="store_true",
                        help="with --regex: rank the text among strings, each scored over all its "
                             "tokenizations (default: its own tokens among token sequences)")
    parser.add_argument("--eos", action="store_true",
                        help="with --regex: members end in the model's eos (needed when a member is a "
                             "prefix of another)")
    parser.add_argument("--max-len", type=int, default=None, help="with --regex: most tokens of a member")
    parser.add_argument("--max-forwards", type=int, default=None,
                        help=f"with --regex: most prefixes forwarded for exact ranks; past it a certified "
                             f"rank bracket is reported (default: {DEFAULT_MAX_FORWARDS:,})")


# ------------------------------------------------------------------------------------------- checks
def check_enumerate(args: argparse.Namespace) -> Any:
    """The constrained flags of ``enumerate``, checked before anything loads: the ``Regex`` or ``Choices``
    to enumerate, or None for an unconstrained run."""
    if args.length is None and not args.eos and args.regex is None and args.choices_file is None:
        raise CLIError("give one of --length, --eos, --regex or --choices-file")
    if args.strings and args.regex is None:
        raise CLIError("--strings goes with --regex (items are the strings of the format)")
    if args.all_tokenizations and args.choices_file is None:
        raise CLIError("--all-tokenizations goes with --choices-file")
    max_forwards = getattr(args, "max_forwards", None)        # a Namespace built by an embedding caller may lack it
    check_at_least(max_forwards, 1, "--max-forwards")
    if max_forwards is not None and (args.choices_file is not None or (args.regex is None and not args.eos)):
        raise CLIError("--max-forwards goes with --regex or --eos (it bounds the listing's index)")
    max_choices = getattr(args, "max_choices", DEFAULT_MAX_CHOICES)
    check_at_least(max_choices, 1, "--max-choices")
    if args.regex is None and args.choices_file is None:
        if args.top_k is None:
            raise CLIError("--top-k is required (optional only with --choices-file)")
        return None
    flag = "--regex" if args.regex is not None else "--choices-file"
    if args.length is not None:
        raise CLIError(f"--length does not go with {flag}: the format decides the length "
                       f"(--max-len caps the tokens with --regex)")
    if args.draft.strip().lower() != "none":
        raise CLIError(f"{flag} needs --draft none: constrained enumeration runs the exact index on the target")

    ignored = [name for name, used in (("--certify", args.certify), ("--assumed-gap", args.assumed_gap is not None),
                                        ("--window", args.window != DEFAULT_RERANK_WINDOW), ("--seed", args.seed != 0)) if used]
    for name in ignored:
        warn("enumerate", f"{name} has no effect with {flag} (the exact index needs no draft)")
    if args.regex is not None:
        if args.top_k is None:
            raise CLIError("--top-k is required with --regex")
        return parse_regex(args.regex, "enumerate", eos=args.eos)
    if args.max_len is not None:
        raise CLIError("--max-len does not go with --choices-file")

    return read_choices(args.choices_file, max_choices, "enumerate")


def read_choices(path: str, limit: int, command: str) -> Any:
    """The ``Choices`` of a ``--choices-file``, bounded by ``--max-choices`` (see :func:`read_bounded_lines`)."""
    lines = read_bounded_lines(path, "--choices-file", command, limit=limit, limit_flag="--max-choices",
                               nouns=("choice", "choices"))
    try:
        return Choices(tuple(lines))
    except InputError as exc:
        raise CLIError(f"--choices-file {path!r}: {exc}") from None


def check_rank(args: argparse.Namespace) -> Any:
    """The constrained flags of ``rank``: the ``Regex`` to rank within, or None (every continuation of the
    item's length)."""
    check_at_least(args.max_len, 1, "--max-len")
    check_at_least(args.max_forwards, 0, "--max-forwards")
    if args.regex is None:
        given = [flag for flag, value in (("--strings", args.strings), ("--eos", args.eos),
                                          ("--max-len", args.max_len), ("--max-forwards", args.max_forwards))
                 if value is not None and value is not False]     # 0 is a given --max-forwards
        if given:
            raise CLIError(f"{given[0]} goes with --regex")
        return None
    return parse_regex(args.regex, "rank", eos=args.eos)


def parse_regex(pattern: str, command: str, *, eos: bool) -> Any:
    """``Regex(pattern)``, checked without a model: its syntax, what constraints support, the size of its
    automaton over characters, that it matches some string and, without ``--eos``, that some member is not
    empty and none is a proper prefix of another. CLIError naming ``--regex`` and the reason otherwise."""

    pattern = utf8_text(pattern, "--regex", command)
    if not pattern:
        raise CLIError("invalid --regex '': the regex is empty")
    try:
        chars = compile_chars(pattern, f"--regex {pattern!r}")
        regex = Regex(pattern)          # the automaton just built, from the cache
    except InputError as exc:
        raise CLIError(str(exc)) from None
    if chars.empty():
        raise CLIError(f"invalid --regex {pattern!r}: it matches no string")
    if not eos and chars.size() == 1 and chars.initial in chars.finals:
        raise CLIError(f"--regex {pattern!r} matches only the empty string, which has no tokens; add --eos to "
                       "score stopping right away")
    example = None if eos else chars.prefix_example()
    if example is not None:
        raise CLIError(f"--regex {pattern!r}: a member is a proper prefix of another ({example[0]!r} and "
                       f"{example[1]!r}): without --eos the longer one could never be told apart; add --eos")
    return regex


def read_lines(path: str, flag: str, command: str) -> list[str]:
    """The non-empty lines of the file at ``path``, each without its newline (``\\n`` or ``\\r\\n``) and
    nothing else: a leading space is part of the text (" Paris" and "Paris" are different tokens).

    Refused (CLIError): a file that looks binary (a NUL byte, or more than :data:`MAX_INVALID_SHARE` of it
    not UTF-8) and a line longer than :data:`MAX_LINE_CHARS` characters. A little invalid UTF-8 is
    replaced by U+FFFD, with a warning."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise CLIError(f"{flag}: no such file: {path}" if not file.exists() else f"{flag}: {path} is not a file")
    data = file.read_bytes()
    nul = data.find(b"\x00")
    if nul >= 0:
        raise CLIError(f"{flag} {path!r} looks binary (a NUL byte at offset {nul:,}): give a text file, one item "
                       "per line")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", "replace")
        invalid = text.count("\ufffd") - data.decode("utf-8", "ignore").count("\ufffd")
        if invalid > MAX_INVALID_SHARE * len(text):
            raise CLIError(f"{flag} {path!r} looks binary ({invalid:,} of its {len(text):,} characters are not "
                           f"UTF-8): give a UTF-8 text file, one item per line") from None
        warn(command, f"{flag} {path} is not valid UTF-8: invalid bytes replaced with U+FFFD")
    lines = [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]
    for number, line in enumerate(lines, start=1):
        if len(line) > MAX_LINE_CHARS:
            raise CLIError(f"{flag} {path!r}: line {number:,} is {len(line):,} characters long, more than the "
                           f"{MAX_LINE_CHARS:,} characters a line may have")
    lines = [line for line in lines if line]
    if not lines:
        raise CLIError(f"{flag}: {path} holds no non-empty line")
    return lines


def read_bounded_lines(path: str, flag: str, command: str, *, limit: int, limit_flag: str,
                       nouns: tuple[str, str], line_bytes: int = LINE_BYTES) -> list[str]:
    """:func:`read_lines` of a file that may hold at most ``limit`` lines: a file larger than ``limit x
    line_bytes`` bytes is refused by its size before it is read, then one of more than ``limit`` lines by
    their count; each refusal is one line naming the file, its size or count, and ``limit_flag``'s limit.
    ``nouns``: what a line is, singular and plural ("canary", "canaries")."""
    file = Path(path).expanduser()
    budget = limit * line_bytes
    if file.is_file() and file.stat().st_size > budget:
        raise CLIError(f"{flag} {path!r} is {file.stat().st_size:,} bytes, more than the limit of {budget:,} bytes "
                       f"({line_bytes:,} a {nouns[0]} for {limit_flag} {limit:,}); raise {limit_flag} or split the file")
    lines = read_lines(path, flag, command)
    if len(lines) > limit:
        raise CLIError(f"{flag} {path!r} holds {len(lines):,} {nouns[1]}, more than {limit_flag} {limit:,}; raise "
                       f"it or split the file")
    return lines


def listing_forwards(args: argparse.Namespace) -> int:
    """The forward budget of a listing: ``--max-forwards``, else :data:`DEFAULT_LISTING_FORWARDS`."""
    return getattr(args, "max_forwards", None) or DEFAULT_LISTING_FORWARDS


def over_forward_limit(what: str, exc: ForwardBudgetError, remedy: str) -> CLIError:
    """The one line of a listing stopped by its forward budget (``what``: the listing; ``remedy``: how to
    ask for less)."""
    return CLIError(f"{what} needs more than {exc.limit:,} forwarded prefixes (the limit, --max-forwards "
                    f"{exc.limit:,}; ~0.1 s each on a small CPU model): its members lie deep in the model's tail; "
                    f"raise --max-forwards, {remedy}")


def eos_id(target: Any) -> int:
    """The target's eos id for ``--eos``; CLIError when it has none."""
    eos = getattr(target, "eos_token_id", None)
    if eos is None:
        raise CLIError("--eos: the target has no eos token")
    return int(eos)


def _bar() -> Callable[[Any], None] | None:
    # A bar on stderr while the index is built, only on a terminal (it would litter logs and pipes).
    return index_bar(leave=False) if sys.stderr.isatty() else None


def _finite(value: float) -> float | None:
    """JSON has no infinities: None stands for one."""
    return float(value) if math.isfinite(value) else None


def _print_json(data: dict) -> None:
    print(json.dumps(data, allow_nan=False))


# ---------------------------------------------------------------------------------- enumerate --regex
def enumerate_format(args: argparse.Namespace, target: Any, prompt: list[int], eos: int | None, regex: Any) -> int:
    """The top-K members of the format, exact, and a footer with its size and mass bracket."""

    started = time.perf_counter()
    index = AutoregressiveEnumerable(target, prompt=prompt, constraint=regex, eos=eos, max_len=args.max_len,
                                     strings=args.strings, max_nodes=args.max_nodes, progress=_bar(),
                                     max_forwards=listing_forwards(args))
    try:
        items = index.top_k(args.top_k)
    except ForwardBudgetError as exc:
        raise over_forward_limit(f"the top {args.top_k:,} of --regex {args.regex!r}", exc,
                                 "narrow the format or cap --max-len") from None
    seek = index.seek_index()
    seek.max_forwards = None      # the limit is the listing's: the footer below has a cap of its own
    # The footer's bracket may deepen the index: capped near what the listing spent, so it never dominates.
    try:
        mass = list(index.mass(max_forwards=2 * seek.forwards + 1000))
    except IndexBudgetError:      # the listing stands; only the bracket would need more than --max-nodes
        mass = None
    size = index.size()
    try:
        sequences = seek.support.size(seek.vocab_size)
        sequences = math.inf if sequences is None else sequences
    except AutomatonBudgetError:  # counting would build more of the token automaton than its budget allows
        sequences = None
    seconds = time.perf_counter() - started
    automaton = seek.support.constraint
    rows = []
    for rank, (item, log_prob) in enumerate(items):
        row = {"rank": rank, "text": item if args.strings else automaton.text(item).decode("utf-8", "replace")}
        if not args.strings:
            row["tokens"] = [int(t) for t in item]
        rows.append({**row, "log_prob": float(log_prob), "probability": math.exp(log_prob)})
    if args.json:
        data = {"prompt": args.prompt, "regex": args.regex, "strings": args.strings, "size": count_json(size),
                "size_bits": count_bits(size), "mass": mass, "items": rows, "seconds": seconds,
                "forwards": seek.forwards}
        if not args.strings:
            data["token_sequences"] = None if sequences is None else count_json(sequences)
            data["token_sequences_counted"] = sequences is not None
        _print_json(data)
        return 0
    print(f"{'rank':>4}  {'log-prob':>10}  {'probability':>11}  text" + ("" if args.strings else "  tokens"))
    for row in rows:
        tokens = "" if args.strings else f"  {row['tokens']}"
        print(f"{row['rank']:>4}  {row['log_prob']:>10.4f}  {row['probability']:>11.4e}  {row['text']!r}{tokens}")
    spelled = "" if args.strings else (" (token sequences: too many to count)" if sequences is None
                                       else f" ({count_text(sequences)} token sequences)")
    bracket = ("not bracketed within --max-nodes" if mass is None
               else f">= {mass[0]:.6g}, <= {mass[1]:.6g}")
    print(f"format: {count_text(size)} strings{spelled}; mass of the format {bracket}")
    print(f"forwards {seek.forwards:,}, {seconds:.2f} s")
    return 0


# --------------------------------------------------------------------------- enumerate --choices-file
def enumerate_choices(args: argparse.Namespace, target: Any, prompt: list[int], eos: int | None,
                      choices: Any) -> int:
    """Every choice (or the top ``--top-k``) by rank: exact log-prob and probability normalised over the set."""

    started = time.perf_counter()
    # Every tokenization is scored through an index, not the label trie: the bar follows the trie only.
    if args.all_tokenizations:
        scores = score_choices(target, choices, prompt=prompt, eos=eos, all_tokenizations=True)
    else:
        bar = choices_bar(leave=False) if sys.stderr.isatty() else None
        scores = score_choices(target, choices, prompt=prompt, eos=eos, progress=bar)
    seconds = time.perf_counter() - started
    data = scores.as_dict()
    shown = args.top_k if args.top_k is not None else len(choices.strings)
    data["choices"] = [row for row in data["choices"] if row["rank"] < shown]
    if args.json:
        _print_json({**data, "seconds": seconds})
        return 0
    print(f"{'rank':>4}  {'log-prob':>10}  {'probability':>11}  text")
    for row in sorted(data["choices"], key=lambda row: row["rank"]):
        log_prob = "-inf" if row["log_prob"] is None else f"{row['log_prob']:.4f}"
        probability = "-" if row["probability"] is None else f"{row['probability']:.4e}"
        print(f"{row['rank']:>4}  {log_prob:>10}  {probability:>11}  {row['choice']!r}")
    print(f"mass of the set: {math.exp(scores.log_mass):.6g} (the {len(choices.strings)} choices' total "
          f"probability); forwards {scores.forwards:,}, {seconds:.2f} s")
    return 0


# ---------------------------------------------------------------------------------------- rank --regex
def rank_format(args: argparse.Namespace, target: Any, prompt: list[int], texts: list[str], regex: Any,
                encode: Callable[[str], list[int]]) -> int:
    """Rank and exposure of each text among the members of the format, on one shared index."""

    eos = eos_id(target) if args.eos else None
    if args.strings:
        items: list[Any] = list(texts)
    else:
        items = []
        for text in texts:
            tokens = encode(text)
            if not tokens:
                raise CLIError(f"{text!r} encodes to no tokens")
            items.append(tokens + ([] if eos is None else [eos]))
    started = time.perf_counter()
    index = AutoregressiveEnumerable(target, prompt=prompt, constraint=regex, eos=eos, max_len=args.max_len,
                                     strings=args.strings, progress=_bar())
    if not args.strings:          # checked here so that the message names the canary's text
        support = index.seek_index().support
        for text, tokens in zip(texts, items):
            support.check(tokens, target.vocab_size, name=f"{text!r} (tokens {tokens})")
    max_forwards = DEFAULT_MAX_FORWARDS if args.max_forwards is None else args.max_forwards
    reports = estimate_ranks(target, items, constraint=regex, prompt=prompt, strings=args.strings,
                             max_forwards=max_forwards, index=index)
    seconds = time.perf_counter() - started
    forwards = index.seek_index().forwards
    space = reports[0].space_size
    rows = []
    for text, report in zip(texts, reports):
        low, high = report.exposure_bracket
        row = {"text": text, "rank": report.rank, "rank_bracket": [report.rank_lo, report.rank_hi],
               "method": report.method, "log_prob": report.log_prob, "length": report.length,
               "exposure_bits": _finite(report.exposure_bits), "exposure_bracket": [_finite(low), _finite(high)]}
        if not args.strings:
            row["tokens"] = list(report.item)
        rows.append(row)
    if args.json:
        _print_json({"prompt": args.prompt, "regex": args.regex, "strings": args.strings,
                     "space_size": count_json(space), "space_bits": count_bits(space), "items": rows,
                     "seconds": seconds, "forwards": forwards})
        return 0
    unit = "strings" if args.strings else "token sequences"
    bits = "" if count_bits(space) is None else f" = 2^{count_bits(space):,.2f}"
    print(f"space: {count_text(space)} {unit} of regex {args.regex!r}{bits}; forwards {forwards:,}, {seconds:.2f} s")
    for row in rows:
        lo, hi = row["rank_bracket"]
        rank = f"{row['rank']:,}" if row["method"] == "exact" else f"~{row['rank']:,} in [{lo:,}, {hi:,}]"
        if row["exposure_bits"] is None:
            exposure = "exposure n/a (infinite space)"
        else:
            exposure = f"exposure {row['exposure_bits']:.2f} bits"
            if row["method"] != "exact":
                exposure += f" in [{row['exposure_bracket'][0]:.2f}, {row['exposure_bracket'][1]:.2f}]"
        print(f"{row['text']!r}: rank {rank} ({row['method']}), log-prob {row['log_prob']:.4f} nats, {exposure}")
    return 0
