"""The import graph of ``speculum``: circles between modules, imports that run back up the floors, and imports
made inside functions.

Imports by string count as imports: ``importlib.import_module("speculum....")`` with a literal name (an
f-string counts by its literal head), and each entry of a package's lazy ``_LAZY`` name table (resolved
on first attribute access). A lazy entry that runs up the floors is allowed only where :data:`LAZY_ALLOWED`
names it, with its reason; allowed entries are left out of the circle search too.

The floors, bottom to top: ``validation`` < ``models`` < ``drafts`` / ``distributed`` < ``decoding`` /
``enumeration`` < ``serving`` < ``cli``. A module may import from its own floor and the floors below; an import of a higher
floor is a back-edge. Circles count imports inside functions too (they only
hide a circle). Imports inside functions are allowed only for optional extras loaded lazily, each with a
one-line reason in a comment on the import or the line above it.

    python -m speculum._devtools.imports            # prints the problems; exit status 1 if any

Example:
    >>> report = check(Path(__file__).resolve().parents[1])
    >>> sorted(report)
    ['back_edges', 'circles', 'unexplained_local_imports']
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

__all__ = ["FLOORS", "LAZY_ALLOWED", "import_graph", "circles", "back_edges", "local_imports", "check"]

# Higher number = higher floor. Top-level modules not listed (e.g. ``speculum/__init__``) are unconstrained.
FLOORS = {"validation": 0, "_devtools": 0, "models": 1, "drafts": 2, "distributed": 2, "decoding": 3,
          "enumeration": 3, "serving": 4, "cli": 5, "__main__": 6}
PACKAGE = "speculum"

# (importing module, imported module) -> why a lazy table may name a higher floor.
LAZY_ALLOWED = {
    ("speculum.models", "speculum.drafts.proposers"):
        "compatibility API: PromptLookup and NGramProposer were first named in speculum.models",
}


def _string_imports(name: str, is_package: bool, tree: ast.AST) -> list[tuple[ast.AST, str, bool]]:
    """``(node, module, lazy)`` for every import by string in ``tree``: ``import_module`` calls with a literal
    (or f-string head) name inside the package, and the entries of a module-level ``_LAZY`` dict."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and node.args and isinstance(node.func, (ast.Attribute, ast.Name))
                and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"):
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                text = first.value
            elif isinstance(first, ast.JoinedStr) and first.values and isinstance(first.values[0], ast.Constant):
                text = str(first.values[0].value).rstrip(".")
            else:
                continue
            if text.startswith("."):
                text = package + text
            if text.startswith(PACKAGE):
                found.append((node, text, False))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
                isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            for value in node.value.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    text = package + value.value if value.value.startswith(".") else value.value
                    if text.startswith(PACKAGE):
                        found.append((value, text, True))
    return found


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level:
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith(PACKAGE):
        return []
    if node.module is None or node.level and not node.module:
        return [f"{target}.{alias.name}" for alias in node.names]
    return [target] + [f"{target}.{alias.name}" for alias in node.names]


def import_graph(root: Path) -> tuple[dict[str, set[str]], list[tuple[str, int, str, bool, str]]]:
    """``(edges, imports)``: module -> the speculum modules it imports, at module level or inside a function
    (not under ``if TYPE_CHECKING``: those never run), and every import as ``(module, line, target, inside a
    function, the source lines of the import and the one above it)``."""
    files = {_module_name(root, path): path for path in root.rglob("*.py")}
    edges: dict[str, set[str]] = {name: set() for name in files}
    imports = []
    for name, path in files.items():
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        tree = ast.parse(source)
        is_package = path.name == "__init__.py"
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        in_function = {id(n) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                targets = _resolve(name, is_package, node)
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            local = id(node) in in_function
            context = "\n".join(lines[max(0, node.lineno - 2): node.end_lineno])
            for target in targets or [node.module or ""]:
                imports.append((name, node.lineno, target, local, context))
            if id(node) in typing_only:
                continue
            for target in targets:
                _add_edge(edges, files, name, target)
        for node, target, lazy in _string_imports(name, is_package, tree):
            context = "\n".join(lines[max(0, node.lineno - 2): node.end_lineno])
            # A lazy table entry runs on attribute access (never at import): explained by the table itself.
            imports.append((name, node.lineno, target, id(node) in in_function and not lazy,
                            context + ("  # lazy table" if lazy else "")))
            if not (lazy and (name, target) in LAZY_ALLOWED):
                _add_edge(edges, files, name, target)
    return edges, imports


def _add_edge(edges: dict[str, set[str]], files: dict, name: str, target: str) -> None:
    while target and target not in files:        # a name imported from a module: the module
        target = target.rpartition(".")[0]
    if target and target != name and not name.startswith(target + "."):
        edges[name].add(target)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(out)


def _floor(module: str) -> int | None:
    parts = module.split(".")
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


def back_edges(imports: list[tuple[str, int, str, bool, str]]) -> list[str]:
    """Imports (at module level or inside a function) of a higher floor than the importer's."""
    out = []
    for module, line, target, _, context in imports:
        if not target.startswith(PACKAGE + ".") or (context.endswith("# lazy table") and (module, target) in LAZY_ALLOWED):
            continue
        mine, theirs = _floor(module), _floor(target)
        if mine is not None and theirs is not None and theirs > mine:
            out.append(f"{module}:{line} imports {target}")
    return sorted(set(out))


def local_imports(imports: list[tuple[str, int, str, bool, str]]) -> list[str]:
    """Imports inside functions without a ``#`` comment giving the reason (on the import or the line above)."""
    first: dict[tuple[str, int], str] = {}
    for module, line, target, local, context in imports:
        if local and "#" not in context:
            first.setdefault((module, line), target)
    return sorted(f"{module}:{line} imports {target}" for (module, line), target in first.items())


def check(root: Path) -> dict[str, list]:
    edges, imports = import_graph(root)
    return {"circles": circles(edges), "back_edges": back_edges(imports),
            "unexplained_local_imports": local_imports(imports)}


def main() -> int:
    report = check(Path(__file__).resolve().parents[1])
    for kind, problems in report.items():
        print(f"{kind}: {len(problems)}")
        for problem in problems:
            print(f"  {' <-> '.join(problem) if isinstance(problem, list) else problem}")
    return 1 if any(report.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
