"""The evaluation corpora build from Debian packages, as plain text, the same bytes every time."""
import json
import shutil

import pytest

from tests.train_helpers import load_script

corpora = load_script("build_eval_corpora")
needs_debian = pytest.mark.skipif(
    shutil.which("dpkg") is None or shutil.which("groff") is None
    or corpora.package_version("manpages") is None,
    reason="needs Debian's dpkg, groff and the manpages package (scripts/build_eval_corpora.py --install)")


@needs_debian
def test_the_corpora_are_plain_text_and_rebuild_bit_for_bit(tmp_path):
    for out in (tmp_path / "a", tmp_path / "b"):
        assert corpora.main(["--out", str(out), "--limit", "8"]) == 0
    first, second = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in "ab")
    assert [e["sha256"] for e in first] == [e["sha256"] for e in second]
    assert {e["corpus"] for e in first} == {"manpages", "perl-stdlib"}
    pages = [json.loads(line)["text"] for line in (tmp_path / "a" / "manpages.jsonl").read_text().splitlines()]
    assert pages and all("NAME" in page for page in pages)
    roff = [line for page in pages for line in page.splitlines() if line.startswith((".TH", ".SH", "\\f"))]
    assert not roff, roff[:3]
    modules = [json.loads(line)["text"] for line in (tmp_path / "a" / "perl-stdlib.jsonl").read_text().splitlines()]
    assert len(modules) == 8 and all("package " in m or "=head" in m for m in modules)


@needs_debian
def test_a_missing_package_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(corpora.CORPORA["manpages"], "package", lambda: "no-such-package-xyz")
    with pytest.raises(SystemExit, match="no-such-package-xyz is not installed; rerun with --install"):
        corpora.main(["--out", str(tmp_path), "--corpus", "manpages"])
    assert not (tmp_path / "manpages.jsonl").exists()
