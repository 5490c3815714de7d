"""`speculum enumerate` / `speculum rank`: fast checks on a tiny reference target, one real-model check."""
from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest

from support.reference_target import REFERENCE_TARGET as REFERENCE, reference_model
from speculum.cli import main

# Every test may name the tiny reference target; the real-model tests simply do not.
pytestmark = pytest.mark.usefixtures("reference_target")


def run_json(capsys, *argv):
    assert main(list(argv) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def brute_top(prompt, length, k):
    model = reference_model()
    seqs = list(itertools.product(range(6), repeat=length))
    scores = model.score_sequences(seqs, prompt=prompt)
    return sorted(zip(seqs, scores.tolist()), key=lambda item: (-item[1], item[0]))[:k]


@pytest.mark.parametrize("extra", [[], ["--draft", "ngram", "--window", "300"],
                                   ["--draft", "ngram", "--window", "2", "--assumed-gap", "4", "--certify"]])
def test_enumerate_lists_the_true_top_k_with_target_scores(capsys, extra):
    report = run_json(capsys, "enumerate", "0 1", "--length", "3", "--top-k", "6", "--target", REFERENCE, *extra)
    truth = brute_top([0, 1], 3, 6)
    assert [tuple(row["tokens"]) for row in report["items"]] == [seq for seq, _ in truth]
    np.testing.assert_allclose([row["target_log_prob"] for row in report["items"]], [lp for _, lp in truth],
                               atol=1e-12)
    if "--certify" in extra:
        assert report["certified"] is True and report["window"] >= 2
    elif extra:  # the window covers all 6**3 continuations: exact without an assumed gap
        assert report["certified"] is True and report["target_calls"] == 1


def test_enumerate_table_and_eos(capsys):
    assert main(["enumerate", "0", "--eos", "--max-len", "3", "--top-k", "2", "--target", REFERENCE,
                 "--draft", "ngram", "--window", "2"]) == 0
    out = capsys.readouterr().out
    assert "target lp" in out and "draft lp" in out and "certified: unknown" in out
    assert out.count("5'\n") == 2  # every continuation ends in eos (id 5)


def test_rank_exact_and_envelope(capsys):
    exact = run_json(capsys, "rank", "0 1", "--text", "2 3 4", "--target", REFERENCE)
    model = reference_model()
    all_scores = model.score_sequences(list(itertools.product(range(6), repeat=3)), prompt=[0, 1])
    lp = float(model.score_sequences([[2, 3, 4]], prompt=[0, 1])[0])
    assert exact["method"] == "exact" and exact["rank"] == int(np.sum(all_scores > lp))
    assert exact["exposure_bits"] == pytest.approx(3 * np.log2(6) - np.log2(exact["rank"] + 1))
    deep = run_json(capsys, "rank", "0 1", "--text", "2 3 4 1 1 1 1 1", "--target", REFERENCE)
    assert deep["method"] == "envelope" and deep["rank_bracket"][0] <= deep["rank"] <= deep["rank_bracket"][1]
    assert main(["rank", "0 1", "--text", "2 3 4", "--target", REFERENCE]) == 0
    assert "exposure" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["enumerate", "0", "--length", "0", "--top-k", "3"], "--length"),
    (["enumerate", "0", "--length", "2", "--top-k", "0"], "--top-k"),
    (["enumerate", "0", "--length", "2", "--top-k", "2", "--window", "-1"], "--window"),
    (["enumerate", "0", "--length", "2", "--top-k", "2", "--draft", "ngram", "--certify"], "--assumed-gap"),
    (["enumerate", "0", "--length", "2", "--top-k", "2", "--draft", "int8"], "Hugging Face"),
    (["enumerate", "0", "--length", "2", "--top-k", "2", "--draft", "lookup"], "draft model"),
    (["enumerate", "x y", "--length", "2", "--top-k", "2"], "token ids"),
    (["rank", "0", "--text", "9"], "continuation"),
    (["rank", "0", "--text", "1", "--n-paths", "0"], "--n-paths"),
])
def test_bad_input_is_one_line_error(capsys, argv, message):
    assert main(argv + ["--target", REFERENCE]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_the_user_cli_knows_no_hidden_reference_target(capsys):
    pytest.importorskip("torch")
    assert main(["enumerate", "0 1", "--length", "2", "--top-k", "3", "--target", "markov:6:0"]) == 2
    assert "unknown model 'markov:6:0'" in capsys.readouterr().err


@pytest.mark.llm
def test_rank_on_the_real_model(capsys):
    pytest.importorskip("transformers")
    report = run_json(capsys, "rank", "The capital of France is", "--raw", "--text", " Paris")
    assert report["length"] == 1 and report["method"] == "exact" and report["rank"] <= 3
    assert report["exposure_bits"] > 10


@pytest.mark.slow
@pytest.mark.llm
def test_enumerate_on_the_real_model_with_int8_draft(capsys):
    pytest.importorskip("transformers")
    exact = run_json(capsys, "enumerate", "The capital of France is", "--raw", "--length", "2", "--top-k", "5")
    fast = run_json(capsys, "enumerate", "The capital of France is", "--raw", "--length", "2", "--top-k", "5",
                    "--draft", "int8", "--window", "64")
    assert [row["tokens"] for row in fast["items"]] == [row["tokens"] for row in exact["items"]]
    np.testing.assert_allclose([r["target_log_prob"] for r in fast["items"]],
                               [r["target_log_prob"] for r in exact["items"]], atol=1e-3)


def test_node_budget_is_a_one_line_error_and_progress_shows_on_a_terminal(capsys, monkeypatch):
    argv = ["enumerate", "0 1", "--length", "11", "--top-k", "3", "--target", REFERENCE]
    assert main(argv + ["--max-nodes", "1000"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--max-nodes" in err and "1,000 nodes" in err
    assert main(["enumerate", "0 1", "--length", "9", "--top-k", "10", "--target", REFERENCE,
                 "--max-nodes", "0"]) == 2
    assert "--max-nodes" in capsys.readouterr().err
    # Deep top-3: a bounded build, and on a terminal a progress bar of forwarded prefixes on stderr.
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert main(argv + ["--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert [tuple(row["tokens"]) for row in report["items"]][0] == (0, 5, 3, 3, 3, 3, 3, 3, 3, 3, 3)
    assert "prefix" in captured.err


def test_an_eos_listing_is_bounded_by_max_forwards(capsys, monkeypatch):
    """--eos lists may lie deep (eos unlikely): --max-forwards bounds them as it bounds --regex, tightly (a
    refused run forwarded at most the limit), and a limit at the run's exact need changes no answer."""
    model = reference_model()
    calls: list[int] = []

    def counted(prefixes, _method=model.next_logprobs):
        calls.append(len(prefixes))
        return _method(prefixes)

    monkeypatch.setattr(model, "next_logprobs", counted)
    monkeypatch.setattr("speculum.cli.enumerate.load_target", lambda spec, **options: model)
    argv = ["enumerate", "0 1", "--eos", "--max-len", "8", "--top-k", "30", "--target", REFERENCE]
    unlimited = run_json(capsys, *argv, "--max-forwards", "10000000")
    needed = sum(calls)
    assert needed > 2
    for limit in (1, needed // 2, needed - 1):
        calls.clear()
        assert main(argv + ["--max-forwards", str(limit)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"--max-forwards {limit:,}" in err and "ending in eos" in err
        assert "--max-len 8" in err and sum(calls) <= limit
    exact = run_json(capsys, *argv, "--max-forwards", str(needed))
    assert [row["tokens"] for row in exact["items"]] == [row["tokens"] for row in unlimited["items"]]
    assert [row["target_log_prob"] for row in exact["items"]] == [row["target_log_prob"] for row in unlimited["items"]]
    assert main(["enumerate", "0 1", "--length", "2", "--top-k", "3", "--max-forwards", "9",
                 "--target", REFERENCE]) == 2
    assert "--max-forwards goes with --regex or --eos" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.llm
@pytest.mark.parametrize("fmt", [[r"[\u4e00-\u9fff]{2}"], [".{0,1000}", "--eos", "--max-len", "8"]])
def test_a_deep_format_on_the_real_model_answers_or_refuses_within_a_minute(capsys, monkeypatch, fmt):
    """A rare script or a wide class lies deep in SmolLM2's tail: the listing answers, or stops with one line
    naming --max-forwards, within the minute the default forward limit is sized for. The model is loaded
    first: its load is the same for every command (tens of seconds on a busy machine), the bound is the
    format's."""
    pytest.importorskip("transformers")
    import speculum.cli.enumerate as enumerate_cli

    model = enumerate_cli.load_target("smollm2-135m")
    monkeypatch.setattr(enumerate_cli, "load_target", lambda spec, **options: model)
    started = time.perf_counter()
    code = main(["enumerate", "My favourite word is", "--raw", "--regex", *fmt, "--top-k", "5"])
    seconds = time.perf_counter() - started
    captured = capsys.readouterr()
    assert seconds < 60, seconds
    if code == 2:
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and "--max-forwards 500" in lines[0] and repr(fmt[0]) in lines[0], captured.err
    else:
        assert code == 0 and len(captured.out.strip().splitlines()) == 5 + 3, captured.out
