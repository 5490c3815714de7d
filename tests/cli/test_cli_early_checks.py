"""What the command line can check without the model, it checks before the model loads: a regex's syntax,
support and automaton size, whether a member is a prefix of another without --eos, a Ray cluster's
address, the number of workers, a choices file's bytes and line lengths. Each is one line on stderr, exit
code 2, and the loader is never called."""
from __future__ import annotations

import os
import socket
import time

import pytest

import speculum.cli.enumerate as enumerate_cli
from speculum.cli import main

ENUM = ["enumerate", "x y", "--target", "any-model"]
RANK = ["rank", "x y", "--target", "any-model"]


@pytest.fixture(autouse=True)
def refuse_to_load(monkeypatch):
    """The model must never load: a test that reaches the loader fails."""
    def refuse(spec, **options):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr(enumerate_cli, "load_target", refuse)


def one_line_error(capsys, argv) -> str:
    started = time.monotonic()
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"speculum {argv[0]}: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert time.monotonic() - started < 10
    return lines[0]


def closed_port() -> int:
    with socket.socket() as probe:              # a port nobody listens on once the probe closes
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("argv,needles", [
    (ENUM + ["--regex", "(?=a)a", "--top-k", "3"], ["lookaheads and lookbehinds"]),
    (ENUM + ["--regex", "a(?<!b)", "--top-k", "3"], ["lookaheads and lookbehinds"]),
    (ENUM + ["--regex", "a?", "--top-k", "3"], ["--regex 'a?'", "proper prefix", "('' and 'a')", "--eos"]),
    (ENUM + ["--regex", "[0-9]+", "--top-k", "3"], ["proper prefix", "('0' and '00')", "--eos"]),
    (RANK + ["--text", "1", "--regex", "[0-9]+"], ["proper prefix", "--eos"]),
    (ENUM + ["--regex", "x{0}", "--top-k", "3"], ["only the empty string", "--eos"]),
    (ENUM + ["--regex", "[^\\s\\S]", "--top-k", "3", "--eos"], ["matches no string"]),
    (ENUM + ["--regex", " (a|b)*a(a|b){15}", "--top-k", "3"],
     ["invalid --regex ' (a|b)*a(a|b){15}'", "needs more than 10,000 states (the limit)"]),
    (ENUM + ["--regex", "\\p{L}{2}", "--top-k", "3"], ["unicode property classes (\\p{...}"]),
    (ENUM + ["--regex", "(a)\\1", "--top-k", "3"], ["invalid --regex", "unsupported"]),
    (ENUM + ["--length", "2", "--top-k", "3", "--workers", "1000"], ["--workers 1000", f"at most {os.cpu_count()}"]),
])
def test_input_errors_come_before_the_model(capsys, argv, needles):
    line = one_line_error(capsys, argv)
    for needle in needles:
        assert needle in line, line


def test_an_unreachable_ray_address_is_refused_before_the_model(capsys):
    pytest.importorskip("ray")
    port = closed_port()
    for argv in (ENUM + ["--length", "2", "--top-k", "3"], RANK + ["--text", "1"]):
        line = one_line_error(capsys, argv + ["--ray-address", f"127.0.0.1:{port}"])
        assert f"cannot reach the Ray cluster at 127.0.0.1:{port}" in line
    assert "HOST:PORT" in one_line_error(capsys, ENUM + ["--length", "2", "--top-k", "3", "--ray-address", "nowhere"])


def test_a_valid_code_point_range_reaches_the_model(capsys):
    """A CJK range written with escapes passes every check: the next step is loading the model."""
    with pytest.raises(AssertionError, match="the model loaded"):
        main(ENUM + ["--regex", " [\\u4e00-\\u9fff]{2}", "--top-k", "3"])


# ------------------------------------------------------------------------------------- choices files
def test_a_binary_choices_file_is_refused(capsys, tmp_path):
    noisy = tmp_path / "noise.bin"
    noisy.write_bytes(bytes(range(256)) * 12)                  # 3 KB holding NUL bytes
    line = one_line_error(capsys, ENUM + ["--choices-file", str(noisy)])
    assert f"--choices-file {str(noisy)!r} looks binary" in line
    invalid = tmp_path / "invalid.txt"
    invalid.write_bytes(bytes(range(0x80, 0x100)) * 12 + b"\nok\n")   # no NUL, mostly invalid UTF-8
    assert "looks binary" in one_line_error(capsys, ENUM + ["--choices-file", str(invalid)])


def test_a_little_invalid_utf8_is_a_warning_not_an_error(capsys, tmp_path):
    mostly_text = tmp_path / "latin1.txt"
    mostly_text.write_bytes(b"caf\xe9\n" + b"".join(b"Paris %d\n" % i for i in range(50)))
    with pytest.raises(AssertionError, match="the model loaded"):
        main(ENUM + ["--choices-file", str(mostly_text)])
    assert "not valid UTF-8" in capsys.readouterr().err


def test_an_overlong_line_is_refused_naming_it(capsys, tmp_path):
    from speculum.cli.constrained import MAX_LINE_CHARS

    path = tmp_path / "long.txt"
    path.write_text("short\n" + "x" * (MAX_LINE_CHARS + 1) + "\nshort too\n")
    line = one_line_error(capsys, ENUM + ["--choices-file", str(path)])
    assert "line 2" in line and f"{MAX_LINE_CHARS:,} characters" in line
    path.write_text("short\n" + "x" * MAX_LINE_CHARS + "\n")
    with pytest.raises(AssertionError, match="the model loaded"):
        main(ENUM + ["--choices-file", str(path)])
    line = one_line_error(capsys, RANK + ["--file", str(tmp_path / "missing.txt")])
    assert "--file: no such file" in line


@pytest.mark.parametrize("draft,needle", [
    ("lookup", "--draft: draft 'lookup' proposes fixed tokens; enumeration needs a draft model (none, ngram, "),
    ("llamacpp:/no/such.gguf", "--draft: draft llamacpp: no GGUF file at '/no/such.gguf'"),
    ("layers:0", "--draft: draft layers:K: layers must be an integer >= 1, got 0"),
])
def test_enumerates_draft_is_checked_by_the_draft_registry(capsys, draft, needle):
    """``--draft`` of ``enumerate`` goes through the registry's check for enumeration (``check_draft``'s
    ``purpose``): the messages are the registry's, after ``--draft:``, as for ``generate``."""
    assert needle in one_line_error(capsys, [*ENUM, "--length", "2", "--top-k", "2", "--draft", draft])


def test_check_draft_checks_for_the_purpose_given():
    from speculum.cli.checks import CLIError, check_draft
    from speculum.drafts import ENUMERATION

    check_draft("llamacpp", purpose=ENUMERATION)
    check_draft("lookup")
    with pytest.raises(CLIError, match="^--draft: draft 'llamacpp' is an enumeration draft"):
        check_draft("llamacpp")
    with pytest.raises(CLIError, match="^--draft: draft 'lookup' proposes fixed tokens"):
        check_draft("lookup", purpose=ENUMERATION)
