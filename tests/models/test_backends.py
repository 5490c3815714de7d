"""The backend table (speculum.models.backends): every backend loads through ``load_model`` with the options
it declares, the command line and the Ray pool's model spec read their choices and checks from it, an
unknown backend is refused in one line naming the known ones, and a backend added to the table alone is
offered everywhere. The loaders are replaced by recorders: nothing here needs torch or llama.cpp.
"""
from __future__ import annotations

import gc
import importlib
import subprocess
import sys
import types

import pytest

import speculum
import speculum.models.backends as backends
from speculum.cli import build_parser, main
from speculum.distributed import ModelSpec
from speculum.models.backends import BACKENDS, Backend, backend_named, load_model
from speculum.validation import InputError

ALL_OPTIONS = dict(dtype="bfloat16", progress=False, prepack=False, verify=True)


@pytest.fixture
def recorded(monkeypatch):
    """Every backend's loader replaced by one recording ``(backend, name_or_path, options)``."""
    calls = []
    for entry in BACKENDS.values():
        module = importlib.import_module(backends._LAZY[entry.loader])

        def record(name_or_path, _name=entry.name, **options):
            calls.append((_name, name_or_path, options))
            return f"a {_name} model"

        monkeypatch.setattr(module, entry.loader, record)
    return calls


def subcommand_actions(command: str) -> dict:
    subparsers = next(action for action in build_parser()._actions if action.dest == "command")
    return {action.dest: action for action in subparsers.choices[command]._actions}


@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_backend_loads_through_load_model_with_the_options_it_declares(recorded, name):
    entry = BACKENDS[name]
    assert load_model("some/model", backend=name, **ALL_OPTIONS) == f"a {name} model"
    expected = {key: value for key, value in ALL_OPTIONS.items()
                if key in entry.options or (key == "dtype" and entry.takes_dtype)}
    assert recorded == [(name, "some/model", expected)]


def test_the_flags_of_the_two_backends():
    hf, llamacpp = BACKENDS["hf"], BACKENDS["llamacpp"]
    assert list(BACKENDS) == ["hf", "llamacpp"] and backends.DEFAULT_BACKEND == "hf"
    assert hf.dtypes[0] == "float32" and hf.twin_drafts and hf.ray and hf.options == {"progress", "prepack", "verify"}
    assert not llamacpp.takes_dtype and llamacpp.fixed_dtype and not llamacpp.twin_drafts and llamacpp.ray
    assert llamacpp.options == frozenset() and llamacpp.dtype_advice("int8") is None
    assert (hf.opens, llamacpp.opens) == ("local model directory or GGUF file", "GGUF file")
    for entry in BACKENDS.values():  # every loader is named, on the models floor
        assert backends._LAZY[entry.loader].startswith("speculum.models.")
        assert not entry.advice or backends._LAZY[entry.advice].startswith("speculum.models.")
        assert entry.takes_dtype or entry.fixed_dtype  # a backend without dtypes says why


def test_the_hf_backends_dtypes_are_those_it_parses():
    pytest.importorskip("torch")
    from speculum.models.hf.precision import DTYPES

    assert BACKENDS["hf"].dtypes == tuple(DTYPES)


def test_importing_the_table_imports_no_backend():
    """Neither the table nor the command that reads it imports a backend's extras; the table alone imports
    no backend module at all."""
    check = "loaded = [m for m in {} if m in sys.modules]; assert not loaded, loaded"
    extras = ("torch", "transformers", "llama_cpp")
    modules = (*extras, "speculum.models.hf", "speculum.models.llamacpp", "speculum.models.hf_loading")
    subprocess.run([sys.executable, "-c", "import sys, speculum.models.backends; " + check.format(modules)],
                   check=True)
    subprocess.run([sys.executable, "-c", "import sys, speculum.cli.generate; " + check.format(extras)], check=True)


def test_an_unknown_backend_is_refused_in_one_line_naming_the_known_ones(capsys):
    for refuse in (lambda: load_model("smollm2-135m", backend="onnx"), lambda: backend_named("onnx"),
                   lambda: ModelSpec(backend="onnx")):
        with pytest.raises(InputError) as info:
            refuse()
        assert str(info.value) == "backend must be one of hf, llamacpp, got 'onnx'"
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--backend", "onnx"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--backend" in err and "'onnx'" in err and all(name in err for name in BACKENDS)


