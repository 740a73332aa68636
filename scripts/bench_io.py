"""What every benchmark script does the same way: a free rendezvous port for its spawned gloo
ranks, and its JSON report printed and (with ``--out``) written."""
from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, Optional


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def emit_report(report: Any, out: Optional[str | Path] = None, indent: int = 1) -> str:
    """Print the report as JSON; also write it to ``out`` (its folder created) when given."""
    text = json.dumps(report, indent=indent)
    print(text, flush=True)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return text
