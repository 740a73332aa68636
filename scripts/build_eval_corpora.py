"""Build the evaluation corpora: text no default of this project was chosen on.

The tuning corpora are tinyshakespeare (English verse and prose) and this CPython's standard
library source (Python code); every shipped default was chosen on them. The evaluation corpora
are of other kinds and come from Debian packages any fresh machine can install, so anyone can
rebuild them bit for bit from the same package versions:

    manpages     English technical prose: every page of Debian's ``manpages`` package (the Linux
                 man-pages project's sections 1, 4, 5, 7 and 8), rendered to plain text by groff
    perl-stdlib  code of another language: every Perl module of ``perl-modules-<version>``

Each corpus is one JSON document per page or module (``{"text": ...}``) in path order, written
atomically, with a manifest (package versions, file counts, bytes, sha256) beside it. The
quality study reads them with ``--corpus DIR/manpages.jsonl``. Nothing here is committed: the
files are a few MB and rebuild in about a minute.

    python scripts/build_eval_corpora.py --out ~/.cache/scape-sdp/eval_corpora [--install]
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

DEFAULT_OUT = Path.home() / ".cache" / "scape-sdp" / "eval_corpora"
# groff: -k preconv (UTF-8 input), -t tbl tables, -P-cbou plain text (no overstrike, bold, underline),
# -rHY=0 no hyphenation (a word split over two lines is two tokens the model never sees elsewhere)
GROFF = ["groff", "-k", "-t", "-man", "-Tutf8", "-P-cbou", "-rHY=0"]


def perl_modules_package() -> str:
    """The Debian package holding this machine's Perl standard library (perl-modules-5.36, ...)."""
    version = subprocess.run(["perl", "-e", 'printf "%vd", $^V'], capture_output=True, text=True, check=True).stdout
    major_minor = ".".join(version.split(".")[:2])
    return f"perl-modules-{major_minor}"


def package_version(package: str) -> Optional[str]:
    proc = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def package_files(package: str, pattern: str) -> List[Path]:
    """The package's installed files whose path matches ``pattern``, sorted."""
    listing = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True, check=True).stdout
    regex = re.compile(pattern)
    return sorted(Path(line) for line in listing.splitlines() if regex.search(line) and Path(line).is_file())


def render_man_page(path: Path) -> str:
    """One man page as plain text; '' for a page that only points at another (``.so``)."""
    with gzip.open(path, "rb") as handle:
        source = handle.read()
    if source.lstrip().startswith(b".so "):
        return ""
    env = {**os.environ, "LC_ALL": "C.UTF-8", "MANWIDTH": "80"}
    proc = subprocess.run(GROFF, input=source, capture_output=True, env=env, check=True)
    text = proc.stdout.decode("utf-8", errors="replace")
    return re.sub(r"\n{3,}", "\n\n", "\n".join(_unjustified(line) for line in text.splitlines())).strip() + "\n"


def _unjustified(line: str) -> str:
    """A rendered line without the page's 7-column margin and the spaces justification adds."""
    body = line.strip()
    indent = max(0, len(line) - len(line.lstrip()) - 7)
    return " " * indent + re.sub(r"(?<=\S) {2,}(?=\S)", " ", body)


def read_module(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


CORPORA: Dict[str, Dict[str, object]] = {
    "manpages": {"package": lambda: "manpages", "files": r"^/usr/share/man/man\d/[^/]+\.gz$",
                 "read": render_man_page, "kind": "English technical prose (Linux man-pages)"},
    "perl-stdlib": {"package": perl_modules_package, "files": r"\.pm$",
                    "read": read_module, "kind": "code: the Perl standard library's modules"},
}


def install(packages: Iterable[str]) -> None:
    """apt-get install what is missing (root only); the corpora need nothing else."""
    missing = [p for p in packages if package_version(p) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise SystemExit(f"missing Debian packages {missing}: run as root with --install, or "
                         f"sudo apt-get install {' '.join(missing)}")
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True)


def write_corpus(out: Path, texts: Iterable[str]) -> Dict[str, object]:
    """The documents as JSONL, written atomically; its size, document count and sha256."""
    partial = out.with_name(out.name + ".partial")
    digest, documents = hashlib.sha256(), 0
    with partial.open("w", encoding="utf-8") as handle:
        for text in texts:
            if text.strip():
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                handle.write(line)
                digest.update(line.encode("utf-8"))
                documents += 1
    partial.replace(out)
    return {"path": str(out), "documents": documents, "bytes": out.stat().st_size, "sha256": digest.hexdigest()}


def build(name: str, out_dir: Path, limit: Optional[int] = None, workers: int = 2) -> Dict[str, object]:
    spec = CORPORA[name]
    package = spec["package"]()
    version = package_version(package)
    if version is None:
        raise SystemExit(f"{name}: the Debian package {package} is not installed; rerun with --install "
                         f"(as root) or apt-get install {package}")
    files = package_files(package, spec["files"])[:limit]
    if not files:
        raise SystemExit(f"{name}: {package} {version} has no files matching {spec['files']}")
    read: Callable[[Path], str] = spec["read"]
    with ThreadPoolExecutor(max_workers=workers) as pool:  # groff runs in subprocesses
        texts = pool.map(read, files)  # in path order
        record = write_corpus(out_dir / f"{name}.jsonl", texts)
    return {"corpus": name, "kind": spec["kind"], "package": package, "version": version,
            "files": len(files), **record}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the corpora and manifest.json")
    parser.add_argument("--corpus", choices=sorted(CORPORA), action="append",
                        help="build only this one (repeatable; default: all)")
    parser.add_argument("--install", action="store_true", help="apt-get install the Debian packages that are missing")
    parser.add_argument("--limit", type=int, default=None, help="the first N files of each (for tests)")
    args = parser.parse_args(argv)
    if shutil.which("dpkg") is None:
        raise SystemExit("the evaluation corpora are built from Debian packages: dpkg not found on this machine")
    names = args.corpus or sorted(CORPORA)
    if args.install:
        install(["groff-base", *(CORPORA[n]["package"]() for n in names)])
    if "manpages" in names and shutil.which("groff") is None:
        raise SystemExit("groff is needed to render the man pages: apt-get install groff-base (or pass --install)")
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = [build(name, args.out, args.limit) for name in names]
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for entry in manifest:
        print(f"{entry['corpus']}: {entry['documents']:,} documents, {entry['bytes']:,} bytes from "
              f"{entry['package']} {entry['version']} -> {entry['path']} (sha256 {entry['sha256'][:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
