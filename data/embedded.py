"""The offline default corpus: English text that ships inside every CPython installation.

Two parts, both present wherever this project runs, so ``train.py`` works with no download:

1. ``pydoc_data.topics`` — the Python Language Reference topics that ``help("for")`` prints
   (79 topics, about 465K characters in CPython 3.11), cut into their titled sections.
2. Optionally (``data.embedded_docstrings``, on in conf/data/embedded.yaml) the docstrings of
   the standard library's own modules, classes and functions (only those of at least
   ``_MIN_DOCSTRING_CHARS`` characters, which are prose rather than one-liners; tests,
   idlelib and site-packages excluded), one document per module: about 1.37M more characters
   in CPython 3.11. Read from the .py sources as text, never imported.

The text follows the Python version, so the manifest records the version and a digest of the
topics; a different Python is a different corpus and is refused under the same folder name.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import pathlib
import re
import sys
import sysconfig
from typing import Dict, Iterator, List

_UNDERLINE = re.compile(r"^([*=\-~^\"])\1{2,}$")
_MIN_DOCSTRING_CHARS = 200
_STANDALONE_TRIPLE_QUOTED = re.compile(r"^[ \t]*[rRuU]?(\"\"\"|\'\'\')(.*?)\1[ \t]*$", re.M | re.S)
_SKIPPED_PARTS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__",
                  "turtledemo", "lib2to3"}


def _sections(topic_text: str) -> List[str]:
    """Split at reStructuredText-style headings (a title line followed by an underline)."""
    lines = topic_text.split("\n")
    starts = [0]
    for i in range(1, len(lines)):
        if _UNDERLINE.match(lines[i].strip()) and lines[i - 1].strip() and i - 1 > starts[-1]:
            starts.append(i - 1)
    starts.append(len(lines))
    sections = ["\n".join(lines[a:b]).strip() for a, b in zip(starts, starts[1:])]
    return [s for s in sections if s]


def topic_documents() -> Iterator[str]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield from _sections(topics[name])


def _stdlib_sources() -> List[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted((p for p in root.rglob("*.py")
                   if not _SKIPPED_PARTS.intersection(p.relative_to(root).parts)),
                  key=lambda p: p.relative_to(root).as_posix())


def docstring_documents() -> Iterator[str]:
    yield from _docstring_documents()


@functools.lru_cache(maxsize=1)
def _docstring_documents() -> tuple:
    """One document per stdlib module: its long docstrings, in source order.

    A docstring here is a triple-quoted string that stands alone on its lines (found with a
    regular expression, which is much cheaper than ``ast`` parsing the stdlib source). Prepare
    reads the corpus twice (tokenizer training, then tokenization), so the result is kept.
    """
    documents = []
    for path in _stdlib_sources():
        try:
            source = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        docstrings = [inspect.cleandoc(m.group(2)) for m in _STANDALONE_TRIPLE_QUOTED.finditer(source)]
        docstrings = [d for d in docstrings if len(d) >= _MIN_DOCSTRING_CHARS]
        if docstrings:
            documents.append("\n\n".join(docstrings))
    return tuple(documents)


def embedded_documents(include_docstrings: bool = True) -> Iterator[str]:
    """Documents in a fixed order: the topics, then (optionally) the stdlib docstrings."""
    yield from topic_documents()
    if include_docstrings:
        yield from docstring_documents()


def embedded_corpus_identity(include_docstrings: bool) -> Dict[str, str]:
    """Cheap to compute (no stdlib parsing), so a reused folder is checked in milliseconds."""
    digest = hashlib.sha256()
    for doc in topic_documents():
        digest.update(doc.encode("utf-8"))
        digest.update(b"\0")
    identity = {"topics_sha256": digest.hexdigest()}
    if include_docstrings:
        identity["stdlib_docstrings_of_python"] = sys.version.split()[0]
    return identity
