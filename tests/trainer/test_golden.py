"""Golden losses: the first 20 training losses of three experiments on 2 gloo ranks, bit for bit.

The values in golden_losses.json are pinned by this file's ``--regen`` mode (first on the code the
redesign started from, issue 16); any change to the step, the model's arithmetic, the data order
or the optimizers shows up here as a mismatch. The runs use CPU_INDEPENDENT_ENV: ATen's
vectorised kernels and MKL's GEMM pick their code path by the CPU's instruction set (AVX2,
AVX-512, ...), so the same code gives other low bits on another CPU; ATen's baseline kernels and
MKL's conditional-numerical-reproducibility mode remove most of that, not all: an AMD EPYC and an
Intel Sapphire Rapids still differ by an ulp from step 4-10 on (not found where). So a case keeps
one pinned list per CPU family it was run on (``losses``: the first, ``other_cpus``: the rest),
and a run must equal one of them bit for bit. To re-pin a case after an intended change of its
arithmetic, edit its overrides in CASES and run (on each CPU family; ``--add-cpu`` keeps the pins
of the others and adds or replaces this CPU's)

    OMP_NUM_THREADS=1 WANDB_MODE=disabled python -m tests.trainer.test_golden --regen CASE [CASE ...] [--add-cpu]

(the cache of the tokenized corpus is rebuilt in a temporary folder unless --cache DIR is given).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

import pytest

from tests.train_helpers import TINY_DATA, check, train_cli, train_losses

GOLDEN = Path(__file__).with_name("golden_losses.json")
STEPS = 20

# Every case: its experiment with the schedule it ships with, stopped after STEPS steps, logged
# every step, no validation and no periodic checkpoint (stop_after_steps writes one at the end).
COMMON = ["logger=console", "train.log_every=1", "train.eval_every=0", "train.ckpt_every=0",
          f"train.stop_after_steps={STEPS}", *TINY_DATA]

# Per-case overrides: change a case's list (and re-pin it with --regen) to select another rule.
# tiny_scape99 was pinned with the optimizer defaults of conf/optimizer/scape.yaml as they stood
# then, the spec's rule; since the study's rule became the default (issue 15) the case selects the
# spec's rule with optimizer=scape_spec, whose arithmetic is bit-identical to that old default path.
CASES: Dict[str, List[str]] = {
    # tiny_adams as pinned, before its embedding table trained at 16 lr (2026-12-05)
    "tiny_adams": ["+experiment=tiny_adams", "optimizer.param_groups=[]", "optimizer.lr=3e-3"],
    "tiny_scape99_spec": ["+experiment=tiny_scape99", "optimizer=scape_spec", "optimizer.param_groups=[]"],
    # the two 99% experiments exactly as they ship (pinned before the options cleanup, issue 49)
    "tiny_scape99": ["+experiment=tiny_scape99"],
    "tiny_sma99": ["+experiment=tiny_sma99"],
    # micro-batches of 4 (8 accumulated) so the small corpus's val split has a batch for each rank
    "tiny_bsdp50": ["+experiment=tiny_bsdp50", "train.micro_batch_size=4"],
}


# The same bits on every x86-64 CPU (see the module docstring); slower, and only for these runs.
CPU_INDEPENDENT_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}


def run_case(name: str, out_dir: Path, cache: Path) -> List[float]:
    args = [*CASES[name], *COMMON, f"out_dir={out_dir}", f"run_name={name}", f"data.cache_dir={cache}"]
    check(train_cli(args, nproc=2, timeout=900, env=CPU_INDEPENDENT_ENV))
    losses = train_losses(out_dir / name)
    assert sorted(losses) == list(range(1, STEPS + 1)), sorted(losses)
    return [losses[s] for s in range(1, STEPS + 1)]


def _golden() -> Dict[str, dict]:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_first_losses_are_bit_for_bit_the_pinned_ones(name, tmp_path, prepared_cache):
    pinned = _golden()[name]
    assert pinned["overrides"] == CASES[name], (
        f"{name}: its overrides changed since the values were pinned; re-pin with --regen {name}")
    losses = run_case(name, tmp_path, prepared_cache)
    variants = [pinned["losses"], *(other["losses"] for other in pinned.get("other_cpus", []))]
    if losses in variants:
        return
    mismatch = [(s + 1, got, want) for s, (got, want) in enumerate(zip(losses, pinned["losses"])) if got != want]
    assert not mismatch, (f"{name} on {cpu_family()}: (step, got, pinned) {mismatch[:5]}; pinned on "
                          f"{[pinned.get('cpu')] + [o['cpu'] for o in pinned.get('other_cpus', [])]}. "
                          f"After an intended change re-pin with --regen; a new CPU family: --regen --add-cpu")


def cpu_family() -> str:
    """The CPU's model name (the low bits of these runs depend on it), from /proc/cpuinfo."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _regen(names: List[str], cache: str | None, add_cpu: bool = False) -> None:
    from tests.conftest import REPO  # noqa: F401 - puts the repository on sys.path
    golden = _golden() if GOLDEN.is_file() else {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        if cache is None:
            cache_dir = tmp_path / "cache"
            _prepare_cache(cache_dir)
        else:
            cache_dir = Path(cache)
        for name in names:
            losses, cpu = run_case(name, tmp_path / "runs" / name, cache_dir), cpu_family()
            if add_cpu:
                entry = golden[name]
                if entry["overrides"] != CASES[name]:
                    raise SystemExit(f"{name}: its overrides changed; re-pin without --add-cpu first")
                others = [o for o in entry.get("other_cpus", []) if o["cpu"] != cpu]
                if entry.get("cpu") == cpu:
                    entry["losses"] = losses
                else:
                    others.append({"cpu": cpu, "losses": losses})
                entry["other_cpus"] = others
            else:
                golden[name] = {"overrides": CASES[name], "cpu": cpu, "losses": losses}
            print(f"{name} on {cpu}: {losses[:3]} ...", flush=True)
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")


def _prepare_cache(cache: Path) -> None:
    from hydra import compose, initialize_config_dir

    from data import prepare
    from tests.conftest import REPO
    from trainer.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*TINY_DATA, f"data.cache_dir={cache}"])
    prepare(cfg.data, cfg.tokenizer)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regen", nargs="+", choices=sorted(CASES), required=True)
    parser.add_argument("--cache", default=None)
    parser.add_argument("--add-cpu", action="store_true",
                        help="keep the other CPU families' pins and add (or replace) this CPU's")
    ns = parser.parse_args()
    _regen(ns.regen, ns.cache, ns.add_cpu)
    sys.exit(0)
