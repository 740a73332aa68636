"""Running lm-evaluation-harness on our model: task presets, offline failures, results, wandb.

Metric names follow trainer/metrics.py's prefix convention: ``eval/<task>/<metric>`` (with the
lm-eval filter appended as ``<metric>_<filter>`` when it is not "none"), plus ``eval/step``.
"""
from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from data.errors import looks_like_network_failure

REPO = Path(__file__).resolve().parents[1]
PRESETS_DIR = REPO / "conf" / "eval"

OFFLINE_ROUTE = (
    "Offline routes: (1) a custom task: a task YAML with `dataset_path: json` and "
    "`dataset_kwargs: {data_files: {test: /path/to/data.jsonl}}` in a folder passed as "
    "include_path=/that/folder, then tasks=<its task name>; or (2) a pre-filled HF cache: on a "
    "machine with network run the same evaluation once (or datasets.load_dataset for each task's "
    "dataset_path), copy ~/.cache/huggingface to this machine (or point HF_HOME at a copy) and "
    "run with HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1. See docs/EVALUATION.md.")


class DownstreamEvalError(RuntimeError):
    """A downstream evaluation that cannot run as asked; the message says what to do."""


class HubTaskUnavailableError(DownstreamEvalError):
    """A task's data lives on the HF hub, which is unreachable, and is not in the local cache."""


# ---------------------------------------------------------------------------------------------
# Task names


