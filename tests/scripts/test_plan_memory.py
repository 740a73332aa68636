"""scripts/plan_memory.py: the pre-flight's table for a named experiment, and docs/MEMORY.md's grid."""
import json
import re
import subprocess
import sys

import pytest

from tests.train_helpers import REPO, load_script
from trainer.memory import GIB, estimate_memory

plan_memory = load_script("plan_memory")


def _row(table: str, name: str):
    line = next(line for line in table.splitlines() if name in line)
    return [float(x) for x in re.findall(r"\d+\.\d+", line[14 + 65:])]


def test_it_prints_the_per_rank_table_of_a_named_experiment(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan_memory.main(["+experiment=llama1_8b_scape99", "world=1,4", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("llama1_8b_scape99: cuda, micro_batch_size=4, activation_checkpointing=true")
    assert "world 1" in table and "world 4" in table
    for part in ("parameters (fp32)", "SCAPE residual", "SCAPE momentum", "activations: block inputs (checkpointed)",
                 "loss: logits chunk", "top-k of a partition"):
        assert part in table, part
    one, four = _row(table, "mask score")
    assert four == pytest.approx(one / 4, abs=0.01)  # each rank scores its own partition
    result = json.loads(out.read_text())
    cfg = plan_memory.compose(["+experiment=llama1_8b_scape99"])
    for world in (1, 4):
        expected = estimate_memory(cfg, world, "cuda").device_peak
        assert result["worlds"][str(world)]["peak_bytes"] == pytest.approx(expected)
        assert _row(table, "per rank (GiB)")[(1, 4).index(world)] == pytest.approx(expected / GIB, abs=0.01)


def test_it_runs_as_users_run_it_and_refuses_a_bad_world():
    proc = subprocess.run([sys.executable, "-m", "scripts.plan_memory", "+experiment=tiny_adamw", "world=2",
                           "device=cpu"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tiny_adamw: cpu" in proc.stdout and "adamw state (2 x fp32)" in proc.stdout
    with pytest.raises(SystemExit, match="world=0: the number of ranks must be at least 1"):
        plan_memory.main(["+experiment=tiny_adamw", "world=0"])
    with pytest.raises(SystemExit, match="device=tpu: expected device=cuda or device=cpu"):
        plan_memory.main(["device=tpu"])


def test_the_docs_grid_is_the_scripts_output():
    """docs/MEMORY.md's table is what `python -m scripts.plan_memory --grid` prints now."""
    text = (REPO / "docs" / "MEMORY.md").read_text()
    begin, end = "<!-- plan_memory --grid -->\n", "<!-- /plan_memory --grid -->"
    documented = text.split(begin, 1)[1].split(end, 1)[0].strip()
    assert documented == plan_memory.grid_markdown(plan_memory.grid("cuda")), \
        "docs/MEMORY.md is stale: rerun `python -m scripts.plan_memory --grid --json docs/results/memory_plan.json`"
