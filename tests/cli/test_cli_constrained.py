"""``speculum enumerate --regex / --choices-file`` and ``speculum rank --regex / --file`` against the library
and brute force, on a tiny random Llama whose word-level tokenizer spells digits several ways.

The model computes in float32: the CLI and the library agree to 1e-9 (the same batches), brute force (other
batches) to 1e-5.

The vocabulary holds "1", "2", "3", "12" and "23", so "12" is both ``[12]`` and ``[1, 2]``: token mode and
string mode differ, and string mode is checked against a sum over every spelling enumerated here. The
reference target of the other CLI tests has no tokenizer, so no token texts for a regex to match.
"""
from __future__ import annotations

import itertools
import json
import math
import re

import numpy as np
import pytest
from support.cli import load_each_target_once

pytest.importorskip("torch")
pytest.importorskip("transformers")

import speculum  # noqa: E402
import speculum.cli.enumerate as enumerate_cli  # noqa: E402
from support.hf_tiny import save_tiny_model  # noqa: E402
from speculum.cli import main  # noqa: E402
from speculum.cli.constrained import read_lines  # noqa: E402
from speculum.enumeration import AutoregressiveEnumerable, Regex, score_choices  # noqa: E402
from speculum.enumeration.enumerable import IndexBudgetError  # noqa: E402

WORDS = ["1", "2", "3", "12", "23", "x", "y"]
PROMPT = "x y"
PAIRS = "[123]{2}"       # 9 strings; "12" and "23" have two tokenizations each: 11 token sequences
_LOADED: dict = {}       # one load of the tiny model per module: a load is 0.4 s, and the CLI runs ~30 times


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("constrained") / "tiny", words=WORDS))


@pytest.fixture(scope="module")
def library_model(tiny_dir):
    """A load of its own, so that the CLI's results are compared with an independent index."""
    return speculum.load_model(tiny_dir)


@pytest.fixture(autouse=True)
def load_once(monkeypatch):
    """The first run loads the folder through the CLI's own loader; later runs reuse that model."""
    load_each_target_once(monkeypatch, _LOADED)


def run_json(capsys, *argv) -> dict:
    assert main(list(argv) + ["--json"]) == 0
    # No NaN / Infinity: strict JSON parsers reject them.
    return json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"JSON holds {name}"))


def prompt_ids(model) -> list[int]:
    return model.encode(PROMPT, chat=None)


def brute_strings(model, pattern: str, max_tokens: int) -> dict[str, float]:
    """Every string of ``pattern`` spelled by at most ``max_tokens`` tokens, with its probability summed over
    every token sequence that spells it (no eos: the tiny model's WordLevel pieces are the words)."""
    pieces = {i: word for word, i in model.tokenizer.get_vocab().items() if word in WORDS}
    mass: dict[str, list[float]] = {}
    for length in range(1, max_tokens + 1):
        for seq in itertools.product(sorted(pieces), repeat=length):
            text = "".join(pieces[t] for t in seq)
            if re.fullmatch(pattern, text):
                mass.setdefault(text, []).append(float(model.score_sequences([list(seq)], prompt=prompt_ids(model))[0]))
    return {text: float(np.logaddexp.reduce(lps)) for text, lps in mass.items()}


