"""The code stands alone: no source file cites a document outside the repository, and only the command
line draws progress bars. (No probing for model hooks: tests/decoding/test_drafter.py, test_enumeration_support.py.)"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "src" / "speculum").rglob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
# Documents that live outside the repository (the team's notes), and issue-tracker references.
OUTSIDE = re.compile(r"\b(field|style|design|anchors)\.md\b|\.\./shared|\bissue\s*#?\d+", re.IGNORECASE)


def test_no_source_file_cites_a_document_outside_the_repository():
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for path in SOURCES
                 for number, line in enumerate(path.read_text().splitlines(), start=1)
                 if OUTSIDE.search(line)]
    assert not offenders, "\n".join(offenders)


def test_the_outside_pattern_catches_citations_and_spares_plain_words():
    assert OUTSIDE.search("see field.md, weakness 4") and OUTSIDE.search("(issue 6)")
    assert not OUTSIDE.search("an issue with the tokenizer")


def test_only_the_cli_draws_progress_bars():
    """The library reports progress through callbacks; a bar belongs to the command line."""
    offenders = [str(path.relative_to(ROOT)) for path in (ROOT / "src" / "speculum").rglob("*.py")
                 if "cli" not in path.parts and re.search(r"^\s*(from tqdm|import tqdm)", path.read_text(), re.M)]
    assert not offenders, offenders
