"""Progress of the embedded model's one-time conversion: the library reports it through a callback and
never draws a bar; the ``speculum`` command draws one, on a terminal only.

The conversion is replaced by a stand-in that announces the real stages and writes three small files,
so these tests run in well under a second.
"""
from __future__ import annotations

import shutil
import sys

import pytest

pytest.importorskip("torch")

from speculum.models import hf_loading  # noqa: E402
from speculum.models.backends import load_model  # noqa: E402
from speculum.validation import InputError  # noqa: E402

KEY = "smollm2-135m"
FILES = {"config.json": b"{}", "model.safetensors": bytes(range(256)) * 64, "tokenizer.json": b"{}"}


@pytest.fixture
def converter(tmp_path, monkeypatch):
    """``load_model(KEY)`` through a cache in ``tmp_path``, converted by a stand-in; returns a dict whose
    ``fail_at`` names a stage at which the conversion raises (None: it succeeds)."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF" + bytes(1 << 16))
    state = {"fail_at": None, "cache": tmp_path / "cache"}
    monkeypatch.setenv("SPECULUM_CACHE", str(state["cache"]))
    monkeypatch.setattr(hf_loading, "embedded_gguf_path", lambda key: source)

    def convert(gguf, folder, progress):
        for stage in hf_loading.CONVERSION_STAGES:
            if progress is not None:
                progress(stage)
            if stage == state["fail_at"]:
                raise OSError("disk full")
        for name, content in FILES.items():
            (folder / name).write_bytes(content)

    monkeypatch.setattr(hf_loading, "_dequantise_into", convert)
    monkeypatch.setattr(hf_loading, "_load_converted",
                        lambda folder, key, **options: sorted(path.name for path in folder.iterdir()))
    monkeypatch.setattr(hf_loading, "_load_gguf", lambda gguf, key, **options: "loaded from the GGUF")
    return state


@pytest.fixture
def no_bars(monkeypatch):
    """Any tqdm bar created fails the test."""
    import tqdm
    import tqdm.auto

    def refuse(*args, **kwargs):
        raise AssertionError("the library drew a progress bar")

    for module in (tqdm, tqdm.auto):
        monkeypatch.setattr(module, "tqdm", refuse)


def test_load_model_reports_each_conversion_stage_to_a_callback(converter, no_bars):
    events = []
    assert load_model(KEY, progress=events.append)[-1] == "tokenizer.json"
    assert [(event.stage, event.step, event.final) for event in events] == [
        ("reading tokenizer", 0, False), ("de-quantising weights", 1, False), ("saving", 2, False),
        ("done", 3, True)]
    assert {(event.model, event.total) for event in events} == {(KEY, 3)}
    events.clear()
    load_model(KEY, progress=events.append)  # converted already: nothing to report
    assert events == []


def test_a_failed_conversion_ends_with_a_failed_event(converter, no_bars):
    converter["fail_at"] = "de-quantising weights"
    events = []
    assert load_model(KEY, progress=events.append) == "loaded from the GGUF"  # the cache is bypassed
    assert [(event.stage, event.step) for event in events] == [
        ("reading tokenizer", 0), ("de-quantising weights", 1), ("failed", 1)]


def test_progress_true_prints_plain_stage_lines_and_false_prints_nothing(converter, no_bars, capsys):
    load_model(KEY, progress=True)
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"speculum: converting {KEY} into the cache (once): reading tokenizer (1/3)",
        f"speculum: converting {KEY} into the cache (once): de-quantising weights (2/3)",
        f"speculum: converting {KEY} into the cache (once): saving (3/3)",
        f"speculum: converting {KEY} into the cache (once): done"]
    shutil.rmtree(converter["cache"] / f"{KEY}-float32")
    load_model(KEY, progress=False)
    assert capsys.readouterr().err == ""
    with pytest.raises(InputError, match="progress must be"):
        load_model(KEY, progress="yes")


@pytest.mark.parametrize("terminal", [True, False])
def test_the_cli_draws_the_conversion_bar_on_a_terminal_only(converter, monkeypatch, capsys, terminal):
    from speculum.cli import main

    def stop(folder, key, **options):
        raise ValueError("the stand-in stops here")

    monkeypatch.setattr(hf_loading, "_load_converted", stop)  # after the conversion: a one-line error
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    assert main(["rank", "0", "--text", "1"]) == 2
    err = capsys.readouterr().err
    assert "the stand-in stops here" in err and "speculum: converting" not in err  # no plain lines
    assert (f"converting {KEY} (once)" in err and "3/3" in err and "done" in err) is terminal
