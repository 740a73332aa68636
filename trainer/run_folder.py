"""A run owns its folder: one writer at a time, every start recorded, no resume into another run.

Lock. ``run.lock`` is created with O_CREAT | O_EXCL, which is atomic on local file systems and on
NFSv3+ / Lustre / GPFS, where ``flock`` is not (it is advisory per client, or silently local). It
holds the holder's host, pid (and the pid's start time, so a reused pid is not mistaken for the
holder), Slurm job id and start time; the holder touches it every ``HEARTBEAT_S`` seconds. A lock
is stale, and taken over, when its holder is on this host and its process is gone, or is on
another host and its heartbeat is older than ``STALE_AFTER_S``. Taking over goes through a second
O_EXCL file (``run.lock.break``), so two starts that both find a stale lock cannot both take it.
A job requeued by Slurm may start while its old allocation is still in its epilogue: a start whose
Slurm job id is the holder's waits up to ``REQUEUE_WAIT_S`` for it to let go. Under torchrun only
rank 0 takes the lock (``Trainer``); the other ranks learn the outcome from it.

History. ``config.yaml`` is the resolved config of the folder's first start and is never
rewritten; start N (N >= 2) writes ``config-N.yaml``. ``starts.jsonl`` has a line per start (who,
where, when, which config file) and one per end (state, step, why). A start that finds
``status.json`` saying "running" while no live process holds the lock records that start as
ended ``killed`` (it ended without a word: OOM killer, SIGKILL, a lost node) and says so.

Resume. A resume (``resume=auto`` or a checkpoint path) into a folder whose first start differs
from this one in a key that defines the run is refused, naming the keys, whether or not a
checkpoint exists: continuing would mix two runs in one record (and one wandb run, whose id the
folder keeps). The learning-rate schedule, clipping and how the work is done (paths, prefetch,
kernels, overlap) may change on resume: lowering ``optimizer.lr`` is the fix a non-finite stop
suggests.
"""
from __future__ import annotations

import datetime as dt
import errno
import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from omegaconf import OmegaConf

LOCK_FILE = "run.lock"
BREAK_FILE = "run.lock.break"
STARTS_FILE = "starts.jsonl"
FIRST_CONFIG = "config.yaml"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0
REQUEUE_WAIT_S = 120.0
# the sections whose values define what a run trains (model covers seq_len, train.global_batch_tokens the batch)
RUN_DEFINING = ("model", "optimizer", "data", "tokenizer", "sdp", "train.global_batch_tokens")
# ... except these, which change how, not what (or are the schedule a resume may lower)
MAY_CHANGE = frozenset({
    "data.cache_dir", "data.num_proc", "data.prefetch", "data.verify_checksums", "model.kernels", "sdp.plan_path",
    "optimizer.overlap_backward", "optimizer.offload_residual", "optimizer.lr", "optimizer.warmup_steps",
    "optimizer.min_lr_ratio", "optimizer.lr_schedule", "optimizer.decay_fraction", "optimizer.grad_clip"})
_CONFIG_N = re.compile(r"^config-(\d+)\.yaml$")


