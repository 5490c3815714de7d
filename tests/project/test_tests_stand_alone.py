"""The tests' own floors: a test file takes its helpers from ``tests/support`` and never imports another test
file, and a test reaches into private names (``obj._name``, ``from x import _name``, ``setattr(obj, "_name")``)
only where :data:`ALLOWED` lists it, with why.

A private name a test needs is a seam the source lacks: give the source a public one (a read-only property,
a ``forget()``), or, where none would serve the source, list the reach here.
"""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

# (file under tests/, private name) -> why the test reaches it.
ALLOWED = {
    # Other libraries' privates, with no public spelling.
    ("project/test_docs.py", "_actions"): "argparse lists a parser's options in its private _actions",
    ("models/test_backends.py", "_actions"): "argparse lists a parser's options in its private _actions",
    ("project/test_docs.py", "_SubParsersAction"): "argparse's subcommand action has no public type",
    ("models/hf/test_grouped.py", "_reverse_permute_weights"):
        "transformers' GGUF loader's own permutation, the reference the rows are checked against",
    # Failure injection and call counting on a private step, where no public seam would serve the source.
    ("models/test_llamacpp.py", "_decode"): "records every token llama.cpp decodes (no public hook)",
    ("models/test_model_cache.py", "_file_sha256"): "counts the files hashed: a cache hit must hash none",
    ("models/test_model_cache.py", "_dequantise_into"): "stands in for the GGUF conversion (minutes of work)",
    ("models/test_model_cache.py", "_load_converted"): "stands in for loading the converted model",
    ("models/test_model_cache.py", "_stamp"): "forges the stat stamps, as bit rot would leave them",
    ("models/test_load_progress.py", "_dequantise_into"): "stands in for the GGUF conversion (minutes of work)",
    ("models/test_load_progress.py", "_load_converted"): "stands in for loading the converted model",
    ("models/test_load_progress.py", "_load_gguf"): "stands in for loading from the GGUF file",
    ("models/test_gguf_loading.py", "_dequantise_into"): "stands in for (or fails) the GGUF conversion",
    ("models/test_gguf_loading.py", "_load_converted"): "stands in for loading the converted model",
    ("models/hf/test_threads.py", "_busy_seconds"): "the CPU time other processes take, made up",
    ("models/hf/test_threads.py", "_own_seconds"): "this process's CPU time, made up",
    ("distributed/test_ray_pool.py", "_worker_spec"): "the target spec workers load, pointed at the reference",
    ("serving/test_serve_echo_rounds.py", "_generate"):
        "times each generation step (a public per-step time would change /metrics)",
    ("serving/test_serve_echo_rounds.py", "_score_round"):
        "times each scoring round (a public per-round time would change /metrics)",
    ("serving/test_serve.py", "_waiting"): "holds the engine's queue mutex as its own thread would, to show "
                                           "a shutdown signal never waits for it",
    ("serving/test_serve.py", "_lock"): "holds the engine's lock as its own thread would (as _waiting)",
    # Private helpers used or checked directly: pure functions whose public callers would hide the case.
    ("models/test_reference.py", "_gelu"): "the plain-loop reference forward reuses the layer functions",
    ("models/test_reference.py", "_layer_norm"): "the plain-loop reference forward reuses the layer functions",
    ("models/test_vocabulary.py", "_unicode_to_byte"): "checked against transformers' bytes_to_unicode",
    ("enumeration/test_exposure_estimate.py", "_rank_bracket"): "the certified bracket at a float-rounding edge",
    ("serving/test_serve_echo_rounds.py", "_shares"): "the split of a round's budget, checked by itself",
    ("models/hf/test_grouped.py", "_transformers_rows"): "the row order checked against transformers' own",
    ("enumeration/test_constrained_limits.py", "_BudgetedCrawl"):
        "the budgeted determinisation must build interegular's own automaton",
    ("models/hf/test_precision.py", "_SELF_CHECK_FLOAT32_BYTES"): "the load-time probe's budget, set to 0",
    ("models/test_backends.py", "_LAZY"): "each backend's loader module, replaced by a recording stand-in",
    # Absence checked: the CLI modules share one count formatter rather than private copies.
    ("cli/test_cli_constrained.py", "_count"): "asserted absent (hasattr)",
    ("cli/test_cli_constrained.py", "_size"): "asserted absent (hasattr)",
    # Internal state a test inspects, where no caller of the library needs it.
    ("decoding/test_speculative.py", "_pooled"): "the controller's pooled acceptance statistics",
    ("drafts/test_proposers.py", "_lock"): "a clone must not share its original's lock",
}

ATTRIBUTE_CALLS = {"setattr", "getattr", "delattr", "hasattr"}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def imported_test_modules(tree: ast.AST) -> list[str]:
    """The ``test_*`` modules a file imports (``import test_x``, ``from test_x import y``, ``from . import test_x``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module] if node.module else [alias.name for alias in node.names]
        else:
            continue
        found += [name for name in names if any(part.startswith("test_") for part in name.split("."))]
    return found


def private_reaches(tree: ast.AST) -> set[str]:
    """Private names the file reaches that it does not define itself: ``obj._name`` (not on ``self`` /
    ``cls``), ``from x import _name`` and ``setattr(obj, "_name", ...)`` (``monkeypatch.setattr`` too)."""
    own = {node.name for node in ast.walk(tree)
           if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    own |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            found |= {alias.name for alias in node.names if is_private(alias.name)}
        elif isinstance(node, ast.Call):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if called in ATTRIBUTE_CALLS:
                strings = [arg.value for arg in node.args[:2]
                           if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
                found |= {text.split(".")[-1] for text in strings if is_private(text.split(".")[-1])}
    return found - own


def suite_files() -> list[Path]:
    return sorted(path for path in TESTS.rglob("*.py") if "__pycache__" not in path.parts)


def test_no_test_file_imports_another():
    found = [f"{path.relative_to(TESTS)} imports {name}" for path in suite_files()
             for name in imported_test_modules(ast.parse(path.read_text(encoding="utf-8")))]
    assert found == [], "move the shared helpers into tests/support/"


def test_tests_reach_only_the_private_names_listed():
    found = {(path.relative_to(TESTS).as_posix(), name) for path in suite_files()
             for name in private_reaches(ast.parse(path.read_text(encoding="utf-8")))}
    assert sorted(found - ALLOWED.keys()) == [], "use a public seam, or list the reach in ALLOWED with why"
    assert sorted(ALLOWED.keys() - found) == [], "no test reaches these any more: drop them from ALLOWED"


def test_the_checks_see_an_import_of_a_test_file_and_a_private_reach():
    tree = ast.parse("import test_a\nfrom test_b import x\nfrom . import test_c\nfrom support.greedy import g\n"
                     "from m import _hidden\n\nclass Own:\n    def __init__(self):\n        self._mine = 1\n\n"
                     "def f(engine, monkeypatch, own):\n    monkeypatch.setattr(engine, '_step', None)\n"
                     "    monkeypatch.setattr('pkg.mod._helper', None)\n    return engine._queue, own._mine\n")
    assert imported_test_modules(tree) == ["test_a", "test_b", "test_c"]
    assert private_reaches(tree) == {"_hidden", "_step", "_helper", "_queue"}
