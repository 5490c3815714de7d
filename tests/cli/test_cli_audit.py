"""``speculum audit`` against the library and brute force, on a tiny random Llama whose word-level tokenizer
spells digit strings several ways ("12" is ``[12]`` and ``[1, 2]``); its errors, plot and Ctrl-C."""
from __future__ import annotations

import json
import math

import pytest
from support.cli import load_each_target_once

pytest.importorskip("torch")
pytest.importorskip("transformers")

import speculum  # noqa: E402
import speculum.cli.enumerate as enumerate_cli  # noqa: E402
from support.hf_tiny import save_tiny_model  # noqa: E402
from speculum.cli import main  # noqa: E402
from speculum.enumeration import AutoregressiveEnumerable, Regex  # noqa: E402

WORDS = ["1", "2", "3", "12", "23", "x", "y"]
PROMPT = "x y"
FORMAT = "[123]{4}"               # 81 strings, most with several tokenizations
STRINGS = ["1231", "3333", "2121", "1223"]
# The word-level tokenizer splits on spaces: these are the canaries' own tokens in token mode.
WORDED = ["12 3 1", "3 3 3 3", "2 1 2 1", "12 23"]
_LOADED: dict = {}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("audit") / "tiny", words=WORDS))


@pytest.fixture(scope="module")
def library_model(tiny_dir):
    return speculum.load_model(tiny_dir)


@pytest.fixture(autouse=True)
def load_once(monkeypatch):
    load_each_target_once(monkeypatch, _LOADED)


def write(tmp_path, canaries) -> str:
    path = tmp_path / "canaries.txt"
    path.write_text("\n".join(canaries) + "\n\n")
    return str(path)


@pytest.fixture
def canaries_file(tmp_path):
    return write(tmp_path, WORDED)


def run_json(capsys, *argv) -> dict:
    assert main(["audit", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"JSON holds {name}"))


def exact_ranks(model, strings: bool) -> dict:
    index = AutoregressiveEnumerable(model, prompt=model.encode(PROMPT, chat=None), constraint=Regex(FORMAT),
                                     strings=strings)
    if strings:
        return {text: index.rank(text) for text in STRINGS}
    return {text: index.rank(tuple(model.tokenizer(text, add_special_tokens=False)["input_ids"])) for text in WORDED}


@pytest.mark.parametrize("strings", [False, True])
def test_exact_audit_equals_the_exact_index(capsys, tmp_path, tiny_dir, library_model, strings):
    mode = ["--strings"] if strings else []
    canaries = STRINGS if strings else WORDED
    report = run_json(capsys, write(tmp_path, canaries), "--template", PROMPT + "{canary}", "--regex", FORMAT,
                      "--target", tiny_dir, "--method", "exact", *mode)
    truth = exact_ranks(library_model, strings)
    assert [row["canary"] for row in report["items"]] == canaries
    for row in report["items"]:
        assert row["method"] == "exact" and row["rank"] == truth[row["canary"]]
        assert row["exposure_bits"] == pytest.approx(report["space_bits"] - math.log2(row["rank"] + 1))
    if strings:
        assert report["space_size"] == 81


@pytest.mark.parametrize("strings", [False, True])
def test_sampled_audit_brackets_and_intervals_hold_the_rank(capsys, tmp_path, tiny_dir, library_model, strings):
    mode = ["--strings"] if strings else []
    report = run_json(capsys, write(tmp_path, STRINGS if strings else WORDED), "--prompt", PROMPT, "--regex", FORMAT,
                      "--target", tiny_dir, "--method", "sampled", "--samples", "1500", "--max-forwards", "0",
                      "--seed", "4", *mode)
    truth = exact_ranks(library_model, strings)
    covered = 0
    for row in report["items"]:
        rank = truth[row["canary"]]
        low, high = row["rank_bracket"]
        assert row["method"] == "sampled" and row["samples"] == 1500 and low <= rank <= high
        ci_lo, ci_hi = row["rank_interval"]
        covered += ci_lo <= rank <= ci_hi
        assert abs(math.log2(row["rank_estimate"] + 1) - math.log2(rank + 1)) < 0.5
        e_low, e_high = row["exposure_interval"]
        assert e_low <= row["exposure_bits"] <= e_high
    assert covered >= 3                     # 95% intervals: all four expected, one miss tolerated
    assert report["samples"] == 1500


