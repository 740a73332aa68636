"""scripts/copy_divergence.py on a real 2-rank sparse_avg checkpoint."""
import json

import pytest

from tests.train_helpers import TINY, check, load_script, train_cli

copy_divergence = load_script("copy_divergence")


def test_copies_of_a_sparse_avg_checkpoint(tmp_path, prepared_cache, capsys):
    check(train_cli([*TINY, f"out_dir={tmp_path}", f"data.cache_dir={prepared_cache}", "optimizer=sparse_avg",
                     "optimizer.byte_budget=0.01", "optimizer.sparsity_warmup_steps=0", "optimizer.lr=3e-3",
                     "train.steps=4", "train.eval_every=0", "run_name=run"], nproc=2))
    run = tmp_path / "run"
    final = json.loads((run / "summary.json").read_text())["final_val_loss"]
    assert copy_divergence.main([str(run / "step-4"), "--per-tensor"]) == 0
    out = json.loads(capsys.readouterr().out)
    # the average is the model the trainer validated, on the same windows
    assert out["ranks"] == 2 and out["average_val_loss"] == pytest.approx(final, abs=1e-5)
    assert len(out["copy_val_losses"]) == 2 and out["copy_val_losses"][0] != out["copy_val_losses"][1]
    assert 0 < out["copy_distance_rms"] < out["weights_rms"]
    assert set(out["per_tensor"]) and all(row["numel"] > 0 for row in out["per_tensor"].values())

    assert copy_divergence.main([str(tmp_path)]) == 2  # not a checkpoint folder
    assert "no model.safetensors" in capsys.readouterr().err