# ------------------------------------------------------------------------------------------ enumerate
@pytest.mark.parametrize("extra", [[], ["--strings"], ["--eos", "--max-len", "3"], ["--eos", "--max-len", "3", "--strings"]])
def test_regex_top_k_equals_the_library(capsys, tiny_dir, library_model, extra):
    pattern = PAIRS if "--eos" not in extra else "[123]+"
    strings, eos = "--strings" in extra, "--eos" in extra
    report = run_json(capsys, "enumerate", PROMPT, "--target", tiny_dir, "--regex", pattern, "--top-k", "7", *extra)
    index = AutoregressiveEnumerable(library_model, prompt=prompt_ids(library_model), constraint=Regex(pattern),
                                     strings=strings, eos=True if eos else None, max_len=3 if eos else None)
    expected = index.top_k(7)
    assert len(report["items"]) == len(expected) == 7
    assert [row["rank"] for row in report["items"]] == list(range(7))
    for row, (item, log_prob) in zip(report["items"], expected):
        if strings:
            assert row["text"] == item and "tokens" not in row
        else:
            assert tuple(row["tokens"]) == item
            assert row["text"] == "".join(library_model.tokenizer.convert_ids_to_tokens(
                [t for t in item if t != library_model.eos_token_id]))
        assert row["log_prob"] == pytest.approx(log_prob, abs=1e-9)
        assert row["probability"] == pytest.approx(math.exp(log_prob), rel=1e-12)
    assert report["prompt"] == PROMPT and report["regex"] == pattern and report["strings"] is strings
    assert report["size"] == (None if eos else 9) and report["forwards"] > 0 and report["seconds"] >= 0
    lo, hi = report["mass"]
    # hi bounds the format's whole mass, so also what the listed members hold.
    assert 0 <= lo <= hi <= 1 and sum(row["probability"] for row in report["items"]) <= hi * (1 + 1e-9)
    if not strings:
        assert report["token_sequences"] == index.seek_index().support.size(library_model.vocab_size)


def test_string_mode_lists_the_whole_format_as_brute_force_does(capsys, tiny_dir, library_model):
    # More than the format holds: every string, in exact descending order, and the mass bracket holds their sum.
    report = run_json(capsys, "enumerate", PROMPT, "--target", tiny_dir, "--regex", PAIRS, "--top-k", "20",
                      "--strings")
    truth = sorted(brute_strings(library_model, PAIRS, 2).items(), key=lambda item: (-item[1], item[0]))
    assert [row["text"] for row in report["items"]] == [text for text, _ in truth]
    np.testing.assert_allclose([row["log_prob"] for row in report["items"]], [lp for _, lp in truth], atol=1e-5)
    lo, hi = report["mass"]
    total = math.fsum(math.exp(lp) for _, lp in truth)
    assert lo <= total * (1 + 1e-5) and total <= hi * (1 + 1e-5)