def preset_names() -> List[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def expand_task_names(tasks: Union[str, Sequence[str]]) -> List[str]:
    """Comma-separated names (or a list) with presets from conf/eval/ expanded, e.g.
    ``paper`` or ``paper,my_task``; duplicates are dropped, order kept."""
    import yaml

    items = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    names: List[str] = []
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        preset = PRESETS_DIR / f"{item}.yaml"
        expanded = yaml.safe_load(preset.read_text())["tasks"] if preset.is_file() else [item]
        names.extend(n for n in expanded if n not in names)
    if not names:
        raise DownstreamEvalError(f"no tasks given: pass tasks=NAME[,NAME...] or a preset "
                                  f"({', '.join(preset_names())})")
    return names


_TASK_MANAGERS: Dict[Tuple[Optional[str], bool], Any] = {}


def task_manager_for(task_names: Sequence[str], include_path: Optional[str] = None):
    """A TaskManager that knows ``task_names``, built once per process.

    Indexing lm-eval's ~15k built-in task files takes tens of seconds on a busy CPU, so when a
    custom folder defines every requested task the built-ins are not indexed at all.
    """
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        include_path = str(Path(include_path).expanduser().resolve())
        if not Path(include_path).is_dir():
            raise DownstreamEvalError(f"include_path={include_path} is not a folder of task YAMLs")
        key = (include_path, False)
        if key not in _TASK_MANAGERS:
            _TASK_MANAGERS[key] = TaskManager(include_path=include_path, include_defaults=False)
        if set(task_names) <= set(_TASK_MANAGERS[key].all_tasks):
            return _TASK_MANAGERS[key]
    key = (include_path, True)
    if key not in _TASK_MANAGERS:
        _TASK_MANAGERS[key] = TaskManager(include_path=include_path)
    manager = _TASK_MANAGERS[key]
    unknown = [n for n in task_names if n not in set(manager.all_tasks)]
    if unknown:
        raise DownstreamEvalError(
            f"unknown lm-eval task(s) {unknown}: not built into lm-eval, not a preset "
            f"({', '.join(preset_names())}) and not defined under include_path={include_path}")
    return manager


# ---------------------------------------------------------------------------------------------
# Running


def run_lm_eval(lm, task_names: Sequence[str], *, include_path: Optional[str] = None,
                limit: Optional[float] = None, num_fewshot: Optional[int] = None,
                log_samples: bool = False, seed: int = 1234,
                bootstrap_iters: int = 1000) -> Dict[str, Any]:
    """lm-eval's ``simple_evaluate`` on an LM object; hub failures become HubTaskUnavailableError."""
    from lm_eval import simple_evaluate

    manager = task_manager_for(task_names, include_path)
    try:
        results = simple_evaluate(
            model=lm, tasks=list(task_names), num_fewshot=num_fewshot, limit=limit,
            task_manager=manager, log_samples=log_samples, bootstrap_iters=bootstrap_iters,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed)
    except DownstreamEvalError:
        raise
    except Exception as exc:
        if looks_like_network_failure(exc):
            first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise HubTaskUnavailableError(
                f"cannot load the data of task(s) {list(task_names)}: it comes from the Hugging Face "
                f"hub, which is unreachable from this machine (or HF_DATASETS_OFFLINE/HF_HUB_OFFLINE "
                f"is set), and it is not in the local HF cache. {OFFLINE_ROUTE} "
                f"(original error: {type(exc).__name__}: {first_line})") from exc
        raise
    if results is None:
        raise DownstreamEvalError("lm-eval returned no results (not rank 0?)")
    return results


def evaluate_model(model: torch.nn.Module, tokenizer, tasks: Union[str, Sequence[str]], *,
                   batch_size: int = 16, limit: Optional[float] = None,
                   num_fewshot: Optional[int] = None, include_path: Optional[str] = None,
                   log_samples: bool = False, seed: int = 1234,
                   max_gen_toks: int = 256) -> Dict[str, Any]:
    """lm-eval results for our model on ``tasks`` (names or presets)."""
    from evaluation.harness_lm import CheckpointLM

    names = expand_task_names(tasks)
    lm = CheckpointLM(model, tokenizer, batch_size=batch_size, max_gen_toks=max_gen_toks, seed=seed)
    was_training = model.training
    model.eval()
    try:
        return run_lm_eval(lm, names, include_path=include_path, limit=limit,
                           num_fewshot=num_fewshot, log_samples=log_samples, seed=seed)
    finally:
        model.train(was_training)


# ---------------------------------------------------------------------------------------------
# Results


def downstream_metrics(results: Dict[str, Any]) -> Dict[str, float]:
    """lm-eval's ``results`` section as ``eval/<task>/<metric>`` floats (stderrs included,
    "N/A" and other non-numbers left out)."""
    metrics: Dict[str, float] = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, filter_name = key.split(",", 1)
            name = metric if filter_name == "none" else f"{metric}_{filter_name}"
            if math.isfinite(float(value)):
                metrics[f"eval/{task}/{name}"] = float(value)
    return metrics


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def write_results(results: Dict[str, Any], out_path: Path, extra: Dict[str, Any]) -> Tuple[Path, Optional[Path]]:
    """``out_path`` (results, metrics, versions, task configs, our settings) and, when lm-eval
    logged per-request samples, ``<out_path stem>-samples.jsonl`` beside it."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    samples = results.get("samples")
    record = dict(extra)
    record["metrics"] = downstream_metrics(results)
    for key in ("results", "groups", "group_subtasks", "versions", "n-shot", "higher_is_better",
                "n-samples", "configs", "config", "date"):
        if key in results:
            record[key] = results[key]
    tmp = out_path.with_suffix(out_path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=_json_default))
    tmp.replace(out_path)
    samples_path = None
    if samples:
        samples_path = out_path.with_name(out_path.stem + "-samples.jsonl")
        with open(samples_path, "w") as f:
            for task, task_samples in samples.items():
                for sample in task_samples:
                    f.write(json.dumps({"task": task, **sample}, default=_json_default) + "\n")
    return out_path, samples_path


def results_path(checkpoint_dir: Path, now: Optional[datetime.datetime] = None) -> Path:
    now = now or datetime.datetime.now()
    return checkpoint_dir / f"eval-{now.strftime('%Y%m%d-%H%M%S')}.json"


# ---------------------------------------------------------------------------------------------
# wandb


def wandb_mode_for_run(requested: str, run_config: Dict[str, Any]) -> str:
    """``auto`` follows the training run: no wandb if it logged none, else online with an API
    key and offline without (trainer/metrics.py's rule)."""
    from core.wandb_run import wandb_mode

    if requested not in ("auto", "online", "offline", "disabled"):
        raise DownstreamEvalError(f"wandb={requested!r}: expected auto, online, offline or disabled")
    if requested != "auto":
        return requested
    run_setting = str((run_config.get("logger") or {}).get("wandb", "disabled"))
    return "disabled" if run_setting == "disabled" else wandb_mode(run_setting)


def log_to_wandb(metrics: Dict[str, float], *, run_name: str, run_config: Dict[str, Any],
                 step: Optional[int], mode: str, resume_run: bool, run_dir: Path) -> Optional[str]:
    """Log ``metrics`` once; returns the wandb run id (None when disabled).

    ``resume_run`` continues the training run (the id its run folder ``run_dir`` stores, see
    core/wandb_run.py) so the scores sit beside its curves; otherwise a new run ``<run name>-eval``
    joins the training run's group. eval/* is plotted against ``eval/step`` (the checkpoint's
    step) rather than wandb's own step, which must only increase and would drop an older
    checkpoint's scores on a resumed run.
    """
    if mode == "disabled":
        return None
    import wandb

    from core.wandb_run import grouping, run_id_for

    logger_cfg = run_config.get("logger") or {}
    group, tags = grouping(run_config)
    run = wandb.init(
        project=logger_cfg.get("project") or "scape-sdp", entity=logger_cfg.get("entity"),
        group=group, tags=tags,
        name=run_name if resume_run else f"{run_name}-eval",
        id=run_id_for(run_dir, run_name) if resume_run else None,
        resume="allow" if resume_run else None, job_type="eval", dir=str(run_dir), mode=mode,
        config=None if resume_run else run_config)
    run.define_metric("eval/step")
    run.define_metric("eval/*", step_metric="eval/step")
    payload = dict(metrics)
    if step is not None:
        payload["eval/step"] = step
    run.log(payload)
    run_id = run.id
    run.finish()
    return run_id


# ---------------------------------------------------------------------------------------------
# RNG isolation (lm-eval seeds python, numpy and torch globally)


def format_table(metrics: Dict[str, float]) -> str:
    rows = [(k[len("eval/"):], v) for k, v in sorted(metrics.items()) if not k.endswith("_stderr")]
    width = max((len(k) for k, _ in rows), default=10)
    return "\n".join(f"{k:<{width}}  {v:.4f}" for k, v in rows)
