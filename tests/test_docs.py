"""The documents' countable targets: a README read in two minutes, one current report, one journal
of what lost, and only the artifacts those cite under docs/results."""
from __future__ import annotations

import re
from pathlib import Path

from tests.train_helpers import REPO, load_script

README = REPO / "README.md"
RESULTS = REPO / "docs" / "RESULTS.md"
JOURNAL = REPO / "docs" / "JOURNAL.md"
ARTIFACTS = REPO / "docs" / "results"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _lines(path: Path) -> list:
    return path.read_text().splitlines()


def test_readme_is_short_and_starts_with_its_first_command():
    lines = _lines(README)
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the target is 200"
    first = next(i for i, line in enumerate(lines, 1) if line.strip() == "bash scripts/quickstart.sh")
    assert first <= 40, f"the first command is on line {first}; the target is line 40"
    assert any(line.strip() == "bash scripts/test.sh" for line in lines)


def test_readme_holds_no_dated_findings():
    text = README.read_text()
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b|\bUTC\b|\bsession\b", text)


def test_every_local_link_in_the_readme_resolves():
    targets = [t for t in LINK.findall(README.read_text()) if not re.match(r"[a-z]+:", t)]
    assert any(t.startswith("docs/") for t in targets)
    missing = [t for t in targets if not (REPO / t.split("#")[0]).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_every_local_link_in_the_docs_pages_resolves():
    missing = []
    for page in sorted((REPO / "docs").glob("*.md")):
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                missing.append(f"{page.name}: {target}")
    assert not missing, f"broken links: {missing}"


def test_the_report_and_the_journal_stay_short():
    assert len(_lines(RESULTS)) <= 400, f"docs/RESULTS.md has {len(_lines(RESULTS))} lines; the target is 400"
    assert len(_lines(JOURNAL)) <= 300, f"docs/JOURNAL.md has {len(_lines(JOURNAL))} lines; the target is 300"


def test_the_journal_is_one_table_of_six_columns():
    rows = [[cell.strip() for cell in line.strip()[1:-1].split("|")] for line in _lines(JOURNAL) if line.startswith("|")]
    assert rows[0] == ["rule", "setting", "number", "why it lost", "last commit", "artifact"]
    assert len(rows) >= 3
    bad = [row for row in rows if len(row) != 6]
    assert not bad, f"journal rows without six cells: {bad}"


def test_docs_results_holds_at_most_60_files_and_3_mb():
    files = [p for p in ARTIFACTS.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    assert len(files) <= 60, f"docs/results holds {len(files)} files; the target is 60"
    assert size <= 3 * 2**20, f"docs/results holds {size / 2**20:.1f} MiB; the target is 3"


def test_docs_results_holds_only_what_the_documents_cite_and_all_of_it():
    report = load_script("report")
    cited = set(report.cited_artifacts())
    present = {p.name for p in ARTIFACTS.iterdir() if p.is_file()}
    optional = {"network_wire.json", "gpu_check.json", report.TEST_SUITE, *report.EVALUATION.values()}
    assert not present - cited, f"docs/results files no document cites (delete them): {sorted(present - cited)}"
    assert not cited - present - optional, f"cited but missing: {sorted(cited - present - optional)}"
