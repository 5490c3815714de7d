"""What the sub-commands accept: flags checked before any model loads, text that is not UTF-8, warnings
for flags without effect, special tokens in ``enumerate``'s text, progress bars off outside a terminal.

The model loaders are replaced by stand-ins wherever loading is beside the point; the rest runs on a tiny
random model directory.
"""
from __future__ import annotations

import io
import json
import sys

import pytest

pytest.importorskip("transformers")

import speculum  # noqa: E402
import speculum.models  # noqa: E402
import speculum.models.backends  # noqa: E402
from support.hf_tiny import save_tiny_model  # noqa: E402
from speculum.cli import main  # noqa: E402
from speculum.cli.checks import utf8_text  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("inputs") / "tiny"))


@pytest.fixture
def no_loading(monkeypatch):
    """Every model loader the CLI reaches fails the test: a bad flag must be refused before a load."""
    def loader(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    for module in (speculum, speculum.models, speculum.models.backends):
        monkeypatch.setattr(module, "load_model", loader)


def one_error_line(capsys, code: int, command: str) -> str:
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"speculum {command}: error: "), captured.err
    return lines[0]


@pytest.mark.parametrize("argv,flag", [
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--top-k", "0"], "--top-k"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-p", "0"], "--top-p"),
    (["--seed", "-3"], "--seed"),
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--draft", "layers:0"], "--draft"),
    (["--draft", "layers:two"], "--draft"),
    (["--draft", "./no/such/model"], "--draft"),
    (["--backend", "llamacpp", "--draft", "int8"], "--draft"),
])
def test_generate_refuses_bad_flags_before_loading(no_loading, capsys, argv, flag):
    line = one_error_line(capsys, main(["generate", "hi", *argv]), "generate")
    assert flag in line


def test_an_unknown_draft_lists_the_draft_kinds(no_loading, capsys):
    line = one_error_line(capsys, main(["generate", "hi", "--draft", "lookahead"]), "generate")
    assert "--draft" in line and "'lookahead'" in line
    for kind in ("none", "lookup", "ngram", "int8", "bf16", "layers:K", "PATH", "smollm2-135m"):
        assert kind in line


def test_demo_refuses_bad_flags_before_its_banner(no_loading, capsys):
    line = one_error_line(capsys, main(["demo", "--max-new-tokens", "-1"]), "demo")
    assert "--max-new-tokens" in line
    line = one_error_line(capsys, main(["demo", "--draft", "lookahead"]), "demo")
    assert "--draft" in line and "lookup" in line  # one line: no "loading ..." banner came first


@pytest.mark.parametrize("argv,needle", [
    (["enumerate", "hi", "--length", "2", "--top-k", "2", "--draft", "lookahead"], "llamacpp:GGUF"),
    (["enumerate", "hi", "--length", "2", "--top-k", "2", "--draft", "lookup"], "draft model"),
    (["enumerate", "hi", "--length", "2", "--top-k", "2", "--draft", "llamacpp:/no/such.gguf"], "no GGUF file"),
    (["enumerate", "hi", "--length", "2", "--top-k", "2", "--assumed-gap", "-1"], "--assumed-gap"),
    (["enumerate", "hi", "--length", "2", "--top-k", "2", "--seed", "-1"], "--seed"),
    (["rank", "hi", "--text", "there", "--seed", "-1"], "--seed"),
])
def test_enumerate_and_rank_refuse_bad_flags_before_loading(no_loading, capsys, argv, needle):
    assert needle in one_error_line(capsys, main(argv), argv[0])


# ---------------------------------------------------------------------------------------- not UTF-8
def test_lone_surrogates_become_replacement_characters(capsys):
    # "\udcff": how Python's argv decoding carries the byte 0xff; "\ud800" cannot stand for a byte.
    assert utf8_text("the cat \udcff\udcfe", "PROMPT", "generate") == "the cat \ufffd\ufffd"
    assert utf8_text("a \ud800 b", "--text", "rank") == "a \ufffd b"
    assert utf8_text("h\u00e9llo \u2603", "PROMPT", "generate") == "h\u00e9llo \u2603"
    assert capsys.readouterr().err.splitlines() == [
        "speculum generate: warning: PROMPT is not valid UTF-8: invalid bytes replaced with U+FFFD",
        "speculum rank: warning: --text is not valid UTF-8: invalid bytes replaced with U+FFFD",
    ]


