"""``speculum audit``: the exposure of every canary of a file within a format, from one shared set of draws.

A privacy audit (Carlini et al. 2019, "The Secret Sharer") asks how far each canary stands out among all
the strings of its format: exposure ``log2 |format| - log2(rank + 1)`` bits. The ranks come from
:func:`speculum.enumeration.estimate_ranks`: exact when the exact index certifies the canary within a small
forward budget, else importance-sampled with a 95% interval, always beside a certified bracket. The draws
are made once and shared by every canary (each further canary costs the scoring of its tokens). Flag
checks and formatting only: the work is in :mod:`speculum.enumeration`.

Example (on the embedded SmolLM2):
    speculum audit canaries.txt --template "My PIN is {canary}" --regex "\\d{9}" --raw
    speculum audit canaries.txt --prompt "My PIN is" --regex " \\d{6}" --raw --json --plot exposure.png
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

from tqdm.auto import tqdm

import speculum.cli.enumerate as enumerate_cli
from speculum.cli.checks import CLIError, check_at_least, utf8_text, warn
from speculum.cli.constrained import (DEFAULT_MAX_CANARIES, DEFAULT_MAX_CHOICES, LINE_BYTES, eos_id,
                                      read_bounded_lines, read_choices)
from speculum.cli.counts import count_json, count_text
from speculum.cli.generate import add_cache_argument, add_dtype_argument
from speculum.cli.progress import index_bar
from speculum.enumeration import AutoregressiveEnumerable, Regex, StringIndex, estimate_ranks
from speculum.enumeration.estimation.exposure import DEFAULT_AUTO_FORWARDS, DEFAULT_MAX_FORWARDS, METHODS
from speculum.enumeration.estimation.sampling import DEFAULT_SAMPLES
from speculum.validation import InputError

__all__ = ["register", "run_audit", "split_template", "sample_bar"]

PLACEHOLDER = "{canary}"
DEFAULT_TARGET = "smollm2-135m"
# The canaries file's bytes per canary allowed: a canary is a short secret, so a larger file is refused by its
# size before it is read (DEFAULT_MAX_CANARIES: the most canaries one audit reads).
CANARY_BYTES = LINE_BYTES


def register(subparsers: Any) -> None:
    audit = subparsers.add_parser(
        "audit", help="exposure of every canary of a file within a format, with 95%% intervals",
        description="Rank every canary of CANARIES (one per line) among the members of a format after a prompt, "
                    "and report its exposure log2|format| - log2(rank+1) (Carlini et al., 'The Secret Sharer'): "
                    "exact when cheap, else importance-sampled from one shared set of draws with a 95% "
                    "interval, beside a certified bracket.")
    audit.add_argument("canaries",
                       help="file of canaries, one per line (leading spaces count, empty lines are skipped)")
    which = audit.add_mutually_exclusive_group(required=True)
    which.add_argument("--regex", metavar="PATTERN",
                       help="the format: strings matching PATTERN in full (Python re syntax without anchors, "
                            "lookarounds or back-references)")
    which.add_argument("--choices-file", metavar="FILE", help="the format: the lines of FILE (a label set)")
    where = audit.add_mutually_exclusive_group()
    where.add_argument("--template", metavar="TEXT",
                       help="a prompt holding the canary, e.g. 'My PIN is {canary}': the text before {canary} is "
                            "the prompt, the canary its continuation")
    where.add_argument("--prompt", metavar="TEXT", help="the prompt; each canary is its continuation (default: empty)")
    audit.add_argument("--strings", action="store_true",
                       help="rank strings, each scored over all its tokenizations (default: the canary's own tokens "
                            "among token sequences)")
    audit.add_argument("--eos", action="store_true",
                       help="members end in the model's eos (needed when a member is a prefix of another)")
    audit.add_argument("--max-len", type=int, default=None, help="most tokens of a member")
    audit.add_argument("--method", choices=METHODS, default="auto",
                       help="auto: exact when cheap, else sampled; exact: exact or a certified bracket; sampled: "
                            "always the sampled estimate (default: auto)")
    audit.add_argument("--samples", type=int, default=None,
                       help=f"draws from the format, shared by every canary (default: {DEFAULT_SAMPLES:,})")
    audit.add_argument("--target-bits", type=float, default=None,
                       help="draw more (same strata, merged) until every sampled exposure's 95%% interval is at most "
                            "this many bits on each side, or --max-samples is reached (default: one set)")
    audit.add_argument("--max-samples", type=int, default=None,
                       help="most draws in all with --target-bits (default: 8 x --samples)")
    audit.add_argument("--max-forwards", type=int, default=None,
                       help=f"most prefixes the exact index forwards before sampling or bracketing (default: "
                            f"{DEFAULT_AUTO_FORWARDS:,}; {DEFAULT_MAX_FORWARDS:,} with --method exact)")
    audit.add_argument("--max-canaries", type=int, default=DEFAULT_MAX_CANARIES, metavar="N",
                       help=f"most canaries the file may hold; it may be at most N x {CANARY_BYTES:,} bytes "
                            f"(default: {DEFAULT_MAX_CANARIES:,})")
    audit.add_argument("--max-choices", type=int, default=DEFAULT_MAX_CHOICES, metavar="N",
                       help=f"with --choices-file: most choices the file may hold; it may be at most N x "
                            f"{LINE_BYTES:,} bytes (default: {DEFAULT_MAX_CHOICES:,})")
    audit.add_argument("--plot", metavar="FILE",
                       help="save a histogram of the exposures, with the format's maximum marked (needs "
                            "matplotlib: pip install 'speculum[audit]')")
    audit.add_argument("--target", default=DEFAULT_TARGET,
                       help=f"target model name or path (default: {DEFAULT_TARGET})")
    mode = audit.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap the prompt in the chat template (default when the tokenizer has one)")
    mode.add_argument("--raw", dest="chat", action="store_false", help="use the prompt text as is")
    audit.add_argument("--seed", type=int, default=0, help="seed of the draws (default: 0)")
    audit.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_dtype_argument(audit)
    add_cache_argument(audit)
    audit.set_defaults(handler=run_audit)


# ------------------------------------------------------------------------------------------- checks
def split_template(template: str) -> tuple[str, str]:
    """``(prompt, after)``: the text before and after the one ``{canary}`` of ``template``; CLIError when it
    holds none or several."""
    count = template.count(PLACEHOLDER)
    if count != 1:
        found = "no" if not count else f"{count}"
        raise CLIError(f"--template must hold {PLACEHOLDER} exactly once, where the canary goes; it holds {found}")
    before, _, after = template.partition(PLACEHOLDER)
    return before, after


def _check(args: argparse.Namespace) -> tuple[Any, list[str], str]:
    """Every flag, before a model loads: the format, the canaries, the prompt text."""

    check_at_least(args.samples, 2, "--samples")
    check_at_least(args.max_len, 1, "--max-len")
    check_at_least(args.max_forwards, 0, "--max-forwards")
    check_at_least(args.seed, 0, "--seed")
    check_at_least(args.max_canaries, 1, "--max-canaries")
    check_at_least(args.max_choices, 1, "--max-choices")
    if args.method == "exact" and (args.samples is not None or args.target_bits is not None):
        raise CLIError("--samples and --target-bits go with --method auto or sampled (--method exact never samples)")
    if args.target_bits is not None and not args.target_bits > 0:
        raise CLIError(f"--target-bits must be above 0, got {args.target_bits}")
    if args.max_samples is not None and args.target_bits is None:
        raise CLIError("--max-samples goes with --target-bits")
    if args.max_samples is not None and args.max_samples < (args.samples or DEFAULT_SAMPLES):
        raise CLIError(f"--max-samples must be at least the first set's draws ({args.samples or DEFAULT_SAMPLES})")
    canaries = read_bounded_lines(args.canaries, "canaries file", "audit", limit=args.max_canaries,
                                  limit_flag="--max-canaries", nouns=("canary", "canaries"))
    if args.regex is not None:
        constraint = _regex(utf8_text(args.regex, "--regex", "audit"))
    else:
        constraint = read_choices(args.choices_file, args.max_choices, "audit")
    prompt = ""
    if args.template is not None:
        prompt, after = split_template(utf8_text(args.template, "--template", "audit"))
        if after:
            warn("audit", f"the text after {PLACEHOLDER} in --template is not part of what is ranked")
    elif args.prompt is not None:
        prompt = utf8_text(args.prompt, "--prompt", "audit")
    if args.plot is not None:
        _check_plot(args.plot)
    return constraint, canaries, prompt


def _regex(pattern: str) -> Any:
    """``Regex(pattern)`` with Python's syntax check (what the automaton does not support is named when the
    index compiles it)."""

    try:
        regex = Regex(pattern)
        re.compile(pattern)
    except (InputError, re.error) as exc:
        raise CLIError(f"invalid --regex {pattern!r}: {exc}") from None
    return regex


def _check_plot(path: str) -> None:
    """``--plot FILE`` can be written, in a format matplotlib knows, without writing anything now."""
    file = Path(path).expanduser().resolve()
    folder = file.parent
    if folder.exists() and not folder.is_dir():
        raise CLIError(f"--plot: cannot write {path}: {folder} is a file, not a folder")
    if not folder.is_dir():
        raise CLIError(f"--plot: no such folder: {folder}")
    if file.is_dir():
        raise CLIError(f"--plot: {path} is a folder; give a file name, e.g. {os.path.join(path, 'exposure.png')}")
    # Writable where the histogram goes: the file itself when it exists, else its folder (a new entry).
    probe = file if file.exists() else folder
    if not os.access(probe, os.W_OK) or (not file.exists() and not os.access(folder, os.X_OK)):
        raise CLIError(f"--plot: cannot write {path}: permission denied")
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise CLIError("--plot needs matplotlib: pip install 'speculum[audit]'") from None
    suffix = file.suffix[1:].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise CLIError(f"--plot: cannot write {path}: matplotlib saves no format named {suffix!r} (one of "
                       f"{', '.join(sorted(formats))})")


# --------------------------------------------------------------------------------------------- bars
def sample_bar(**tqdm_kwargs: Any) -> Callable[[Any], None]:
    """A ``progress`` callback drawing a tqdm bar of the prefixes the sampler forwards
    (:class:`speculum.enumeration.estimation.sampling.SampleProgress` events)."""

    bar = tqdm(unit="prefix", desc="sampling the format", **tqdm_kwargs)
    last = [0]

    def update(event: Any) -> None:
        # Each set counts its forwards from 0 (a set grown with --target-bits draws several).
        bar.update(event.forwards - last[0] if event.forwards >= last[0] else event.forwards)
        last[0] = event.forwards
        bar.set_postfix(depth=event.depth, live=event.live, refresh=False)

    return update


def _terminal_bar(make: Callable[..., Callable[[Any], None]]) -> Callable[[Any], None] | None:
    # On stderr and only on a terminal: in a log or a pipe a bar is noise of carriage returns.
    return make(leave=False) if sys.stderr.isatty() else None


# -------------------------------------------------------------------------------------------- audit
def run_audit(args: argparse.Namespace) -> int:
    constraint, canaries, prompt_text = _check(args)
    target = enumerate_cli.load_target(args.target, verify=args.verify_cache, dtype=args.dtype,
                                        command="audit")
    # No prompt text: an empty prompt, which the index replaces by the model's BOS (or refuses, naming it).
    prompt = enumerate_cli.encode_text(target, prompt_text, chat=args.chat, prompt=True) if prompt_text else []
    eos = eos_id(target) if args.eos else None
    started = time.perf_counter()
    index = AutoregressiveEnumerable(target, prompt=prompt, constraint=constraint, eos=eos, max_len=args.max_len,
                                     strings=args.strings, progress=_terminal_bar(index_bar))
    items = _items(args, target, index, canaries, eos)
    # Past the exact budget auto always samples here (the library's auto answers as exact when given a
    # budget and no sample count).
    samples = None if args.method == "exact" else (args.samples or DEFAULT_SAMPLES)
    reports = estimate_ranks(target, items, constraint=constraint, prompt=prompt, strings=args.strings,
                             method=args.method, max_forwards=args.max_forwards, samples=samples,
                             seed=args.seed, index=index, target_bits=args.target_bits,
                             max_samples=args.max_samples, progress=_terminal_bar(sample_bar))
    seconds = time.perf_counter() - started
    space = reports[0].space_size
    space_bits = reports[0].space_bits
    rows = [_row(text, report, args.strings) for text, report in zip(canaries, reports)]
    forwards = index.seek_index().forwards
    draws = max(report.samples for report in reports)
    if args.plot is not None:
        _plot(args.plot, [row["exposure_bits"] for row in rows], space_bits, _describe(args))
    if args.json:
        print(json.dumps({"prompt": prompt_text, "format": _describe(args), "strings": args.strings,
                          "space_size": count_json(space), "space_bits": _finite(space_bits), "samples": draws,
                          "forwards": forwards, "seconds": seconds, "items": rows}, allow_nan=False))
        return 0
    unit = "strings" if args.strings else "token sequences"
    bits = "" if space == math.inf else f" = 2^{space_bits:,.2f}"
    print(f"space: {count_text(space)} {unit} of {_describe(args)}{bits}; draws {draws:,}, index forwards "
          f"{forwards:,}, {seconds:.2f} s")
    print(f"{'rank':>14}  {'95% interval':>27}  {'exposure':>8}  {'95% interval':>15}  {'method':<7}  canary")
    for row in rows:
        print(_line(row))
    return 0


def _items(args: argparse.Namespace, target: Any, index: Any, canaries: list[str], eos: int | None) -> list[Any]:
    """Each canary as the index ranks it, checked to be a member of the format (one error naming it)."""

    if args.strings:
        spelling = StringIndex(index.seek_index())
        for text in canaries:
            if not spelling.tokenizations(text):
                raise CLIError(f"canary {text!r} is not a member of the {index.support.constraint.description} "
                               "(no token sequence of this vocabulary spells it within the format)")
        return list(canaries)
    items = []
    for text in canaries:
        tokens = enumerate_cli.encode_text(target, text, chat=None, prompt=False)
        if not tokens:
            raise CLIError(f"canary {text!r} encodes to no tokens")
        tokens = tokens + ([] if eos is None else [eos])
        try:
            index.support.check(tokens, target.vocab_size, name=f"canary {text!r} (tokens {tokens})")
        except InputError as exc:
            raise CLIError(str(exc)) from None
        items.append(tokens)
    return items


def _row(text: str, report: Any, strings: bool) -> dict:
    interval = report.exposure_interval
    row = {"canary": text, "method": report.method, "rank": report.rank,
           "rank_estimate": report.estimate if report.estimate is not None else report.rank,
           "rank_interval": [report.ci_lo, report.ci_hi], "rank_bracket": [report.rank_lo, report.rank_hi],
           "exposure_bits": _finite(report.exposure_bits),
           "exposure_interval": None if interval is None else [_finite(interval[0]), _finite(interval[1])],
           "log_prob": report.log_prob, "samples": report.samples}
    if not strings:
        row["tokens"] = [int(t) for t in report.item]
    return row


def _line(row: dict) -> str:
    lo, hi = row["rank_interval"]
    estimate = row["rank_estimate"]
    rank = f"{row['rank']:,}" if row["method"] == "exact" else f"~{estimate:,.0f}"
    interval = "-" if row["method"] == "exact" else f"[{lo:,.0f}, {hi:,.0f}]"
    if row["exposure_bits"] is None:
        exposure, bits = "n/a", "-"
    else:
        exposure = f"{row['exposure_bits']:.2f}"
        low, high = row["exposure_interval"]
        bits = "-" if row["method"] == "exact" else f"[{low:.2f}, {high:.2f}]"
    return f"{rank:>14}  {interval:>27}  {exposure:>8}  {bits:>15}  {row['method']:<7}  {row['canary']!r}"


def _plot(path: str, exposures: list[float | None], space_bits: float, title: str) -> None:
    """A histogram of the canaries' exposures, with the format's maximum exposure (``log2 |format|``) marked."""
    import matplotlib     # the audit extra, loaded only for --plot

    matplotlib.use("Agg")               # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    values = [value for value in exposures if value is not None]
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.hist(values, bins=max(10, min(50, len(values) // 2)), color="#4c72b0")
    if math.isfinite(space_bits):
        axes.axvline(space_bits, color="#c44e52", linestyle="--", label=f"format maximum: {space_bits:.2f} bits")
        axes.legend()
    axes.set_xlabel("exposure (bits)")
    axes.set_ylabel("canaries")
    axes.set_title(f"exposure of {len(values)} canaries, {title}")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _describe(args: argparse.Namespace) -> str:
    return f"regex {args.regex!r}" if args.regex is not None else f"the choices of {args.choices_file}"


def _finite(value: float) -> float | None:
    """JSON has no infinities: None stands for one."""
    return float(value) if math.isfinite(value) else None

