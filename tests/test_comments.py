"""Comments explain the code; measurements live in the report (docs/RESULTS.md) and the journal.

Refused in the comments and docstrings of the product packages, train.py and conf/: dates,
session numbers, "the rule before" and signed loss gaps (a "+0.032" is a measurement, and a
measurement in a comment goes stale the day the code changes).
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path
from typing import Iterator, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "models", "data", "scape", "sdp", "evaluation", "trainer")
LOG_PATTERNS = {
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "a session": re.compile(r"\bsession", re.IGNORECASE),
    "a rule's history": re.compile(r"\b(rule|default) (before|then)\b|\bused to be\b|\bmeasured (worse|better)\b",
                                   re.IGNORECASE),
    "a signed loss gap": re.compile(r"(?<![\w.])[+\u2212-]0\.\d{3,}\b"),
}


def _python_prose(path: Path) -> Iterator[Tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield (node.body[0].lineno, doc)


def _yaml_prose(path: Path) -> Iterator[Tuple[int, str]]:
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if "#" in line:
            yield number, line[line.index("#"):]


def _files() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((REPO / package).rglob("*.py"))
    yield REPO / "train.py"
    yield from sorted((REPO / "conf").rglob("*.yaml"))


def find_logs(path: Path) -> Iterator[str]:
    prose = _yaml_prose(path) if path.suffix == ".yaml" else _python_prose(path)
    for number, text in prose:
        for what, pattern in LOG_PATTERNS.items():
            match = pattern.search(text)
            if match:
                yield f"{path.relative_to(REPO)}:{number}: {what} ({match.group(0)!r})"


def test_no_comment_or_docstring_logs_a_measurement_or_a_history():
    found = [hit for path in _files() for hit in find_logs(path)]
    assert not found, "measurements and history belong in docs/RESULTS.md or docs/JOURNAL.md:\n" + "\n".join(found)


@pytest.mark.parametrize("text", ["# the nineteenth session's rule", "# since 2026-12-05",
                                  "# the rule before cost less", "# the default before", "# measured worse",
                                  '"""Measured: -0.0125 behind."""'])
def test_the_check_sees_each_kind(tmp_path, text):
    path = tmp_path / "probe.py"
    path.write_text(f"{text}\nx = 1\n" if text.startswith("#") else f"{text}\n")
    assert any(p.search(prose) for _, prose in _python_prose(path) for p in LOG_PATTERNS.values()), text