def generate_json(capsys, tiny_dir, prompt):
    code = main(["generate", prompt, "--raw", "--target", tiny_dir, "--max-new-tokens", "6", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out), captured.err


def test_generate_reads_a_prompt_that_is_not_utf8(tiny_dir, capsys):
    expected, quiet = generate_json(capsys, tiny_dir, "the cat \ufffd\ufffd")
    got, err = generate_json(capsys, tiny_dir, "the cat \udcff\udcfe")  # argv bytes 0xff 0xfe
    assert got["tokens"] == expected["tokens"] and got["prompt_tokens"] == expected["prompt_tokens"]
    assert quiet == "" and "warning: PROMPT is not valid UTF-8" in err


def test_generate_reads_stdin_that_is_not_utf8(tiny_dir, capsys, monkeypatch):
    expected, _ = generate_json(capsys, tiny_dir, "the cat \ufffd\ufffd\nsat")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"the cat \xff\xfe\r\nsat")))
    got, err = generate_json(capsys, tiny_dir, "-")
    assert got["tokens"] == expected["tokens"] and got["prompt_tokens"] == expected["prompt_tokens"]
    assert "warning: stdin is not valid UTF-8" in err


def test_enumerate_and_rank_read_text_that_is_not_utf8(tiny_dir, capsys):
    assert main(["enumerate", "the \udcff", "--raw", "--length", "1", "--top-k", "2", "--target", tiny_dir]) == 0
    assert "speculum enumerate: warning: prompt is not valid UTF-8" in capsys.readouterr().err
    assert main(["rank", "the cat", "--raw", "--text", "sat \udcfe", "--target", tiny_dir]) == 0
    assert "speculum rank: warning: --text is not valid UTF-8" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ warnings
def test_sampling_flags_at_temperature_zero_are_flagged(tiny_dir, capsys):
    base = ["generate", "the cat", "--raw", "--target", tiny_dir, "--max-new-tokens", "2"]
    assert main(base + ["--top-k", "5", "--seed", "3"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == ["speculum generate: warning: --top-k, --seed have no effect at --temperature 0 "
                        "(greedy decoding)"]
    assert main(base + ["--top-k", "5", "--seed", "3", "--temperature", "0.7"]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("dtype,warned", [(["--dtype", "float16"], True), ([], False)])
def test_dtype_with_llamacpp_is_flagged(monkeypatch, capsys, dtype, warned):
    def absent(*args, **kwargs):
        raise FileNotFoundError("no GGUF file here")

    monkeypatch.setattr(speculum.models.backends, "load_model", absent)
    assert main(["generate", "hi", "--backend", "llamacpp", *dtype]) == 2
    err = capsys.readouterr().err
    assert ("warning: --dtype has no effect with --backend llamacpp" in err) == warned
    assert err.splitlines()[-1] == "speculum generate: error: no GGUF file here"


# ---------------------------------------------------------------------------------- enumerate's text
def test_enumerate_shows_special_tokens(tiny_dir, capsys):
    code = main(["enumerate", "the cat", "--raw", "--eos", "--max-len", "2", "--top-k", "3", "--target", tiny_dir,
                 "--json"])
    rows = json.loads(capsys.readouterr().out)["items"]
    assert code == 0 and len(rows) == 3
    model = speculum.models.backends.load_model(tiny_dir)
    for row in rows:  # every continuation ends in eos, and the text says so
        assert row["tokens"][-1] == model.eos_token_id and row["text"].endswith("</s>")


# ------------------------------------------------------------------------------------- progress bars
@pytest.fixture
def bars_enabled():
    from huggingface_hub.utils import enable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    enable_progress_bars()
    yield
    hf_logging.enable_progress_bar()
    enable_progress_bars()


@pytest.mark.parametrize("argv", [["generate", "hi"], ["enumerate", "hi", "--length", "1", "--top-k", "1"]])
def test_progress_bars_are_off_when_stderr_is_not_a_terminal(bars_enabled, monkeypatch, capsys, argv):
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as hf_logging

    seen = {}

    def loader(*args, **kwargs):
        seen.update(kwargs, transformers_bars=hf_logging.is_progress_bar_enabled(),
                    hub_bars=not are_progress_bars_disabled())
        raise FileNotFoundError("stop here")

    for module in (speculum.models, speculum.models.backends):
        monkeypatch.setattr(module, "load_model", loader)
    assert main(argv) == 2  # capsys: stderr is not a terminal
    capsys.readouterr()
    assert seen["progress"] is False and not seen["transformers_bars"] and not seen["hub_bars"]


def test_generate_json_gives_the_targets_exact_log_prob_of_each_token(tiny_dir, capsys):
    """``token_logprobs``: the target's own log-prob of each generated token, equal to scoring the output."""
    from speculum.models.hf import HFModel

    report, _ = generate_json(capsys, tiny_dir, "the cat")
    target = HFModel.from_pretrained(tiny_dir)
    prompt = target.encode("the cat", chat=False)
    assert len(report["token_logprobs"]) == len(report["tokens"]) > 0
    context = list(prompt)
    for token, logprob in zip(report["tokens"], report["token_logprobs"]):
        assert abs(target.next_logprobs([context])[0][token] - logprob) < 1e-4
        context.append(token)