def test_regex_table_has_k_rows_and_a_footer(capsys, tiny_dir):
    assert main(["enumerate", PROMPT, "--target", tiny_dir, "--regex", PAIRS, "--top-k", "4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["rank", "log-prob", "probability", "text", "tokens"] and len(lines) == 1 + 4 + 2
    assert lines[-2].startswith("format: 9 strings (11 token sequences); mass of the format >= ")
    assert main(["enumerate", PROMPT, "--target", tiny_dir, "--regex", "[123]+", "--eos", "--max-len", "2",
                 "--top-k", "2", "--strings"]) == 0
    out = capsys.readouterr().out
    assert "format: infinite strings;" in out and "tokens" not in out.splitlines()[0]


def test_a_mass_bracket_past_max_nodes_leaves_the_listing(capsys, tiny_dir, library_model):
    # The top member needs a few nodes; the footer's bracket would need every length up to 5.
    argv = ["enumerate", PROMPT, "--target", tiny_dir, "--regex", "[123]+", "--eos", "--max-len", "5", "--top-k", "1",
            "--max-nodes", "40"]
    report = run_json(capsys, *argv)
    expected = AutoregressiveEnumerable(library_model, prompt=prompt_ids(library_model), constraint=Regex("[123]+"),
                                        eos=True, max_len=5).top_k(1)
    assert report["mass"] is None and [tuple(row["tokens"]) for row in report["items"]] == [expected[0][0]]
    assert main(argv) == 0
    assert "mass of the format not bracketed within --max-nodes" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ --choices-file
@pytest.mark.parametrize("extra", [[], ["--eos"], ["--eos", "--all-tokenizations"]])
def test_choices_file_equals_score_choices(capsys, tmp_path, tiny_dir, library_model, extra):
    path = tmp_path / "choices.txt"
    path.write_text("12\n23\n\nx\n1\n")  # an empty line is skipped; no trailing newline needed
    report = run_json(capsys, "enumerate", PROMPT, "--target", tiny_dir, "--choices-file", str(path), *extra)
    expected = score_choices(library_model, ["12", "23", "x", "1"], prompt=prompt_ids(library_model),
                             eos=True if "--eos" in extra else None,
                             all_tokenizations="--all-tokenizations" in extra).as_dict()
    assert report.pop("seconds") >= 0 and report.keys() == expected.keys()
    assert [(c["choice"], c["tokens"], c["rank"]) for c in report["choices"]] == \
        [(c["choice"], c["tokens"], c["rank"]) for c in expected["choices"]]
    np.testing.assert_allclose([c["log_prob"] for c in report["choices"]], [c["log_prob"] for c in expected["choices"]],
                               atol=1e-9)
    assert sum(c["probability"] for c in report["choices"]) == pytest.approx(1.0)
    assert report["log_mass"] == pytest.approx(expected["log_mass"], abs=1e-9)


def test_choices_table_is_sorted_by_rank_and_top_k_cuts_it(capsys, tmp_path, tiny_dir, library_model):
    path = tmp_path / "choices.txt"
    path.write_text("12\n23\nx\n1\n")
    scores = score_choices(library_model, ["12", "23", "x", "1"], prompt=prompt_ids(library_model), eos=True)
    order = [scores.choices[i] for i in np.argsort(scores.ranks)]
    assert main(["enumerate", PROMPT, "--target", tiny_dir, "--choices-file", str(path), "--eos", "--top-k", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[-1] for line in lines[1:3]] == [repr(text) for text in order[:2]] and len(lines) == 4
    assert f"mass of the set: {math.exp(scores.log_mass):.6g}" in lines[-1]
    report = run_json(capsys, "enumerate", PROMPT, "--target", tiny_dir, "--choices-file", str(path), "--eos",
                      "--top-k", "2")
    assert sorted(c["rank"] for c in report["choices"]) == [0, 1]


def test_a_choices_file_shows_its_progress_on_a_terminal_only(capsys, monkeypatch, tmp_path, tiny_dir):
    path = tmp_path / "choices.txt"
    path.write_text("\n".join(["12", "23", "x", "1", "y"]))
    argv = ["enumerate", PROMPT, "--target", tiny_dir, "--choices-file", str(path), "--json"]
    assert main(argv) == 0
    assert "scoring choices" not in capsys.readouterr().err
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "scoring choices" in captured.err and json.loads(captured.out)["forwards"] > 0


def test_lines_keep_leading_spaces_and_drop_only_newlines(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_bytes(b" Paris\r\nParis \n\n\t\nLyon")
    assert read_lines(str(path), "--file", "rank") == [" Paris", "Paris ", "\t", "Lyon"]


# ----------------------------------------------------------------------------------------------- rank
@pytest.mark.parametrize("strings", [False, True])
def test_rank_in_a_format_equals_the_library_and_brute_force(capsys, tiny_dir, library_model, strings):
    mode = ["--strings"] if strings else []
    report = run_json(capsys, "rank", PROMPT, "--target", tiny_dir, "--regex", PAIRS, "--text", "12", *mode)
    index = AutoregressiveEnumerable(library_model, prompt=prompt_ids(library_model), constraint=Regex(PAIRS),
                                     strings=strings)
    item = "12" if strings else tuple(library_model.tokenizer("12", add_special_tokens=False)["input_ids"])
    [row] = report["items"]
    assert row["method"] == "exact" and row["rank"] == index.rank(item) and row["rank_bracket"] == [row["rank"]] * 2
    space = 9 if strings else index.seek_index().support.size(library_model.vocab_size)
    assert report["space_size"] == space
    assert row["exposure_bits"] == pytest.approx(math.log2(space) - math.log2(row["rank"] + 1))
    if strings:
        truth = brute_strings(library_model, PAIRS, 2)
        assert row["rank"] == sum(lp > truth["12"] for lp in truth.values())
        assert row["log_prob"] == pytest.approx(truth["12"], abs=1e-5)
    else:
        assert row["tokens"] == list(item) == [library_model.tokenizer.get_vocab()["12"]]


def test_rank_file_ranks_every_canary_on_one_index(capsys, tmp_path, tiny_dir, library_model):
    path = tmp_path / "canaries.txt"
    path.write_text("12\n\n31\n23\n")
    report = run_json(capsys, "rank", PROMPT, "--target", tiny_dir, "--regex", PAIRS, "--strings", "--file", str(path))
    index = AutoregressiveEnumerable(library_model, prompt=prompt_ids(library_model), constraint=Regex(PAIRS),
                                     strings=True)
    assert [row["text"] for row in report["items"]] == ["12", "31", "23"]
    assert [row["rank"] for row in report["items"]] == [index.rank(text) for text in ("12", "31", "23")]
    assert main(["rank", PROMPT, "--target", tiny_dir, "--regex", PAIRS, "--strings", "--file", str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("space: 9 strings of regex") and len(lines) == 4
    assert all("(exact)" in line and "exposure" in line for line in lines[1:])


def test_rank_bracket_past_the_forward_budget_contains_the_rank(capsys, tiny_dir, library_model):
    pattern = "[123]{4}"
    report = run_json(capsys, "rank", PROMPT, "--target", tiny_dir, "--regex", pattern, "--text", "3131",
                      "--strings", "--max-forwards", "3")
    [row] = report["items"]
    exact = AutoregressiveEnumerable(library_model, prompt=prompt_ids(library_model), constraint=Regex(pattern),
                                     strings=True).rank("3131")
    low, high = row["rank_bracket"]
    assert row["method"] == "bracket" and low <= exact <= high and low <= row["rank"] <= high
    exposure = [math.log2(81) - math.log2(rank + 1) for rank in (high, low)]
    assert row["exposure_bracket"] == pytest.approx(exposure)


def test_infinite_format_has_null_space_and_exposure(capsys, tiny_dir):
    report = run_json(capsys, "rank", PROMPT, "--target", tiny_dir, "--regex", "[123]+", "--eos", "--text", "12")
    [row] = report["items"]
    assert report["space_size"] is None and row["exposure_bits"] is None and row["method"] == "exact"
    assert row["tokens"][-1] == _LOADED[tiny_dir].eos_token_id


def test_rank_file_without_regex_ranks_each_line_as_text_does(capsys, tmp_path, reference_target):
    path = tmp_path / "canaries.txt"
    path.write_text("2 3 4\n1 1\n")
    report = run_json(capsys, "rank", "0 1", "--target", reference_target, "--file", str(path))
    singles = [run_json(capsys, "rank", "0 1", "--target", reference_target, "--text", text)
               for text in ("2 3 4", "1 1")]
    for row, single in zip(report["items"], singles):
        row.pop("seconds"), single.pop("seconds")
        assert row == single
    assert report["prompt"] == "0 1"


# ---------------------------------------------------------------------------------------------- errors
ENUM = ["enumerate", PROMPT]
RANK = ["rank", PROMPT]


@pytest.mark.parametrize("argv,needle", [
    (ENUM + ["--regex", "(12", "--top-k", "3"], "invalid --regex '(12': missing )"),
    (ENUM + ["--regex", "^12", "--top-k", "3"], "invalid --regex '^12': anchors (^, $"),
    (ENUM + ["--regex", "", "--top-k", "3"], "the regex is empty"),
    (ENUM + ["--regex", PAIRS, "--top-k", "-2"], "--top-k must be >= 1"),
    (ENUM + ["--regex", PAIRS], "--top-k is required"),
    (ENUM + ["--length", "2", "--top-k", "3", "--strings"], "--strings goes with --regex"),
    (ENUM + ["--regex", PAIRS, "--length", "2", "--top-k", "3"], "--length does not go with --regex"),
    (ENUM + ["--regex", PAIRS, "--top-k", "3", "--draft", "ngram"], "--draft none"),
    (ENUM + ["--top-k", "3"], "one of --length, --eos, --regex or --choices-file"),
    (ENUM + ["--length", "2", "--top-k", "3", "--all-tokenizations"], "--all-tokenizations goes with --choices-file"),
    (ENUM + ["--choices-file", "MISSING"], "--choices-file: no such file: MISSING"),
    (ENUM + ["--choices-file", "EMPTY"], "holds no non-empty line"),
    (ENUM + ["--choices-file", "DUPLICATE"], "appears more than once"),
    (ENUM + ["--choices-file", "DUPLICATE", "--max-len", "2"], "--max-len does not go with --choices-file"),
    (RANK + ["--text", "12", "--strings"], "--strings goes with --regex"),
    (RANK + ["--text", "12", "--max-forwards", "0"], "--max-forwards goes with --regex"),
    (RANK + ["--text", "12", "--regex", "[1"], "invalid --regex"),
    (RANK + ["--file", "MISSING", "--regex", PAIRS], "--file: no such file"),
])
def test_bad_input_is_one_line_before_the_model_loads(capsys, monkeypatch, tmp_path, argv, needle):
    files = {"MISSING": tmp_path / "missing.txt", "EMPTY": tmp_path / "empty.txt", "DUPLICATE": tmp_path / "dup.txt"}
    files["EMPTY"].write_text("\n\n")
    files["DUPLICATE"].write_text("12\n12\n")
    argv = [str(files[arg]) if arg in files else arg for arg in argv]
    needle = needle.replace("MISSING", str(files["MISSING"]))

    def refuse(spec, **options):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr(enumerate_cli, "load_target", refuse)
    assert main(argv + ["--target", "any"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"speculum {argv[0]}: error: "), captured.err
    assert needle in lines[0] and "Traceback" not in captured.err and captured.out == ""


def test_an_unspellable_canary_is_one_line_after_loading(capsys, tiny_dir):
    assert main(RANK + ["--target", tiny_dir, "--regex", PAIRS, "--text", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'x' (tokens [" in err and "not a member" in err and "Traceback" not in err


def test_help_names_every_new_flag(capsys):
    for command, flags in (("enumerate", ["--regex", "--choices-file", "--strings", "--all-tokenizations"]),
                           ("rank", ["--file", "--regex", "--strings", "--eos", "--max-len", "--max-forwards"])):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert all(re.search(rf"^\s+{re.escape(flag)}\b.*\S", text, re.M) for flag in flags), text


def test_draft_only_flags_warn_with_a_format(tmp_path, capsys):
    """--certify / --assumed-gap / --window / --seed do nothing for the exact index: one warning each."""
    from speculum.cli.constrained import check_enumerate
    import argparse

    args = argparse.Namespace(length=None, eos=False, regex="[12]{2}", choices_file=None, strings=False,
                              all_tokenizations=False, top_k=3, draft="none", max_len=None, certify=True,
                              assumed_gap=1.0, window=8, seed=3)
    check_enumerate(args)
    err = capsys.readouterr().err
    for flag in ("--certify", "--assumed-gap", "--window", "--seed"):
        assert f"warning: {flag} has no effect with --regex" in err


# ------------------------------------------------------------------------------------ bounded work
def test_a_listing_past_max_forwards_stops_with_one_line_naming_the_limit(capsys, tiny_dir):
    """A format whose top-K needs more forwards than --max-forwards stops within about a batch past it,
    with one line naming the regex and the flag; a budget large enough gives the listing unchanged."""
    argv = ["enumerate", PROMPT, "--target", tiny_dir, "--regex", "[123xy]{1,5}", "--eos", "--top-k", "40"]
    assert main(argv + ["--max-forwards", "2"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculum enumerate: error: "), captured.err
    assert "'[123xy]{1,5}'" in lines[0] and "--max-forwards 2" in lines[0] and captured.out == ""
    unbounded = run_json(capsys, *argv)
    bounded = run_json(capsys, *argv, "--max-forwards", str(unbounded["forwards"]))
    assert [row["tokens"] for row in bounded["items"]] == [row["tokens"] for row in unbounded["items"]]
    assert [row["log_prob"] for row in bounded["items"]] == [row["log_prob"] for row in unbounded["items"]]
    assert bounded["forwards"] <= unbounded["forwards"]
    assert main(argv + ["--max-forwards", "0"]) == 2 and "--max-forwards must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("json_output", [False, True])
def test_an_astronomically_large_format_is_listed_with_its_size(capsys, tiny_dir, json_output):
    """'.{0,1000}' holds more strings than Python prints as an integer: the size is given in bits."""
    argv = ["enumerate", PROMPT, "--target", tiny_dir, "--regex", ".{0,1000}", "--eos", "--max-len", "3",
            "--top-k", "3"]
    if json_output:
        report = run_json(capsys, *argv)
        assert report["size"] is None and report["size_bits"] > 20_000 and len(report["items"]) == 3
    else:
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "format: 2^2" in out and len(out.strip().splitlines()) == 6


# ------------------------------------------------------------------------- astronomically large formats
HUGE = [".{0,1000}", "--eos", "--max-len", "3", "--strings"]     # about 2^20,000 strings


def test_rank_in_an_astronomically_large_format_gives_its_size_in_bits(capsys, tiny_dir):
    """rank --regex prints and serialises a format of more strings than Python prints as an integer."""
    argv = ["rank", PROMPT, "--target", tiny_dir, "--regex", *HUGE, "--text", "1"]
    report = run_json(capsys, *argv)
    assert report["space_size"] is None and report["space_bits"] > 20_000
    assert report["items"][0]["exposure_bits"] > 20_000
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("space: 2^2") and "strings of regex" in out


def test_every_count_the_cli_prints_goes_through_one_helper():
    """No command formats a size of its own: an int of 4,300 digits and more cannot be printed."""
    from speculum.cli import audit, constrained
    from speculum.cli.counts import PRINTABLE_BITS, count_bits, count_json, count_text

    huge, fits = 3 ** 20_000, 2 ** PRINTABLE_BITS - 1
    assert count_json(huge) is None and count_text(huge).startswith("2^31,699.")
    assert count_bits(huge) == pytest.approx(20_000 * math.log2(3))
    assert count_json(fits) == fits and count_text(fits) == f"{fits:,}"
    assert (count_json(math.inf), count_bits(math.inf), count_text(math.inf)) == (None, None, "infinite")
    for module in (audit, constrained):
        assert not hasattr(module, "_count") and not hasattr(module, "_size")


# ------------------------------------------------------------------------------- a tight forward limit
def count_forwards(monkeypatch, model) -> list[int]:
    """Count every prefix ``model`` forwards (dense and sparse rows), per call."""
    calls: list[int] = []
    for name in ("next_logprobs", "next_logprobs_above"):
        method = getattr(model, name, None)
        if method is not None:
            def counted(prefixes, *rest, _method=method):
                calls.append(len(prefixes))
                return _method(prefixes, *rest)
            monkeypatch.setattr(model, name, counted)
    return calls


def test_the_forward_limit_is_tight_and_changes_nothing_under_it(capsys, monkeypatch, tiny_dir, library_model):
    """A listing refused by --max-forwards N forwarded at most N prefixes (checked before each batch, not
    after); with N its exact need it answers as an unlimited run does, and with one less it is refused."""
    argv = ["enumerate", PROMPT, "--target", tiny_dir, "--regex", "[123xy]{1,5}", "--eos", "--top-k", "40"]
    main(argv + ["--max-forwards", "1"])                      # loads the model (cached for the runs below)
    capsys.readouterr()
    model = _LOADED[tiny_dir]
    calls = count_forwards(monkeypatch, model)

    def no_bracket(self, **options):      # the footer's bracket deepens past the listing: left out here
        raise IndexBudgetError("not bracketed")

    monkeypatch.setattr(AutoregressiveEnumerable, "mass", no_bracket)
    unlimited = run_json(capsys, *argv, "--max-forwards", "1000000")
    needed = sum(calls)
    assert needed == unlimited["forwards"] > 2
    for limit in (1, 2, needed // 2, needed - 1):
        calls.clear()
        assert main(argv + ["--max-forwards", str(limit)]) == 2
        assert f"--max-forwards {limit:,}" in capsys.readouterr().err
        assert sum(calls) <= limit, (limit, calls)
    exact = run_json(capsys, *argv, "--max-forwards", str(needed))
    assert [row["tokens"] for row in exact["items"]] == [row["tokens"] for row in unlimited["items"]]
    assert [row["log_prob"] for row in exact["items"]] == [row["log_prob"] for row in unlimited["items"]]
    assert exact["forwards"] == needed


# ------------------------------------------------------------------------------------ bounded label files
def refuse_to_load(monkeypatch) -> None:
    def refuse(spec, **options):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr(enumerate_cli, "load_target", refuse)


def one_line_error(capsys, argv) -> str:
    assert main(argv + ["--target", "any"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"speculum {argv[0]}: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


@pytest.mark.parametrize("command,flag,limit_flag,default", [
    ("enumerate", "--choices-file", "--max-choices", 100_000),
    ("rank", "--file", "--max-canaries", 10_000),
])
def test_a_huge_label_file_is_refused_by_its_size_before_it_is_read(capsys, monkeypatch, tmp_path, command, flag,
                                                                    limit_flag, default):
    from speculum.cli.constrained import LINE_BYTES

    refuse_to_load(monkeypatch)
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as out:            # 200 MB, sparse: only its size is ever looked at
        out.truncate(200 * 2 ** 20)
    monkeypatch.setattr("speculum.cli.constrained.read_lines", lambda *a, **k: pytest.fail("the file was read"))
    line = one_line_error(capsys, [command, PROMPT, flag, str(huge)])
    assert str(huge) in line and "209,715,200 bytes" in line
    assert f"{default * LINE_BYTES:,} bytes" in line and limit_flag in line


@pytest.mark.parametrize("command,flag,limit_flag", [
    ("enumerate", "--choices-file", "--max-choices"),
    ("rank", "--file", "--max-canaries"),
])
def test_the_label_file_limits_follow_their_flag(capsys, monkeypatch, tmp_path, command, flag, limit_flag):
    refuse_to_load(monkeypatch)
    path = tmp_path / "labels.txt"
    path.write_text("1\n2\n3\n")
    line = one_line_error(capsys, [command, PROMPT, flag, str(path), limit_flag, "2"])
    assert str(path) in line and "holds 3 " in line and f"{limit_flag} 2" in line
    path.write_text("1" * 3000 + "\n")
    line = one_line_error(capsys, [command, PROMPT, flag, str(path), limit_flag, "2"])
    assert "3,001 bytes" in line and "2,048 bytes" in line
    assert f"{limit_flag} must be >= 1" in one_line_error(capsys, [command, PROMPT, flag, str(path), limit_flag, "0"])
    path.write_text("1\n2\n")
    with pytest.raises(AssertionError, match="the model loaded"):
        main([command, PROMPT, flag, str(path), limit_flag, "2", "--target", "x"])
