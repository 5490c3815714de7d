"""Benchmark: constrained enumeration on the embedded SmolLM2 against the strongest brute force.

Brute force scores every member of the format by teacher forcing with prefixes shared in a trie: every
internal trie node is forwarded once (level by level, in large batches), every member's exact log-prob is
the sum of its steps, and a sort gives the order. For ``" \\d{6}"`` that is 1 + 1 + 10 + ... + 10^5
positions. speculum's constrained index answers the same queries; both run here, in one process, side by
side, and the answers are compared.

Part a — top-10 of ``" \\d{6}"`` after a prompt that holds a secret: target positions and answers.
Part b — exact rank of the planted secret (and of the member brute force ranks ``--deep-rank``): wall time
         against the brute force's.
Part c — 1,000 label choices scored through one prefix trie against one request per choice (each request
         recomputes the prompt, as evaluation harnesses send them): positions and log-probs.
Part d — a wide format, ``".{0,200}"`` followed by eos within ``--wide-max-len`` tokens: the time to compile its
         automaton and to answer the top-k, and how much of the token automaton that built (it is built only
         as far as the query reaches).

    .venv/bin/python benchmarks/constrained.py              # ~30 min on 2 cores (the brute force is most of it)
    .venv/bin/python benchmarks/constrained.py --digits 4   # a quick check
    .venv/bin/python benchmarks/constrained.py --parts c    # the label part alone
    .venv/bin/python benchmarks/constrained.py --parts d --top-k 5   # the wide format alone (~1 min)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Passive OpenMP waiting, the setting of this script's figures in RESULTS.md (docs/backends.md: OpenMP waiting).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from counting import CountingModel  # noqa: E402  (benchmarks/counting.py)
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)

from speculum.enumeration import AutoregressiveEnumerable, Regex, estimate_rank, score_choices  # noqa: E402
from speculum.enumeration.formats.constraint import compile_for  # noqa: E402
from speculum.enumeration.index.strings import max_tokenizations  # noqa: E402

PROMPT = "482913 is not my PIN. My PIN is"
SECRET = " 482913"
ADJECTIVES = ("red green blue black white dark light small large old new hot cold soft hard fast slow loud quiet "
              "bright happy sad rich poor long short deep wide thin thick sweet bitter fresh clean dirty wild calm "
              "strong weak early late tall round flat heavy golden silver pink grey brown tiny").split()
WIDE_PROMPT = "My favourite quote is"
NOUNS = "car house tree river cat dog book road city song bird stone door chair table window garden ship lamp cup".split()


def brute_force(model, prompt: list[int], space: int, digits: list[int], n_digits: int, batch: int) -> dict:
    """Every member ``space + d1..dn`` scored through the trie; returns log-probs in member order
    (member index = the digits read as a number) and the positions forwarded."""
    start = time.perf_counter()
    positions = 0
    head = np.asarray(model.next_logprobs([prompt]), dtype=np.float64)[0]
    positions += 1
    level_lp = np.array([head[space]])                    # (1,) log p(" ")
    level_prefixes = [[space]]
    for depth in range(n_digits):
        rows_lp = np.empty((len(level_prefixes), 10))
        for at in range(0, len(level_prefixes), batch):
            chunk = level_prefixes[at:at + batch]
            rows = np.asarray(model.next_logprobs([prompt + p for p in chunk]), dtype=np.float64)
            rows_lp[at:at + len(chunk)] = rows[:, digits]
        positions += len(level_prefixes)
        level_lp = (level_lp[:, None] + np.minimum(rows_lp, 0.0)).ravel()
        if depth + 1 < n_digits:
            level_prefixes = [p + [d] for p in level_prefixes for d in digits]
    return {"log_probs": level_lp, "positions": positions, "seconds": time.perf_counter() - start}


def member(index: int, n_digits: int) -> str:
    return " " + str(index).zfill(n_digits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--digits", type=int, default=6)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--deep-rank", type=int, default=2000, help="also rank the member brute force puts here")
    parser.add_argument("--labels", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=512, help="brute force: prefixes per batched call")
    parser.add_argument("--wide", default=".{0,200}", help="part d: the wide format (default: .{0,200})")
    parser.add_argument("--wide-max-len", type=int, default=3, help="part d: most tokens of a member, eos included")
    parser.add_argument("--parts", default="abcd", help="which parts to run (default: abcd; a and b share the brute force)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from speculum.models.backends import load_model

    model = load_model()
    tokenizer = model.tokenizer
    prompt = model.encode(PROMPT, chat=False)
    pattern = rf" \d{{{args.digits}}}"
    automaton = compile_for(Regex(pattern), model, eos=None)
    # Brute force over " " + digit tokens is the whole language only if every member has that one spelling.
    assert max_tokenizations(automaton, max_len=None, eos=False) == 1, "members have several tokenizations"
    space = tokenizer(" ", add_special_tokens=False)["input_ids"]
    digits = [tokenizer(str(d), add_special_tokens=False)["input_ids"][0] for d in range(10)]
    assert len(space) == 1
    report = {"cpu": cpu_name(), "prompt": PROMPT, "pattern": pattern}
    if "a" in args.parts or "b" in args.parts:
        report.update(format_parts(model, prompt, automaton, space[0], digits, args))
    if "c" in args.parts:
        report["c"] = label_part(model, args.labels)
    if "d" in args.parts:
        report["d"] = wide_part(model, args.wide, args.wide_max_len, args.top_k)
    if args.json:
        print(json.dumps(report))
        return
    print_report(report, args, pattern)


def format_parts(model, prompt, automaton, space, digits, args) -> dict:
    """Parts a and b: the format's top-k and ranks, against the brute force over the whole format."""
    tokenizer, report = model.tokenizer, {}
    # ---- brute force (shared by parts a and b)
    brute = brute_force(model, prompt, space, digits, args.digits, args.batch)
    order = np.lexsort((np.arange(len(brute["log_probs"])), -brute["log_probs"]))   # ties: smaller string first
    brute_top = [(member(int(i), args.digits), float(brute["log_probs"][i])) for i in order[:args.top_k]]
    report["brute_force"] = {"positions": brute["positions"], "seconds": brute["seconds"]}

    # ---- part a: top-k
    counted = CountingModel(model)
    started = time.perf_counter()
    ar = AutoregressiveEnumerable(counted, prompt=prompt, constraint=automaton)
    top = [(model.decode(seq), lp) for seq, lp in ar.top_k(args.top_k)]
    report["a"] = {"positions": counted.positions, "seconds": time.perf_counter() - started,
                   "position_ratio": brute["positions"] / counted.positions,
                   "same_answers": [t for t, _ in top] == [t for t, _ in brute_top],
                   "max_log_prob_diff": max(abs(a[1] - b[1]) for a, b in zip(top, brute_top)),
                   "top": top}

    # ---- part b: ranks, each on a fresh index (nothing carried over from part a)
    secret_index = int(SECRET.strip()[:args.digits])   # a shorter format ranks the secret's first digits
    deep_index = int(order[args.deep_rank])
    ranks = {}
    for name, index in (("secret", secret_index), ("deep", deep_index)):
        counted = CountingModel(model)
        tokens = tokenizer(member(index, args.digits), add_special_tokens=False)["input_ids"]
        started = time.perf_counter()
        result = estimate_rank(counted, tokens, prompt=prompt, constraint=automaton, max_forwards=10**7)
        seconds = time.perf_counter() - started
        ranks[name] = {"text": member(index, args.digits), "rank": result.rank, "method": result.method,
                       "brute_rank": int(np.flatnonzero(order == index)[0]), "exposure_bits": result.exposure_bits,
                       "positions": counted.positions, "seconds": seconds,
                       "time_ratio": brute["seconds"] / seconds}
    report["b"] = ranks
    return report