class RunFolderError(ValueError):
    """The run folder cannot be used by this start; the message names the holder or keys and the fix."""


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _pid_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (/proc), None where unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder_record() -> Dict[str, Any]:
    """Who this process is, as the lock and starts.jsonl record it."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_start": _pid_start(pid),
            "job_id": os.environ.get("SLURM_JOB_ID"), "started_at": _now()}


def describe(holder: Dict[str, Any]) -> str:
    job = f", Slurm job {holder['job_id']}" if holder.get("job_id") else ""
    return f"host {holder.get('host')} pid {holder.get('pid')}{job}, started {holder.get('started_at')}"


def stale_reason(holder: Dict[str, Any], heartbeat_age_s: float, me: Dict[str, Any]) -> Optional[str]:
    """Why the lock's holder is gone (the lock may be taken over), or None while it may be alive.

    On this host the process table decides (an alive process holds the lock however long it has
    been silent); on another host only the heartbeat can."""
    if holder.get("host") == me["host"]:
        pid = int(holder.get("pid", -1))
        if pid == me["pid"]:
            return "it is this process (an earlier start in it that did not let go)"
        if not _pid_alive(pid):
            return f"process {pid} is gone"
        if holder.get("pid_start") and _pid_start(pid) not in (None, holder["pid_start"]):
            return f"pid {pid} now belongs to another process"
        return None
    if heartbeat_age_s > STALE_AFTER_S:
        return f"its heartbeat is {heartbeat_age_s:.0f} s old (stale after {STALE_AFTER_S:.0f} s)"
    return None


def _read_lock(path: Path) -> Optional[tuple]:
    """(holder, heartbeat age in s) of a lock file, None if there is none; an unreadable lock
    (a holder killed while writing it) counts as a holder with no details."""
    try:
        text, mtime = path.read_text(), path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        holder = {}
    return holder, max(0.0, time.time() - mtime)


def _create_exclusive(path: Path, content: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    return True


class RunLock:
    """``run.lock`` of one run folder, held by this process from ``acquire`` to ``release``."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.me = holder_record()
        self.taken_over: Optional[str] = None  # the stale holder this start replaced, and why
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def acquire(self) -> "RunLock":
        deadline = time.time() + REQUEUE_WAIT_S
        for _ in range(100_000):  # each pass either takes the lock, waits, or sees a new state
            if _create_exclusive(self.path, json.dumps(self.me)):
                break
            found = _read_lock(self.path)
            if found is None:
                continue  # let go of between the two calls
            holder, age = found
            reason = stale_reason(holder, age, self.me)
            if reason is not None:
                if self._break(holder, reason):
                    break
                continue
            if holder.get("job_id") and holder.get("job_id") == self.me["job_id"] and time.time() < deadline:
                time.sleep(2.0)  # this job's previous allocation, requeued: it is ending
                continue
            raise RunFolderError(self._refusal(holder, age))
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _refusal(self, holder: Dict[str, Any], age: float) -> str:
        return (f"run folder {self.path.parent} is in use by {describe(holder)} (lock {self.path}, heartbeat "
                f"{age:.0f} s ago); two processes writing one run would mix its checkpoints and logs. Wait for "
                f"that run to end or choose another run_name. If that process is gone (e.g. its node was lost), "
                f"delete {self.path} and start again; a lock held on another host is taken over by itself "
                f"once its heartbeat is {STALE_AFTER_S:.0f} s old")

    def _break(self, holder: Dict[str, Any], reason: str) -> bool:
        """Replace a stale lock; False if another start is doing the same (or did it first)."""
        brk = self.path.with_name(BREAK_FILE)
        if not _create_exclusive(brk, json.dumps(self.me)):
            other = _read_lock(brk)
            if other is not None and other[1] > 60:  # a start killed while breaking
                brk.unlink(missing_ok=True)
            time.sleep(0.2)
            return False
        try:
            again = _read_lock(self.path)
            if again is not None and again[0] != holder:
                return False  # taken over by another start meanwhile
            self.path.unlink(missing_ok=True)
            if not _create_exclusive(self.path, json.dumps(self.me)):
                return False
            self.taken_over = f"{describe(holder)}: {reason}"
            return True
        finally:
            brk.unlink(missing_ok=True)

    def held(self) -> bool:
        found = _read_lock(self.path)
        return found is not None and found[0] == self.me

    def _beat(self) -> None:
        warned = False
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if self.held():
                    os.utime(self.path)
                elif not warned:
                    warned = True
                    print(f"warning: {self.path} no longer names this process: another start took the run "
                          f"folder over (this one was silent for {STALE_AFTER_S:.0f} s?)", flush=True)
            except OSError:
                pass  # a file system hiccup: the next beat tries again

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            if self.held():
                self.path.unlink()
        except OSError:
            pass  # never mask the error that ends the run


