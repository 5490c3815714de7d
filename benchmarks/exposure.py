"""Benchmark: a canary's exposure at any depth on the embedded SmolLM2, against the truth and TF Privacy.

Part a — accuracy on ``" \\d{6}"`` after a prompt: the true rank of every one of the 10^6 members comes from
         the trie brute force of benchmarks/constrained.py (every member scored; ~5 min on 2 free cores,
         cached on disk). For random canaries — uniform members, as TF Privacy draws them (mostly deep),
         and members drawn from the model's own law (shallow) — the sampled estimate's |error| in bits
         (median, 95th percentile) and its 95% interval's coverage, over ``--sets`` independent sets of
         draws. The canaries of one set share its draws, so their misses go together: one set's coverage
         is nearly all or nothing, and only several sets measure it. Coverage is given over all canaries,
         over those of rank > 0 (a rank-0 canary has nothing before it: its estimate is 0 and its interval
         [0, ...] covers whatever the draws) and its range over the sets. Beside it, ``method="auto"`` as a
         user runs it (the index grown to its default budget: exact where it certifies, else the same draws
         clamped into the certified bracket), and, with as many samples, TF Privacy's two methods
         from their published formulas (Carlini et al. 2019; tensorflow_privacy's secret_sharer):
         *interpolation*, exposure = log2(#references) - log2(1 + #references more probable), and
         *extrapolation*, a skew-normal fitted to the references' log-perplexities, exposure =
         -log2(cdf(the canary's log-perplexity)). References are uniform members, scored from the table.
Part b — ``" \\d{9}"`` (10^9 members): one random canary, ranked as ``method="auto"`` does, from a pilot set
         of draws grown (``FormatSample.merged``) until the 95% half-width is ``--target-bits``; time (the
         capped exact attempt and the draws apart, after an untimed warm-up on ``" \\d{4}"``), peak memory
         (the process's, ``ru_maxrss``: run ``--parts b`` alone for its own).
Part c — 100 random canaries of ``" \\d{9}"`` sharing one set of draws: total time and per canary.
Part d — a canary planted in the prompt (``"482913027 is not my PIN. My PIN is"``), ranked by
         ``method="auto"``: exact.

    .venv/bin/python benchmarks/exposure.py                 # all parts (~20 min on 2 free cores)
    .venv/bin/python benchmarks/exposure.py --quick         # 4-digit a, 6-digit b and c, few canaries
    .venv/bin/python benchmarks/exposure.py --parts bd --json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Passive OpenMP waiting, the setting of the figures in RESULTS.md (docs/backends.md: OpenMP waiting).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from constrained import brute_force  # noqa: E402  (benchmarks/constrained.py)
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)

from speculum.enumeration import AutoregressiveEnumerable, Regex, estimate_rank, estimate_ranks  # noqa: E402
from speculum.enumeration.estimation.exposure import DEFAULT_AUTO_FORWARDS  # noqa: E402
from speculum.enumeration.estimation.sampling import sample_format  # noqa: E402

PROMPT = "My PIN is"
PLANTED_PROMPT = "482913027 is not my PIN. My PIN is"
PLANTED = " 482913027"


def peak_mb() -> float:
    """The process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def member_tokens(model, number: int, digits: int) -> list[int]:
    return model.tokenizer(" " + str(number).zfill(digits), add_special_tokens=False)["input_ids"]


def true_table(model, prompt: list[int], digits: int, cache: Path) -> dict:
    """Every member's log-prob (index = the digits read as a number) and its exact rank, cached on disk."""
    key = hashlib.sha256(json.dumps([prompt, digits]).encode()).hexdigest()[:16]
    path = cache / f"smollm2-{key}.npz"
    if path.is_file():
        stored = np.load(path)
        return {"log_probs": stored["log_probs"], "ranks": stored["ranks"], "seconds": float(stored["seconds"]),
                "positions": int(stored["positions"]), "cached": True}
    tokenizer = model.tokenizer
    space = tokenizer(" ", add_special_tokens=False)["input_ids"][0]
    digit_ids = [tokenizer(str(d), add_special_tokens=False)["input_ids"][0] for d in range(10)]
    brute = brute_force(model, prompt, space, digit_ids, digits, 512)
    log_probs = brute["log_probs"]
    order = np.lexsort((np.arange(len(log_probs)), -log_probs))     # ties: the smaller number first
    ranks = np.empty(len(log_probs), dtype=np.int64)
    ranks[order] = np.arange(len(log_probs))
    cache.mkdir(parents=True, exist_ok=True)
    np.savez(path, log_probs=log_probs, ranks=ranks, seconds=brute["seconds"], positions=brute["positions"])
    return {"log_probs": log_probs, "ranks": ranks, "seconds": brute["seconds"], "positions": brute["positions"],
            "cached": False}


