"""The floors diagram of ``docs/architecture.md``, drawn from the import graph.

Why: a drawn architecture drifts from the code it describes (arrows that no import makes, packages that
moved). Here every arrow is an import: ``A --> B`` means a module of package ``B`` imports a module of
package ``A`` (string imports and imports inside functions included, see :mod:`speculum._devtools.imports`).
Arrows that a longer path already implies are left out (the transitive reduction), so the picture stays
readable and every arrow drawn is still an import. ``tests/project/test_architecture.py`` checks the document's
copy against the code.

    python -m speculum._devtools.architecture          # prints the mermaid block

Example:
    >>> edges = package_edges(Path(__file__).resolve().parents[1])
    >>> ("models", "decoding") in edges
    True
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from .imports import import_graph

__all__ = ["PACKAGES", "package_edges", "reduced", "diagram", "drawn_arrows"]

# The top-level packages, bottom floor first, with what each holds (the diagram's labels).
PACKAGES = {
    "validation": "argument checks, InputError",
    "models": "the protocol, reference models, PyTorch and llama.cpp backends, the checkpoint cache",
    "drafts": "what can draft: registry, proposers, twins, fitted n-gram",
    "distributed": "RayPool: a model's forwards on Ray actors",
    "decoding": "speculative decoding: verification rule, γ policy, one generation, scheduler",
    "enumeration": "exact index, certificates, formats, estimation beyond the frontier",
    "serving": "engine, OpenAI-compatible HTTP",
    "cli": "speculum generate | enumerate | rank | audit | serve | demo",
}


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else None


def package_edges(root: Path) -> set[tuple[str, str]]:
    """``(imported package, importing package)`` for every import between two of :data:`PACKAGES`."""
    edges, _ = import_graph(root)
    out = set()
    for module, targets in edges.items():
        for target in targets:
            lower, upper = _package(target), _package(module)
            if lower and upper and lower != upper:
                out.add((lower, upper))
    return out


def reduced(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """``edges`` without those a path of two or more edges already implies."""
    def reachable(start: str, skip: tuple[str, str]) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            for a, b in edges:
                if a == node and (a, b) != skip and b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen
    return {(a, b) for a, b in edges if b not in reachable(a, (a, b))}


def diagram(root: Path) -> str:
    """The mermaid flowchart of the floors: one node per package, one arrow per reduced import edge."""
    order = list(PACKAGES)
    lines = ["flowchart BT"]
    lines += [f'  {name}["{name}/<br/>{label}"]' for name, label in PACKAGES.items()]
    for a, b in sorted(reduced(package_edges(root)), key=lambda e: (order.index(e[0]), order.index(e[1]))):
        lines.append(f"  {a} --> {b}")
    return "\n".join(lines)


def drawn_arrows(markdown: str) -> set[tuple[str, str]]:
    """The arrows ``A --> B`` of the mermaid blocks of ``markdown``."""
    arrows = set()
    for block in re.findall(r"```mermaid\n(.*?)```", markdown, flags=re.S):
        for line in block.splitlines():
            names = [part.strip() for part in line.split("-->")]
            arrows |= {(a, b) for a, b in zip(names, names[1:]) if a and b}
    return arrows


def main() -> int:
    print("```mermaid\n" + diagram(Path(__file__).resolve().parents[1]) + "\n```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