def holds_a_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` has files of a run (its lock alone is no run)."""
    run_dir = Path(run_dir)
    return run_dir.is_dir() and any(p.name not in (LOCK_FILE, BREAK_FILE) for p in run_dir.iterdir())


def _flat(tree: Any, prefix: str = "") -> Dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: Dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def defining_differences(first: Dict[str, Any], this: Dict[str, Any]) -> List[tuple]:
    """(key, first start's value, this start's) for each run-defining key whose value changed.

    Keys one side lacks (a config written before the key existed) are not compared."""
    old = _flat(OmegaConf.to_container(OmegaConf.create(first)))
    new = _flat(OmegaConf.to_container(OmegaConf.create(this)))
    return [(key, old[key], new[key]) for key in sorted(new)
            if key in old and old[key] != new[key] and key not in MAY_CHANGE
            and any(key == p or key.startswith(p + ".") for p in RUN_DEFINING)]


def run_definition(run_dir: Path) -> Optional[tuple]:
    """(resolved config, where it is) of the folder's first start: config.yaml, or for a folder
    without one the newest checkpoint's meta.json; None for a folder no run has started in."""
    from trainer.checkpoint import latest_checkpoint, read_meta

    first = Path(run_dir) / FIRST_CONFIG
    if first.is_file():
        return OmegaConf.to_container(OmegaConf.load(first)), str(first)
    ckpt = latest_checkpoint(Path(run_dir))
    if ckpt is not None and read_meta(ckpt).get("config"):
        return read_meta(ckpt)["config"], str(ckpt / "meta.json")
    return None


def check_same_run(run_dir: Path, resolved: Dict[str, Any], resume: str) -> None:
    """Refuse a resume into a folder whose run this config is not (see the module docstring)."""
    found = run_definition(run_dir)
    if found is None:
        return
    first, source = found
    changed = defining_differences(first, resolved)
    if not changed:
        return
    keys = ", ".join(key for key, _, _ in changed)
    was = ", ".join(f"{key}={_value(old)}" for key, old, _ in changed[:8])
    now = ", ".join(f"{key}={_value(new)}" for key, _, new in changed[:8])
    more = f" (and {len(changed) - 8} more)" if len(changed) > 8 else ""
    raise RunFolderError(
        f"resume={resume} into {run_dir}: its run was started with {was}{more}; this start has {now}. "
        f"These keys define the run ({keys}): continuing would record another run under this run's name, "
        f"config and wandb id. Resume with the run's values (they are in {source}), or give the new run "
        f"another run_name")


def _read_jsonl(path: Path) -> List[Dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill mid-write
    return out


def _write_json(path: Path, obj: Dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


class RunFolder:
    """A run's folder as one start uses it: ``claim`` (rank 0, before anything is written),
    ``record_start`` (with the resolved config), ``status`` while it runs, ``release`` at exit.
    On the other ranks every call but ``claim``'s caller's is a no-op (``is_main`` False)."""

    def __init__(self, run_dir: Path, is_main: bool) -> None:
        self.run_dir, self.is_main = Path(run_dir), is_main
        self.lock: Optional[RunLock] = None
        self.start: Optional[int] = None

    def claim(self, resolved: Dict[str, Any], resume: str) -> None:
        """Take the lock, record a previous start that never ended, and refuse a resume of
        another run; on a refusal the lock is let go and nothing in the folder has changed."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.lock = RunLock(self.run_dir).acquire()
        try:
            self._note_unended()
            if resume != "none":
                check_same_run(self.run_dir, resolved, resume)
        except BaseException:
            self.release()
            raise

    def _starts(self) -> List[Dict[str, Any]]:
        return [r for r in _read_jsonl(self.run_dir / STARTS_FILE) if "started_at" in r]

    def _append(self, record: Dict[str, Any]) -> None:
        with open(self.run_dir / STARTS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _note_unended(self) -> None:
        """status.json says "running" but no live process holds the folder: that start was killed."""
        path = self.run_dir / "status.json"
        try:
            status = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return
        if status.get("state") != "running":
            return
        starts = self._starts()
        last = starts[-1] if starts else {}
        who = describe(last) if last else "a start before starts.jsonl was kept"
        self._append({"start": last.get("start"), "ended": "killed", "step": status.get("step"), "at": _now(),
                      "noted_by": holder_record(),
                      "reason": "it ended without a word: status.json still said running and no live process "
                                "held the folder" + (f" (stale lock of {self.lock.taken_over})"
                                                     if self.lock and self.lock.taken_over else "")})
        _write_json(path, {"state": "killed", "step": status.get("step")})
        print(f"run folder {self.run_dir}: the previous start ({who}) never ended: status.json said running "
              f"at step {status.get('step')} and no live process holds the folder; recorded it as killed in "
              f"{STARTS_FILE}", flush=True)

    def record_start(self, resolved: Dict[str, Any], resumed_from: Optional[Path]) -> Optional[str]:
        """Write this start's resolved config (config.yaml for the first start, config-N.yaml for
        start N: never overwritten) and its line in starts.jsonl; returns the config file's name."""
        if not self.is_main:
            return None
        taken = [int(m.group(1)) for p in self.run_dir.iterdir() if (m := _CONFIG_N.match(p.name))]
        taken += [1] if (self.run_dir / FIRST_CONFIG).exists() else []
        self.start = max([len(self._starts()), *taken, 0]) + 1
        name = FIRST_CONFIG if self.start == 1 else f"config-{self.start}.yaml"
        tmp = self.run_dir / f".{name}.tmp"
        tmp.write_text(OmegaConf.to_yaml(OmegaConf.create(resolved)))
        os.replace(tmp, self.run_dir / name)
        me = self.lock.me if self.lock is not None else holder_record()
        self._append({"start": self.start, **me, "config": name,
                      "resumed_from": str(resumed_from) if resumed_from is not None else None})
        return name

    def status(self, state: str, step: int, reason: Optional[str] = None) -> None:
        """status.json (``reason`` says why a run failed); an end also goes into starts.jsonl."""
        if not self.is_main:
            return
        record = {"state": state, "step": step, **({"reason": reason} if reason else {})}
        _write_json(self.run_dir / "status.json", record)
        if state != "running":
            self._append({"start": self.start, "ended": state, "step": step, "at": _now(),
                          **({"reason": reason} if reason else {})})

    def failed(self, step: int, reason: str) -> None:
        """Record a failure, even on a full disk (the message is the run's error anyway)."""
        try:
            self.status("failed", step, reason)
        except OSError as exc:
            print(f"could not record the failure in {self.run_dir}/status.json ({exc})", flush=True)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
