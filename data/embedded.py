"""The offline default corpus: the language-reference topics that ship inside every CPython.

``pydoc_data.topics`` holds the text ``help("for")`` prints — about 465K characters of English
prose and code from the Python Language Reference (79 topics in CPython 3.11). It is present on
every machine that runs this project, so ``train.py`` works with no download and no network.
The exact text varies a little between Python versions; the manifest records a digest of it.

Each topic is cut into its titled sections so the corpus has a few hundred documents, enough for
a document-level held-out validation split.
"""
from __future__ import annotations

import hashlib
import re
from typing import Iterator, List

_UNDERLINE = re.compile(r"^([*=\-~^\"])\1{2,}$")


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


def embedded_documents() -> Iterator[str]:
    """Documents in a fixed order (sorted topic names, then section order)."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield from _sections(topics[name])


def embedded_corpus_digest() -> str:
    """Identifies the corpus version (it follows the Python version) in the manifest."""
    digest = hashlib.sha256()
    for doc in embedded_documents():
        digest.update(doc.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()
