"""Reading what wandb wrote offline: the records of ``run-<id>.wandb`` transaction logs.

The file is a 7-byte header (":W&B", magic 0xBEE1, version) and then LevelDB's log format: 32 KiB
blocks of chunks, each with a header (crc32c, length, type: full, first, middle, last) holding
serialized ``wandb_internal_pb2.Record`` messages. ``wandb sync`` replays these records to the
server, so they are what the server will see (a rewind included: the run record's branch point).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

_HEADER = struct.Struct("<4sHB")
_CHUNK = struct.Struct("<IHB")
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, _ = _HEADER.unpack_from(data, 0)
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a wandb transaction log"
    pos, pending = _HEADER.size, b""
    while pos + _CHUNK.size <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _CHUNK.size:  # a block's tail too short for a chunk header is padding
            pos += left_in_block
            continue
        _, length, kind = _CHUNK.unpack_from(data, pos)
        body = data[pos + _CHUNK.size: pos + _CHUNK.size + length]
        pos += _CHUNK.size + length
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0
            continue
        if kind in (_FULL, _FIRST):
            pending = body
        else:
            pending += body
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


@dataclass
class OfflineRun:
    run_id: str
    group: str
    job_type: str
    tags: List[str]
    config: Dict[str, Any]
    branch_point: Optional[tuple]  # (run id, metric, value) of a rewind, else None
    history: List[Dict[str, Any]] = field(default_factory=list)  # one dict per history record

    @property
    def steps(self) -> List[int]:
        return [int(h["_step"]) for h in self.history]


def read_offline_run(run_file: Path) -> OfflineRun:
    run, history = None, []
    for record in records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run" and run is None:
            r = record.run
            config = {item.key: json.loads(item.value_json) for item in r.config.update}
            branch = (r.branch_point.run, r.branch_point.metric, r.branch_point.value) \
                if r.HasField("branch_point") and r.branch_point.run else None
            run = OfflineRun(r.run_id, r.run_group, r.job_type, list(r.tags), config, branch)
        elif kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            if record.history.HasField("step"):
                row.setdefault("_step", record.history.step.num)
            history.append(row)
    assert run is not None, f"{run_file} has no run record"
    run.history = history
    return run


def offline_runs(run_dir: Path) -> List[OfflineRun]:
    """Every offline wandb run under ``run_dir/wandb``, oldest first."""
    files = sorted((Path(run_dir) / "wandb").glob("offline-run-*/run-*.wandb"))
    return [read_offline_run(f) for f in files]


def server_curve(runs: List[OfflineRun], metric: str) -> Dict[int, Any]:
    """What the server holds for ``metric`` after syncing ``runs`` of one id in order: a rewind to
    step S keeps the history through S and appends the new segment (wandb-core takes S + 1 as the
    next step); without one, re-logged steps not above the last one are dropped."""
    curve: Dict[int, Any] = {}
    for run in runs:
        if run.branch_point is not None:
            assert run.branch_point[0] == run.run_id and run.branch_point[1] == "_step", run.branch_point
            curve = {s: v for s, v in curve.items() if s <= run.branch_point[2]}
        last = max(curve, default=-1)
        for row in run.history:
            if metric in row and row["_step"] > last:
                curve[int(row["_step"])] = row[metric]
    return curve