def test_the_command_line_reads_its_choices_from_the_table():
    for command in ("generate", "serve"):
        actions = subcommand_actions(command)
        assert tuple(actions["backend"].choices) == tuple(BACKENDS)
        assert all(f"{name}: {entry.summary}" in actions["backend"].help for name, entry in BACKENDS.items())
        assert set(actions["dtype"].choices) == {dtype for entry in BACKENDS.values() for dtype in entry.dtypes}
        assert all(entry.opens in actions["target"].help for entry in BACKENDS.values())


# ------------------------------------------------------------------------------------ a new backend
@pytest.fixture
def echo_backend(monkeypatch):
    """A backend added to the table and nowhere else: ``echo``, a Markov model, no dtypes, no twins."""
    module = types.ModuleType("echo_backend")
    module.loads = []

    def load_echo_model(name_or_path, **options):
        module.loads.append((name_or_path, options))
        model = speculum.models.MarkovModel.random(8, seed=0)
        model.encode = lambda text, chat=None: [ord(character) % 8 for character in text]
        model.decode = lambda tokens: "".join(chr(48 + token) for token in tokens)
        return model

    module.load_echo_model = load_echo_model
    monkeypatch.setitem(sys.modules, "echo_backend", module)
    monkeypatch.setitem(backends._LAZY, "load_echo_model", "echo_backend")
    monkeypatch.setitem(BACKENDS, "echo", Backend("echo", "load_echo_model", "a stand-in", "echo file",
                                                  fixed_dtype="an echo has no weights", options=frozenset({"verify"})))
    return module


def test_a_backend_added_to_the_table_is_offered_everywhere(echo_backend, capsys):
    assert "echo" in subcommand_actions("generate")["backend"].choices
    assert "echo: a stand-in" in subcommand_actions("serve")["backend"].help
    assert ModelSpec("m", backend="echo")().vocab_size == 8          # a Ray actor's load
    assert echo_backend.loads == [("m", {"verify": False})]              # the one option it takes
    with pytest.raises(InputError, match="one of hf, llamacpp, echo"):
        load_model("m", backend="ech")
    # The command line's checks: no twin draft on it, and --dtype has no effect.
    assert main(["generate", "hi", "--backend", "echo", "--draft", "layers:2"]) == 2
    assert capsys.readouterr().err.strip() == ("speculum generate: error: --draft layers:2 is built from the "
                                               "target's PyTorch weights: it needs --backend hf")
    assert main(["generate", "hi", "--backend", "echo", "--dtype", "int8", "--draft", "none",
                 "--max-new-tokens", "2", "--verify-cache"]) == 0
    assert "warning: --dtype has no effect with --backend echo (an echo has no weights)" in capsys.readouterr().err
    assert echo_backend.loads[-1] == ("smollm2-135m", {"verify": True})


def test_a_backend_without_ray_is_refused_by_the_model_spec(echo_backend, monkeypatch):
    monkeypatch.setitem(BACKENDS, "echo", Backend("echo", "load_echo_model", "a stand-in", "echo file", ray=False))
    with pytest.raises(InputError, match="'echo' does not load in a Ray pool's actors .*hf, llamacpp"):
        ModelSpec(backend="echo")


@pytest.mark.parametrize("enabled_before", [True, False])
@pytest.mark.parametrize("fails", [False, True])
def test_automatic_collection_is_paused_while_a_model_loads_and_then_as_it_was(monkeypatch, enabled_before, fails):
    """A load creates a model's worth of long-lived objects: no full collection walks them on the way, and
    the collector's state comes back afterwards, after a failed load too."""
    module = importlib.import_module(backends._LAZY[BACKENDS["hf"].loader])
    seen = []

    def load(name_or_path, **options):
        seen.append(gc.isenabled())
        if fails:
            raise FileNotFoundError(name_or_path)
        return "a model"

    monkeypatch.setattr(module, BACKENDS["hf"].loader, load)
    (gc.enable if enabled_before else gc.disable)()
    try:
        if fails:
            with pytest.raises(FileNotFoundError):
                load_model("missing", backend="hf")
        else:
            assert load_model("a model", backend="hf") == "a model"
        assert seen == [False] and gc.isenabled() == enabled_before
    finally:
        gc.enable()
