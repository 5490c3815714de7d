"""The house's floors: imports only run down, no circles, function-level imports only for optional extras
(each saying why), and no module reaches into another module's private names.

These checks read the source (``speculum._devtools.imports``); each fails on the first new circle, back-edge,
unexplained lazy import or cross-module private access, naming it.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from speculum._devtools import architecture, imports

SRC = Path(imports.__file__).resolve().parents[1]


def test_the_import_graph_has_no_circle_no_back_edge_and_no_unexplained_lazy_import():
    report = imports.check(SRC)
    assert report == {"circles": [], "back_edges": [], "unexplained_local_imports": []}


def test_the_checker_finds_a_circle_and_a_back_edge():
    edges = {"speculum.models.a": {"speculum.models.b"}, "speculum.models.b": {"speculum.models.a"}}
    assert imports.circles(edges) == [["speculum.models.a", "speculum.models.b"]]
    found = imports.back_edges([("speculum.models.base", 3, "speculum.serving.engine", True, "")])
    assert found == ["speculum.models.base:3 imports speculum.serving.engine"]
    assert imports.local_imports([("speculum.cli.x", 5, "torch", True, "import torch")]) == \
        ["speculum.cli.x:5 imports torch"]
    assert imports.local_imports([("speculum.cli.x", 5, "torch", True, "import torch  # the llm extra")]) == []


def test_the_checker_sees_imports_by_string(tmp_path):
    """A literal ``import_module("speculum...")`` and a lazy ``_LAZY`` table entry are edges: a circle
    closed by one is found, and a lazy entry up the floors is a back-edge unless LAZY_ALLOWED names it."""
    root = tmp_path / "speculum"
    (root / "models").mkdir(parents=True)
    (root / "drafts").mkdir()
    (root / "__init__.py").write_text("")
    (root / "models" / "__init__.py").write_text('_LAZY = {"Thing": "speculum.drafts.thing"}\n')
    (root / "models" / "a.py").write_text("from . import b\n")
    (root / "models" / "b.py").write_text(
        "import importlib\n\n\ndef late():\n    # reached on first use\n"
        "    return importlib.import_module('speculum.models.a')\n")
    (root / "drafts" / "__init__.py").write_text("")
    (root / "drafts" / "thing.py").write_text("")
    report = imports.check(root)
    assert report["circles"] == [["speculum.models.a", "speculum.models.b"]]
    assert report["back_edges"] == ["speculum.models:1 imports speculum.drafts.thing"]
    assert report["unexplained_local_imports"] == []


def test_the_documented_floors_are_the_ones_the_code_draws():
    """docs/architecture.md's diagram is the one drawn from the imports: every arrow is an import."""
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    drawn = architecture.drawn_arrows(doc)
    assert drawn and drawn <= architecture.package_edges(SRC)
    assert "```mermaid\n" + architecture.diagram(SRC) + "\n```" in doc, \
        "regenerate the diagram: python -m speculum._devtools.architecture"


def test_the_capability_table_lists_every_capability():
    from dataclasses import fields

    from speculum.models.base import Capabilities

    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `(\w+)`", doc[doc.index("## Declared capabilities"):], flags=re.M))
    assert {field.name for field in fields(Capabilities)} <= listed


def test_the_reduction_keeps_only_arrows_no_path_implies():
    edges = {("a", "b"), ("b", "c"), ("a", "c"), ("c", "d")}
    assert architecture.reduced(edges) == {("a", "b"), ("b", "c"), ("c", "d")}


# Third-party private names the backends must use: torch's int8 and oneDNN kernels have no public spelling.
THIRD_PARTY_PRIVATE = {"_weight_int8pack_mm", "_packed_params", "_reorder_linear_weight", "_linear_pointwise"}


def private_access(path: Path, root: Path = SRC) -> list[str]:
    """``obj._name`` where ``_name`` is defined nowhere in the module (so it is another module's private),
    and ``from x import _name``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defined = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and node.attr not in defined and node.attr not in THIRD_PARTY_PRIVATE):
            found.append(f"{path.relative_to(root)}:{node.lineno} .{node.attr}")
        if isinstance(node, ast.ImportFrom):
            found += [f"{path.relative_to(root)}:{node.lineno} imports {alias.name}" for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_no_module_reaches_into_another_modules_private_names():
    found = [hit for path in sorted(SRC.rglob("*.py")) for hit in private_access(path)]
    assert found == []


def test_the_private_access_check_sees_a_reach(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from x import _hidden\n\ndef f(index):\n    return index._queries\n", encoding="utf-8")
    assert sorted(private_access(probe, tmp_path)) == ["probe.py:1 imports _hidden", "probe.py:4 ._queries"]


def test_no_isinstance_switch_on_cache_types_outside_the_cache_module():
    cache_names = {"OwnCache", "SlotCache", "DynamicCache", "KVCache"}
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).as_posix() == "models/hf/kv/cache.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if named & cache_names:
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert found == []


def test_create_app_reads_on_a_screen():
    from speculum.serving import openai_api

    tree = ast.parse(Path(openai_api.__file__).read_text(encoding="utf-8"))
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "create_app")
    assert function.end_lineno - function.lineno + 1 <= 60


# The parts of enumeration, bottom to top: a part imports only the parts before it (its package docstring).
ENUMERATION_LAYERS = ["formats", "index", "enumerable", "estimation", "rescored", "labels"]


def test_enumeration_parts_import_only_the_parts_below():
    """formats imports nothing else of enumeration (it could stand alone), the exact index only formats, and
    so on up; the package's lazy table, which names them all, is not a part."""
    edges, _ = imports.import_graph(SRC)
    prefix = "speculum.enumeration."

    def part(module: str) -> str | None:
        return module[len(prefix):].split(".")[0] if module.startswith(prefix) else None

    assert {part(module) for module in edges} - {None} == set(ENUMERATION_LAYERS)
    upward = [f"{module} imports {target}" for module, targets in sorted(edges.items()) if part(module)
              for target in sorted(targets)
              if part(target) and ENUMERATION_LAYERS.index(part(target)) > ENUMERATION_LAYERS.index(part(module))]
    assert upward == []
