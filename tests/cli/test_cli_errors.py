"""How ``speculum`` ends: user errors as one line (exit 2), bugs with their traceback, a closed stdout quietly.

The fast tests drive ``speculum.cli.main`` on the tiny reference target of ``reference_target.py``; the
broken-pipe tests run the command in a subprocess whose stdout pipe the reader closes, as ``| head`` does.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import speculum.cli.enumerate as enumerate_cli
from support.reference_target import PATCH_LOADER, REFERENCE_TARGET as REFERENCE
from speculum.cli import BROKEN_PIPE_EXIT, main
from speculum.validation import InputError

pytestmark = pytest.mark.usefixtures("reference_target")
ENUMERATE = ["enumerate", "0 1", "--length", "2", "--top-k", "3", "--target", REFERENCE]
# The console entry point, run by the interpreter of these tests (the installed script may be elsewhere).
ENTRY = "import sys; from speculum.cli import main; sys.exit(main())"
# `generate` on a reference Markov target that reads characters (no torch to import: the test stays fast).
STAND_IN_TARGET = """
import speculum.models.backends
from speculum.models import MarkovModel
target = MarkovModel.random(64, seed=0)
target.encode = lambda text, chat=None: [ord(character) % 64 for character in text]
target.decode = lambda tokens: "".join(chr(48 + token) for token in tokens)
speculum.models.backends.load_model = lambda *args, **kwargs: target
"""


@pytest.mark.parametrize("error", [IndexError, KeyError, RuntimeError, TypeError, AttributeError, ValueError])
def test_an_internal_error_keeps_its_traceback(monkeypatch, capsys, error):
    def broken(spec, **options):
        raise error("an internal failure")

    monkeypatch.setattr(enumerate_cli, "load_target", broken)
    with pytest.raises(error, match="an internal failure"):
        main(ENUMERATE)
    assert "error:" not in capsys.readouterr().err  # not dressed up as a user error


@pytest.mark.parametrize("error", [InputError, FileNotFoundError])
def test_a_user_error_is_one_line_and_exit_2(monkeypatch, capsys, error):
    def refuse(spec, **options):
        raise error("no such target")

    monkeypatch.setattr(enumerate_cli, "load_target", refuse)
    assert main(ENUMERATE) == 2
    assert capsys.readouterr().err == "speculum enumerate: error: no such target\n"


def test_no_command_is_a_usage_error_on_stderr(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: speculum") and "error: a COMMAND is required" in captured.err


def test_help_still_goes_to_stdout_with_exit_0(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0 and "enumerate" in capsys.readouterr().out


def run_into_closed_pipe(argv, *, read_first: int, entry: str = ENTRY) -> subprocess.CompletedProcess:
    """Run ``speculum argv`` (``entry``: its Python code) with stdout a pipe the reader closes after
    ``read_first`` bytes."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONIOENCODING="utf-8")
    process = subprocess.Popen([sys.executable, "-c", entry, *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env)
    if read_first:
        assert len(process.stdout.read(read_first)) == read_first
    process.stdout.close()
    try:
        stderr = process.stderr.read()
        process.wait(timeout=120)
    finally:
        process.kill()
    return subprocess.CompletedProcess(argv, process.returncode, b"", stderr)


def test_enumerate_into_head_stops_quietly():
    # 2000 rows are ~90 KB: more than a pipe holds, so the writer meets the closed pipe mid-table.
    done = run_into_closed_pipe(["enumerate", "0 1", "--length", "5", "--top-k", "2000", "--target", REFERENCE],
                                read_first=5, entry=PATCH_LOADER + ENTRY)
    assert done.returncode == BROKEN_PIPE_EXIT, done.stderr.decode()
    assert done.stderr == b""  # no traceback, no "Exception ignored" from the flush at exit


def test_generate_into_a_closed_pipe_stops_quietly():
    # A prompt with bytes that are not UTF-8, as a shell passes $'\xff': a warning, then the text streams.
    argv = [b"generate", b"the cat \xff\xfe", b"--raw", b"--max-new-tokens", b"400"]
    done = run_into_closed_pipe(argv, read_first=0, entry=STAND_IN_TARGET + ENTRY)
    assert done.returncode == BROKEN_PIPE_EXIT, done.stderr.decode()
    assert done.stderr.decode().splitlines() == [
        "speculum generate: warning: PROMPT is not valid UTF-8: invalid bytes replaced with U+FFFD"]


def test_a_broken_model_directory_is_a_one_line_error(tmp_path, capsys):
    """transformers reports a broken directory from deep inside (here OSError on bad JSON): the user sees
    one line naming the folder, not a traceback."""
    (tmp_path / "config.json").write_text("{not json")
    assert main(["generate", "hi", "--target", str(tmp_path), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path) in err and "cannot load a model" in err