def label_part(model, n_labels: int) -> dict:
    """Part c: label choices through one prefix trie against one request per choice."""
    tokenizer = model.tokenizer
    labels = [f" {adjective} {noun}" for adjective in ADJECTIVES for noun in NOUNS][:n_labels]
    label_prompt = model.encode("Describe the picture in two words:", chat=False)
    counted = CountingModel(model)
    started = time.perf_counter()
    scores = score_choices(counted, labels, prompt=label_prompt,
                           tokenize=lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    trie_seconds = time.perf_counter() - started
    started = time.perf_counter()
    single = [float(model.score_sequences([list(tokens)], prompt=label_prompt)[0]) for tokens in scores.tokens]
    single_seconds = time.perf_counter() - started
    per_request = sum(len(label_prompt) + len(tokens) for tokens in scores.tokens)
    trie_positions = len(label_prompt) + scores.forwards
    return {"labels": len(labels), "trie_positions": trie_positions, "per_request_positions": per_request,
            "position_ratio": per_request / trie_positions, "trie_seconds": trie_seconds,
            "per_request_seconds": single_seconds,
            "max_log_prob_diff": float(np.max(np.abs(np.array(single) - scores.log_probs))),
            "same_ranking": list(np.argsort(-np.array(single), kind="stable")) == list(np.argsort(scores.ranks)),
            "best": scores.best(), "label_set_mass": float(np.exp(scores.log_mass))}


def wide_part(model, pattern: str, max_len: int, top_k: int) -> dict:
    """Part d: the top-k of a wide format followed by eos; the token automaton is built as far as it reaches."""
    prompt = model.encode(WIDE_PROMPT, chat=False)
    started = time.perf_counter()
    automaton = compile_for(Regex(pattern), model, eos=model.eos_token_id)
    compile_seconds = time.perf_counter() - started
    counted = CountingModel(model)
    started = time.perf_counter()
    ar = AutoregressiveEnumerable(counted, prompt=prompt, constraint=automaton, eos=model.eos_token_id,
                                  max_len=max_len)
    top = [(model.decode(seq[:-1]), lp) for seq, lp in ar.top_k(top_k)]
    return {"pattern": pattern, "max_len": max_len, "compile_seconds": compile_seconds,
            "top_k_seconds": time.perf_counter() - started, "positions": counted.positions,
            "states": automaton.n_states, "built_states": automaton.built_states, "moves": automaton.stored_moves,
            "top": top}


def print_report(report: dict, args, pattern: str) -> None:
    print(f"CPU: {report['cpu']}; prompt {PROMPT!r}; format {pattern!r}")
    if "a" in report:
        brute, a = report["brute_force"], report["a"]
        print(f"brute force (trie, batches of {args.batch}): {brute['positions']:,} positions, "
              f"{brute['seconds']:.1f} s")
        print(f"a) top-{args.top_k}: speculum {a['positions']:,} positions ({a['position_ratio']:.0f}x fewer), "
              f"{a['seconds']:.1f} s; identical answers: {a['same_answers']} (max |diff| {a['max_log_prob_diff']:.1e})")
        for text, lp in a["top"]:
            print(f"     {text!r} {lp:.4f}")
        for name, r in report["b"].items():
            print(f"b) rank of {name} {r['text']!r}: {r['rank']} ({r['method']}; brute force {r['brute_rank']}), "
                  f"exposure {r['exposure_bits']:.2f} bits, {r['positions']:,} positions, {r['seconds']:.1f} s "
                  f"({r['time_ratio']:.0f}x less wall time than brute force)")
    if "c" in report:
        c = report["c"]
        print(f"c) {c['labels']} labels: trie {c['trie_positions']:,} positions, {c['trie_seconds']:.1f} s; one "
              f"request each {c['per_request_positions']:,} positions, {c['per_request_seconds']:.1f} s "
              f"({c['position_ratio']:.1f}x fewer positions); max |log-prob diff| {c['max_log_prob_diff']:.1e}; "
              f"same ranking: {c['same_ranking']}; best {c['best']!r}, set mass {c['label_set_mass']:.3g}")
    if "d" in report:
        d = report["d"]
        print(f"d) {d['pattern']!r} then eos, at most {d['max_len']} tokens: automaton compiled in "
              f"{d['compile_seconds']:.2f} s; top-{len(d['top'])} in {d['top_k_seconds']:.1f} s "
              f"({d['positions']:,} positions); {d['states']:,} token-automaton states reached, "
              f"{d['built_states']:,} built ({d['moves']:,} moves, {d['moves'] * 8 / 2 ** 20:.0f} MB)")
        for text, lp in d["top"]:
            print(f"     {text!r} {lp:.4f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