def test_table_and_plot(capsys, tmp_path, tiny_dir, canaries_file):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "exposure.png"
    assert main(["audit", canaries_file, "--prompt", PROMPT, "--regex", FORMAT, "--target", tiny_dir,
                 "--samples", "200", "--max-forwards", "0", "--plot", str(plot)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("space: ") and "draws 200" in lines[0] and len(lines) == 2 + len(WORDED)
    assert all("sampled" in line for line in lines[2:])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_target_bits_grows_the_draws(capsys, tiny_dir, canaries_file):
    assert main(["audit", canaries_file, "--prompt", PROMPT, "--regex", FORMAT, "--target", tiny_dir, "--json",
                 "--samples", "64", "--max-forwards", "0", "--target-bits", "0.05", "--max-samples", "400"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert 64 < report["samples"] <= 400


@pytest.mark.parametrize("argv,needle", [
    (["EMPTY", "--regex", FORMAT], "holds no non-empty line"),
    (["MISSING", "--regex", FORMAT], "no such file"),
    (["CANARIES", "--regex", FORMAT, "--template", "My PIN is"], "--template must hold {canary} exactly once"),
    (["CANARIES", "--regex", FORMAT, "--template", "{canary} {canary}"], "it holds 2"),
    (["CANARIES", "--regex", "[12"], "invalid --regex"),
    (["CANARIES", "--regex", FORMAT, "--samples", "1"], "--samples must be >= 2"),
    (["CANARIES", "--regex", FORMAT, "--method", "exact", "--samples", "10"], "--method exact never samples"),
    (["CANARIES", "--regex", FORMAT, "--plot", "NOFOLDER"], "--plot: no such folder"),
    (["CANARIES", "--regex", FORMAT, "--target-bits", "0"], "--target-bits must be above 0"),
    (["CANARIES", "--regex", FORMAT, "--max-samples", "9000"], "--max-samples goes with --target-bits"),
    (["CANARIES", "--regex", FORMAT, "--target-bits", "0.1", "--max-samples", "10"], "--max-samples must be at least"),
    (["CANARIES", "--choices-file", "EMPTY"], "holds no non-empty line"),
])
def test_bad_input_is_one_line_before_the_model_loads(capsys, monkeypatch, tmp_path, canaries_file, argv, needle):
    files = {"EMPTY": tmp_path / "empty.txt", "MISSING": tmp_path / "missing.txt", "CANARIES": canaries_file,
             "NOFOLDER": tmp_path / "no" / "plot.png"}
    files["EMPTY"].write_text("\n\n")
    argv = [str(files[arg]) if arg in files else arg for arg in argv]

    def refuse(spec, **options):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr(enumerate_cli, "load_target", refuse)
    assert main(["audit", *argv, "--target", "any"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculum audit: error: "), captured.err
    assert needle in lines[0] and "Traceback" not in captured.err and captured.out == ""


@pytest.mark.parametrize("strings", [False, True])
def test_a_canary_outside_the_format_is_named(capsys, tmp_path, tiny_dir, strings):
    path = write(tmp_path, ["1231" if strings else "12 3 1", "12x" if strings else "12 x"])
    mode = ["--strings"] if strings else []
    assert main(["audit", path, "--prompt", PROMPT, "--regex", FORMAT, "--target", tiny_dir, *mode]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("canary '12x'" in err or "canary '12 x'" in err)
    assert "not a member" in err and "Traceback" not in err


def test_ctrl_c_stops_cleanly(capsys, monkeypatch, tiny_dir, canaries_file):
    import speculum.cli.audit as audit

    def interrupted(*args, **options):
        raise KeyboardInterrupt

    monkeypatch.setattr(audit, "estimate_ranks", interrupted)
    assert main(["audit", canaries_file, "--prompt", PROMPT, "--regex", FORMAT, "--target", tiny_dir]) == 130
    captured = capsys.readouterr()
    assert captured.err.strip() == "interrupted" and "Traceback" not in captured.err


# ------------------------------------------------------------------------------ bounded inputs, checked early
def refuse_to_load(monkeypatch) -> None:
    def refuse(spec, **options):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr(enumerate_cli, "load_target", refuse)


def one_line_error(capsys, argv) -> str:
    assert main(["audit", *argv, "--target", "any"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculum audit: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


def test_a_huge_canaries_file_is_refused_by_its_size_before_it_is_read(capsys, monkeypatch, tmp_path):
    from speculum.cli.audit import CANARY_BYTES, DEFAULT_MAX_CANARIES

    refuse_to_load(monkeypatch)
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as out:            # 100 MB, sparse: only its size is ever looked at
        out.truncate(100 * 2 ** 20)
    read = []
    monkeypatch.setattr("speculum.cli.constrained.read_lines", lambda *a, **k: read.append(a) or ["1"])
    line = one_line_error(capsys, [str(huge), "--regex", FORMAT])
    assert not read
    assert str(huge) in line and "104,857,600 bytes" in line
    assert f"{DEFAULT_MAX_CANARIES * CANARY_BYTES:,} bytes" in line and "--max-canaries" in line


def test_the_canary_limits_follow_max_canaries(capsys, monkeypatch, tmp_path):
    from speculum.cli.audit import CANARY_BYTES

    refuse_to_load(monkeypatch)
    path = write(tmp_path, ["12 3", "1 1", "2 2"])
    line = one_line_error(capsys, [path, "--regex", FORMAT, "--max-canaries", "2"])
    assert str(path) in line and "3 canaries" in line and "--max-canaries 2" in line
    path = write(tmp_path, ["1" * (2 * CANARY_BYTES)])
    line = one_line_error(capsys, [path, "--regex", FORMAT, "--max-canaries", "1"])
    assert f"{2 * CANARY_BYTES + 2:,} bytes" in line and f"{CANARY_BYTES:,} bytes" in line
    assert "--max-canaries must be >= 1" in one_line_error(capsys, [path, "--regex", FORMAT, "--max-canaries", "0"])
    with pytest.raises(AssertionError, match="the model loaded"):
        main(["audit", write(tmp_path, ["12 3", "1 1"]), "--regex", FORMAT, "--max-canaries", "2", "--target", "x"])


@pytest.mark.parametrize("where", ["a folder", "inside a file", "unknown format"])
def test_an_unwritable_plot_path_is_refused_before_the_model_loads(capsys, monkeypatch, tmp_path, canaries_file,
                                                                   where):
    refuse_to_load(monkeypatch)
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    if where == "unknown format":
        pytest.importorskip("matplotlib")
    plot = {"a folder": tmp_path, "inside a file": blocker / "plot.png",
            "unknown format": tmp_path / "plot.nosuchformat"}[where]
    line = one_line_error(capsys, [canaries_file, "--regex", FORMAT, "--plot", str(plot)])
    assert "--plot" in line and str(plot) in line
    assert not (tmp_path / "plot.nosuchformat").exists()


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0,
                    reason="root writes into a read-only folder")
def test_a_plot_in_a_read_only_folder_is_refused(capsys, monkeypatch, tmp_path, canaries_file):
    refuse_to_load(monkeypatch)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        line = one_line_error(capsys, [canaries_file, "--regex", FORMAT, "--plot", str(locked / "plot.png")])
    finally:
        locked.chmod(0o700)
    assert "--plot" in line and "cannot write" in line and not (locked / "plot.png").exists()


def test_a_plot_path_checked_early_is_left_as_it_was(capsys, monkeypatch, tmp_path, canaries_file):
    """The early check writes nothing: no stray empty file when the command later fails."""
    pytest.importorskip("matplotlib")
    refuse_to_load(monkeypatch)
    plot = tmp_path / "plot.png"
    with pytest.raises(AssertionError, match="the model loaded"):
        main(["audit", canaries_file, "--regex", FORMAT, "--plot", str(plot), "--target", "any"])
    assert not plot.exists()
    plot.write_bytes(b"kept")
    with pytest.raises(AssertionError, match="the model loaded"):
        main(["audit", canaries_file, "--regex", FORMAT, "--plot", str(plot), "--target", "any"])
    assert plot.read_bytes() == b"kept"


@pytest.mark.parametrize("json_output", [False, True])
def test_an_astronomically_large_format_is_sized_in_bits(capsys, tmp_path, tiny_dir, json_output):
    """'.{0,1000}' holds more strings than Python prints as an integer: the audit gives its size in bits."""
    argv = [write(tmp_path, ["1", "12"]), "--prompt", PROMPT, "--regex", ".{0,1000}", "--eos", "--max-len", "3",
            "--strings", "--target", tiny_dir, "--samples", "64"]
    if json_output:
        report = run_json(capsys, *argv)
        assert report["space_size"] is None and report["space_bits"] > 20_000
        assert all(row["exposure_bits"] > 20_000 for row in report["items"])
    else:
        assert main(["audit", *argv]) == 0
        assert capsys.readouterr().out.startswith("space: 2^2")