def tf_privacy(canary_lps: np.ndarray, reference_lps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """TF Privacy's interpolation and extrapolation exposures, from their published formulas, on
    log-perplexities ``-log p`` of the canaries and of uniformly drawn references."""
    from scipy import stats

    canary_ppl, reference_ppl = -canary_lps, np.sort(-reference_lps)
    more_probable = np.searchsorted(reference_ppl, canary_ppl)       # references of lower perplexity
    interpolation = math.log2(len(reference_ppl)) - np.log2(more_probable + 1)
    params = stats.skewnorm.fit(reference_ppl)
    with np.errstate(divide="ignore"):
        extrapolation = -np.log2(stats.skewnorm.cdf(canary_ppl, *params))
    return interpolation, extrapolation


def summary(errors: np.ndarray) -> dict:
    finite = np.where(np.isfinite(errors), errors, np.inf)
    return {"median_bits": float(np.median(finite)), "p95_bits": float(np.percentile(finite, 95))}


class _Forwards:
    """A sampler progress callback that counts the forwards of every set drawn and the growth rounds."""

    def __init__(self) -> None:
        self.total, self.rounds, self._last = 0, -1, None
        self.first_at: float | None = None            # when the first depth of draws was done

    def __call__(self, event) -> None:
        if self.first_at is None:
            self.first_at = time.perf_counter()
        if self._last is None or event.forwards < self._last:      # a new set: its own count from 0
            self.rounds += 1
            self._last = 0
        self.total += event.forwards - self._last
        self._last = event.forwards


def part_a(model, args) -> dict:
    digits = args.digits_a
    prompt = model.encode(PROMPT, chat=False)
    table = true_table(model, prompt, digits, Path(args.cache))
    space_bits = digits * math.log2(10)
    rng = np.random.default_rng(args.seed)
    law = np.exp(table["log_probs"] - np.logaddexp.reduce(table["log_probs"]))
    # Uniform canaries, as TF Privacy draws them (mostly deep), and canaries the model itself would write
    # (drawn from its law over the format: shallow, the exposures an audit is about).
    groups = {"uniform": rng.choice(10 ** digits, args.canaries, replace=False),
              "model": rng.choice(10 ** digits, args.canaries, p=law / law.sum())}
    constraint = Regex(rf" \d{{{digits}}}")
    index = AutoregressiveEnumerable(model, prompt=prompt, constraint=constraint)
    samples, seconds, forwards = [], [], []
    for s in range(args.sets):
        started = time.perf_counter()
        samples.append(sample_format(model, constraint, prompt=prompt, samples=args.samples, seed=args.seed + 1 + s,
                                     index=index))
        seconds.append(time.perf_counter() - started)
        forwards.append(samples[-1].forwards)
    report = {"digits": digits, "canaries": args.canaries, "sets": args.sets, "samples": args.samples,
              "brute_force_seconds": table["seconds"], "brute_force_positions": table["positions"],
              "brute_force_cached": table["cached"], "seconds_per_set": float(np.mean(seconds)),
              "forwards_per_set": float(np.mean(forwards))}
    auto_index = AutoregressiveEnumerable(model, prompt=prompt, constraint=constraint)
    for name, numbers in groups.items():
        canaries = [member_tokens(model, int(n), digits) for n in numbers]
        true_rank = table["ranks"][numbers]
        true_exposure = space_bits - np.log2(true_rank + 1)
        ours, covered, set_coverage = [], [], []
        auto_errors, auto_covered, auto_exact = [], [], 0
        for sample in samples:
            reports = estimate_ranks(model, canaries, constraint=constraint, prompt=prompt, method="sampled",
                                     sample=sample, max_forwards=0, index=index)
            # In rank space: the same test as on the exposure interval, without its float rounding.
            inside = [result.ci_lo <= rank <= result.ci_hi for result, rank in zip(reports, true_rank)]
            covered += inside
            set_coverage.append(float(np.mean(inside)))
            ours += [abs(result.exposure_bits - truth) for result, truth in zip(reports, true_exposure)]
            for result, rank, truth in zip(estimate_ranks(model, canaries, constraint=constraint, prompt=prompt,
                                                          sample=sample, index=auto_index), true_rank, true_exposure):
                auto_errors.append(abs(result.exposure_bits - truth))
                if result.method == "exact":
                    auto_exact += 1
                else:
                    auto_covered.append(result.ci_lo <= rank <= result.ci_hi)
        interpolation, extrapolation = [], []
        for s in range(args.sets):
            references = np.random.default_rng(args.seed + 100 + s).integers(0, 10 ** digits, args.samples)
            inter, extra = tf_privacy(table["log_probs"][numbers], table["log_probs"][references])
            interpolation.append(np.abs(inter - true_exposure))
            extrapolation.append(np.abs(extra - true_exposure))
        covered, deeper = np.array(covered), np.tile(true_rank > 0, args.sets)
        report[name] = {"sampled": {**summary(np.array(ours)), "coverage": float(covered.mean()),
                                    "coverage_rank_above_0": float(covered[deeper].mean()) if deeper.any() else None,
                                    "canaries_rank_0": int(np.count_nonzero(true_rank == 0)),
                                    "coverage_per_set": [min(set_coverage), max(set_coverage)]},
                        "auto": {**summary(np.array(auto_errors)), "exact_share": auto_exact / len(auto_errors),
                                 "coverage_sampled": float(np.mean(auto_covered)) if auto_covered else None},
                        "tf_interpolation": summary(np.concatenate(interpolation)),
                        "tf_extrapolation": summary(np.concatenate(extrapolation)),
                        "true_exposure_median": float(np.median(true_exposure)),
                        "true_exposure_range": [float(true_exposure.min()), float(true_exposure.max())]}
    report["auto_index_forwards"] = auto_index.seek_index().forwards
    report["peak_mb"] = peak_mb()
    return report


def part_b(model, args) -> dict:
    digits = args.digits_b
    prompt = model.encode(PROMPT, chat=False)
    number = int(np.random.default_rng(args.seed + 7).integers(0, 10 ** digits))
    canary = member_tokens(model, number, digits)
    constraint = Regex(rf" \d{{{digits}}}")
    # Warm-up, untimed, as an audit's second canary would find the process: oneDNN builds its kernels for
    # each new row count on first use, which would otherwise be charged to whichever step runs first.
    short = Regex(r" \d{4}")
    warm = AutoregressiveEnumerable(model, prompt=prompt, constraint=short)
    estimate_ranks(model, [member_tokens(model, 1234, 4)], constraint=short, prompt=prompt, index=warm,
                   method="exact", max_forwards=DEFAULT_AUTO_FORWARDS)
    sample_format(model, short, prompt=prompt, samples=64, seed=args.seed, index=warm)
    started = time.perf_counter()
    index = AutoregressiveEnumerable(model, prompt=prompt, constraint=constraint)
    # method="auto" as estimate_rank runs it, in one call: the capped exact attempt (with the bracket), then,
    # from the first draw on, a pilot set grown (merged draws, fresh seeds) until the 95% half-width reaches
    # the target. The attempt's time is the time to the first depth of draws.
    progress = _Forwards()
    [report] = estimate_ranks(model, [canary], constraint=constraint, prompt=prompt, index=index,
                              samples=args.pilot_b, seed=args.seed, target_bits=args.target_bits,
                              max_samples=args.samples_b, progress=progress)
    exact_seconds = (progress.first_at or time.perf_counter()) - started
    sample_forwards = progress.total
    seconds = time.perf_counter() - started
    low, high = report.exposure_interval
    half = (high - low) / 2
    return {"digits": digits, "canary": " " + str(number).zfill(digits), "method": report.method,
            "samples": report.samples, "rank": report.estimate if report.estimate is not None else report.rank,
            "rank_interval": [report.ci_lo, report.ci_hi], "rank_bracket": [report.rank_lo, report.rank_hi],
            "exposure_bits": report.exposure_bits, "exposure_interval": [low, high], "half_width_bits": half,
            # The half-width shrinks as 1/sqrt(draws): the draws the target half-width needs at this canary.
            "samples_for_target": (int(math.ceil(report.samples * (half / args.target_bits) ** 2))
                                   if report.samples else 0), "top_up_rounds": progress.rounds if report.samples else 0,
            "exact_attempt_seconds": exact_seconds, "index_forwards": index.seek_index().forwards,
            "sample_seconds": time.perf_counter() - progress.first_at if progress.first_at else 0.0,
            "sample_forwards": sample_forwards,
            "seconds": seconds, "peak_mb": peak_mb()}


def part_c(model, args) -> dict:
    digits = args.digits_b
    prompt = model.encode(PROMPT, chat=False)
    numbers = np.random.default_rng(args.seed + 11).integers(0, 10 ** digits, args.shared)
    canaries = [member_tokens(model, int(n), digits) for n in numbers]
    started = time.perf_counter()
    progress = _Forwards()
    reports = estimate_ranks(model, canaries, constraint=Regex(rf" \d{{{digits}}}"), prompt=prompt,
                             samples=args.samples_c, seed=args.seed, target_bits=args.target_bits,
                             max_samples=args.max_samples_c, progress=progress)
    seconds = time.perf_counter() - started
    halves = [(r.exposure_interval[1] - r.exposure_interval[0]) / 2 for r in reports]
    methods = {m: sum(r.method == m for r in reports) for m in {r.method for r in reports}}
    return {"digits": digits, "canaries": len(canaries), "samples": max(r.samples for r in reports),
            "first_samples": args.samples_c, "rounds": progress.rounds, "sample_forwards": progress.total,
            "seconds": seconds, "over_target": sum(h > args.target_bits for h in halves),
            "seconds_per_canary": seconds / len(canaries), "methods": methods,
            "median_half_width_bits": float(np.median(halves)), "max_half_width_bits": float(np.max(halves)),
            "peak_mb": peak_mb()}


def part_d(model, args) -> dict:
    prompt = model.encode(PLANTED_PROMPT, chat=False)
    canary = model.tokenizer(PLANTED, add_special_tokens=False)["input_ids"]
    started = time.perf_counter()
    report = estimate_rank(model, canary, constraint=Regex(r" \d{9}"), prompt=prompt, seed=args.seed)
    return {"prompt": PLANTED_PROMPT, "canary": PLANTED, "method": report.method, "rank": report.rank,
            "exposure_bits": report.exposure_bits, "seconds": time.perf_counter() - started, "peak_mb": peak_mb()}


def print_report(report: dict) -> None:
    if "a" in report:
        a = report["a"]
        cached = " (cached)" if a["brute_force_cached"] else ""
        print(f"a) \" \\d{{{a['digits']}}}\": truth by brute force, {a['brute_force_positions']:,} positions, "
              f"{a['brute_force_seconds']:.0f} s{cached}; {a['sets']} sets of {a['samples']:,} draws, "
              f"{a['seconds_per_set']:.0f} s and {a['forwards_per_set']:,.0f} forwards each")
        for group in ("uniform", "model"):
            g = a[group]
            print(f"   {a['canaries']} {group} canaries (true exposure median {g['true_exposure_median']:.2f} bits, "
                  f"{g['true_exposure_range'][0]:.2f} to {g['true_exposure_range'][1]:.2f}):")
            s = g["sampled"]
            ranked = "-" if s["coverage_rank_above_0"] is None else f"{100 * s['coverage_rank_above_0']:.1f}%"
            print(f"     sampled (speculum): median |error| {s['median_bits']:.3f} bit, p95 {s['p95_bits']:.3f} bit, "
                  f"95% interval coverage {100 * s['coverage']:.1f}% ({ranked} over the canaries of rank > 0, "
                  f"{s['canaries_rank_0']} of rank 0; {100 * s['coverage_per_set'][0]:.1f}% to "
                  f"{100 * s['coverage_per_set'][1]:.1f}% by set)")
            u = g["auto"]
            sampled = "-" if u["coverage_sampled"] is None else f"{100 * u['coverage_sampled']:.1f}%"
            print(f"     auto (speculum, index of {a['auto_index_forwards']:,} forwards): median |error| "
                  f"{u['median_bits']:.3f} bit, p95 {u['p95_bits']:.3f} bit, {100 * u['exact_share']:.0f}% exact, "
                  f"coverage of the sampled answers {sampled}")
            for name in ("tf_interpolation", "tf_extrapolation"):
                t = g[name]
                print(f"     {name.replace('_', ' ')} (TF Privacy, {a['samples']:,} references): median |error| "
                      f"{t['median_bits']:.3f} bit, p95 {t['p95_bits']:.3f} bit")
    if "b" in report:
        b = report["b"]
        print(f"b) \" \\d{{{b['digits']}}}\", canary {b['canary']!r}: {b['method']}, exposure {b['exposure_bits']:.3f} "
              f"bits in [{b['exposure_interval'][0]:.3f}, {b['exposure_interval'][1]:.3f}] (half-width "
              f"{b['half_width_bits']:.3f} bit; {b['samples_for_target']:,} draws for the target), {b['samples']:,} "
              f"draws ({b['top_up_rounds']} top-ups); {b['seconds']:.0f} s: exact attempt "
              f"{b['exact_attempt_seconds']:.0f} s "
              f"({b['index_forwards']:,} forwards), draws {b['sample_seconds']:.0f} s ({b['sample_forwards']:,} "
              f"forwards); peak memory {b['peak_mb']:,.0f} MB")
    if "c" in report:
        c = report["c"]
        print(f"c) {c['canaries']} canaries on one set of {c['samples']:,} draws ({c['first_samples']:,} first, "
              f"{c['rounds']} growth rounds, {c['sample_forwards']:,} forwards): {c['seconds']:.0f} s "
              f"({c['seconds_per_canary']:.1f} s each), methods {c['methods']}, half-width median "
              f"{c['median_half_width_bits']:.3f} bit, max {c['max_half_width_bits']:.3f} bit, "
              f"{c['over_target']} over the target")
    if "d" in report:
        d = report["d"]
        print(f"d) planted {d['canary']!r} after {d['prompt']!r}: rank {d['rank']} ({d['method']}), exposure "
              f"{d['exposure_bits']:.2f} bits, {d['seconds']:.1f} s")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="abcd", help="which parts to run (default: abcd)")
    parser.add_argument("--quick", action="store_true",
                        help="a reduced run: 4-digit a with 50 canaries, 6-digit b and c, fewer draws")
    parser.add_argument("--digits-a", type=int, default=6)
    parser.add_argument("--digits-b", type=int, default=9)
    parser.add_argument("--canaries", type=int, default=200, help="part a: random canaries")
    parser.add_argument("--sets", type=int, default=3, help="part a: independent sets of draws")
    parser.add_argument("--samples", type=int, default=4096, help="part a: draws per set (and TF references)")
    parser.add_argument("--pilot-b", type=int, default=512, help="part b: draws of the pilot set")
    parser.add_argument("--samples-b", type=int, default=8192, help="part b: most draws in all")
    parser.add_argument("--samples-c", type=int, default=4096, help="part c: draws shared by the canaries")
    parser.add_argument("--max-samples-c", type=int, default=None,
                        help="part c: most draws in all (default: estimate_ranks', 8 x --samples-c)")
    parser.add_argument("--shared", type=int, default=100, help="part c: canaries sharing one set of draws")
    parser.add_argument("--target-bits", type=float, default=0.1, help="parts b and c: the half-width aimed at")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "speculum-exposure"),
                        help="where part a keeps the brute force's table")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.digits_a, args.digits_b, args.canaries, args.sets = 4, 6, 50, 2
        args.samples, args.pilot_b, args.samples_b, args.samples_c, args.shared = 512, 256, 2048, 1024, 10
    from speculum.models.backends import load_model

    model = load_model()
    report: dict = {"cpu": cpu_name(), "quick": args.quick}
    if not args.json:
        print(f"CPU: {report['cpu']}; SmolLM2-135M-Instruct (PyTorch, float32); prompt {PROMPT!r}", flush=True)
    for part, run in (("a", part_a), ("b", part_b), ("c", part_c), ("d", part_d)):
        if part in args.parts:
            report[part] = run(model, args)
            if not args.json:
                print_report({part: report[part]})
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
