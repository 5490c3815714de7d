"""Replay proposer policies offline against recorded greedy outputs: noise-free comparison of drafts and γ rules.

Wall-clock benchmarks on these 2 shared cores move by ±0.1x between runs, too much to compare two γ rules
that differ by a few percent. Greedy decoding is deterministic, so a proposer's behaviour can be replayed
exactly: record the target's greedy continuation once, then for every block let the proposer propose from
the true context, let ``gamma="auto"`` (the real :class:`GammaController`) choose γ, count the accepted
prefix against the known continuation, and charge the measured cost of verifying γ + 1 tokens (v(γ), in
decode steps, timed once on the real target). The predicted speed-up is tokens / Σ v(γ_block).

    .venv/bin/python benchmarks/replay_lookup.py --record /tmp/outs.json      # once: outputs + cost curve
    .venv/bin/python benchmarks/replay_lookup.py --replay /tmp/outs.json      # then: policies, in seconds

The last two rows bound what γ rules can reach with lookup's proposals: the best fixed γ per match-length key
in hindsight (``per_key_bound``, a search), and γ chosen knowing the future (``hindsight_bound``, exact by
dynamic programming: no rule can beat it on this output and cost curve).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from speculum.decoding.gamma.controller import GammaController, situation_key  # noqa: E402
from speculum.drafts import make_draft  # noqa: E402
from speculum.models.backends import BACKENDS, DEFAULT_BACKEND  # noqa: E402


def record(path: str, max_new_tokens: int, backend: str) -> None:
    import speculum
    from decoding_llm import TASKS

    target = speculum.load_model("smollm2-135m", backend=backend)
    outputs = {}
    for task, text in TASKS.items():
        prompt = target.encode(text)
        tokens = speculum.generate(target, prompt, max_new_tokens=max_new_tokens, temperature=0,
                                   eos_token_id=None).tokens
        outputs[task] = {"prompt": prompt, "output": tokens}
        print(f"{task}: {len(prompt)} prompt tokens, {len(tokens)} generated", flush=True)
    # v(n): median time of feeding n tokens in one call, relative to one token, on a mid-length context.
    prompt = outputs["summarise"]["prompt"] + outputs["summarise"]["output"][:64]
    session = target.start(prompt)
    seconds = {}
    for _ in range(5):
        for n in range(1, 18):
            started = time.perf_counter()
            session.extend(prompt[:n])
            seconds.setdefault(n, []).append(time.perf_counter() - started)
            session.rollback(n)
    step = statistics.median(seconds[1])
    curve = {n: statistics.median(s) / step for n, s in seconds.items()}
    print("v(n):", " ".join(f"{n}:{v:.2f}" for n, v in curve.items()))
    with open(path, "w") as f:
        json.dump({"backend": backend, "vocab_size": int(target.vocab_size), "outputs": outputs,
                   "verify_cost": curve}, f)


def _cost_curve(data: dict) -> dict[int, float]:
    """v(n) from a recording: the cost of feeding n tokens in one call, in decode steps."""
    return {int(n): v for n, v in data["verify_cost"].items()}


def _agreement(proposal: list[int], truth: list[int]) -> int:
    """How many leading tokens of ``proposal`` the recorded output ``truth`` accepts (greedy)."""
    accepted = 0
    while accepted < len(proposal) and accepted < len(truth) and proposal[accepted] == truth[accepted]:
        accepted += 1
    return accepted


def replay(data: dict, draft_spec: str, *, controller_args: dict | None = None, fixed_gamma: int | None = None,
           gamma_by_key: dict | None = None, overhead: float = 0.0, tasks=None) -> dict:
    """One policy on every task (or ``tasks``): predicted speed-up and tokens per forward, per task. The
    policy is ``gamma="auto"``, or ``fixed_gamma``, or ``gamma_by_key`` (a γ per situation key, 0 if absent)."""
    curve = _cost_curve(data)
    results = {}
    for task, run in data["outputs"].items():
        if tasks is not None and task not in tasks:
            continue
        proposer = make_draft(draft_spec, SimpleNamespace(vocab_size=data["vocab_size"]))
        controller = GammaController(**(controller_args or {}))
        context, output = list(run["prompt"]), run["output"]
        done, cost, forwards = 0, 0.0, 0
        while done < len(output):
            cap = min(len(output) - done - 1, controller.max_gamma)
            key, proposal = None, []
            if cap > 0:
                proposal, match = proposer.propose_with_match(context, cap)
                key = situation_key(match)
            if fixed_gamma is not None:
                gamma = min(fixed_gamma, cap)
            elif gamma_by_key is not None:
                gamma = min(gamma_by_key.get(key, 0), cap) if proposal else 0
            else:
                gamma = min(controller.next_gamma(key), cap) if proposal else 0
            proposal = proposal[:gamma]
            accepted = _agreement(proposal, output[done:done + len(proposal) + 1])
            n = len(proposal) + 1
            block = curve[min(n, max(curve))] + overhead
            cost += block
            forwards += 1
            controller.observe_target(n, block)
            controller.observe_draft(len(proposal), 0.0)
            controller.observe_acceptance(proposed=len(proposal), accepted=accepted, key=key)
            emitted = output[done:done + accepted + 1]
            context.extend(emitted)
            done += len(emitted)
        results[task] = (len(output) / cost, len(output) / forwards)
    return results


def per_key_bound(data: dict, draft_spec: str, task: str, *, sweeps: int = 3,
                  choices: tuple = (0, 1, 2, 3, 4, 6, 8, 12, 16)) -> tuple[dict, float]:
    """Hindsight bound for γ rules keyed on the proposer's evidence: the best fixed γ per situation key for
    this one output, found by coordinate search (each key in turn, ``sweeps`` passes). Returns the table
    and its predicted speed-up. No rule that sees only the key can beat the true optimum, which this
    search approaches from below."""
    def speedup(table: dict) -> float:
        return replay(data, draft_spec, gamma_by_key=table, tasks=[task])[task][0]

    keys = range(7) if draft_spec == "lookup" else []
    table = {key: 0 for key in keys}
    for _ in range(sweeps):
        for key in keys:
            table[key] = max(choices, key=lambda g: speedup({**table, key: g}))
    return table, speedup(table)


def hindsight_bound(data: dict, draft_spec: str, task: str) -> float:
    """Upper bound for *every* γ rule on this proposer's proposals: the cheapest way through the recorded
    output when γ may be chosen knowing the future. At position i the proposal agrees with the output for
    ``a_i`` tokens; proposing g ≤ a_i tokens advances g + 1 at cost v(g + 1) (proposing more than a_i only
    costs more). Dynamic programming over positions gives the exact minimum, so no rule that sees less than
    the future can do better (assumes proposals depend only on the context, true of prompt lookup)."""
    curve = _cost_curve(data)
    run = data["outputs"][task]
    proposer = make_draft(draft_spec, SimpleNamespace(vocab_size=data["vocab_size"]))
    output, n = run["output"], len(run["output"])
    agreed = []
    for i in range(n):
        cap = min(n - i - 1, max(curve) - 1)
        proposal = proposer.propose_with_match(list(run["prompt"]) + output[:i], cap)[0] if cap > 0 else []
        agreed.append(_agreement(proposal, output[i:]))
    best = [0.0] + [float("inf")] * n        # best[i]: least cost to have emitted the first i tokens
    for i in range(n):
        for g in range(agreed[i] + 1):
            best[i + g + 1] = min(best[i + g + 1], best[i] + curve[g + 1])
    return n / best[n]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", metavar="JSON", help="record greedy outputs and v(n) into JSON")
    parser.add_argument("--replay", metavar="JSON", help="replay policies against JSON")
    parser.add_argument("--backend", default=DEFAULT_BACKEND, choices=tuple(BACKENDS))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drafts", nargs="+", default=["lookup", "ngram"])
    args = parser.parse_args(argv)
    if args.record:
        record(args.record, args.max_new_tokens, args.backend)
    if args.replay:
        with open(args.replay) as f:
            data = json.load(f)
        print(f"{'policy':<24}" + "".join(f"{task:>18}" for task in data["outputs"]))
        for spec in args.drafts:
            for label, kwargs in ((f"{spec} γ=8", {"fixed_gamma": 8}), (f"{spec} auto", {})):
                res = replay(data, spec, **kwargs)
                print(f"{label:<24}" + "".join(f"{s:>9.2f}x {t:>5.2f}t/f" for s, t in res.values()))
        if "lookup" in args.drafts:
            bounds = [per_key_bound(data, "lookup", task) for task in data["outputs"]]
            print(f"{'lookup best γ per key':<24}" + "".join(f"{s:>9.2f}x {'':>8}" for _, s in bounds))
            bounds = [hindsight_bound(data, "lookup", task) for task in data["outputs"]]
            print(f"{'lookup, γ in hindsight':<24}" + "".join(f"{s:>9.2f}x {'':>8}" for s in bounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
