"""2 gloo ranks: identical replicas, conservation and exactly k per partition."""
import torch
import torch.distributed as dist

from scape.synchronizer import ScapeSynchronizer
from tests.dist_helpers import run_distributed
from tests.scape.helpers import make_model, scape_config, train


def _gathered(tensor: torch.Tensor, world: int):
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous())
    return parts


CONFIGS = [dict(sparsity=0.9), dict(sparsity=0.99, value_dtype="bf16", mask_transport="indices"),
           dict(sparsity=0.9, lag=False, score="gradient"), dict(sparsity=0.9, update="all", stale_scale_cap=1),
           dict(sparsity=0.9, base="adamw", offload_residual=True),
           dict(sparsity=0.8, stale_scale_cap=4, sparsity_warmup_steps=4, dense_warmup_steps=2),
           dict(sparsity=0.9, score_timing="post_step", stale_scale="lr_sum", stale_scale_cap=0,
                offload_residual=True)]


def _replicas_conservation_k(rank: int, world: int) -> None:
    c = 1 - 0.9
    for overrides in CONFIGS:
        model = make_model()
        sync = ScapeSynchronizer(model, scape_config(**overrides), residual_chunk_numel=700)
        layout = sync.layout
        seen = {"contrib": torch.zeros(layout.padded_numel), "sent": torch.zeros(layout.padded_numel)}

        def before(step):
            seen["residual"] = sync.residual.cpu_copy()
            seen["grad"] = sync.flat.grad.clone()

        def check_reduce(step):
            contribution = c * seen["grad"]
            total = contribution.clone()
            dist.all_reduce(total)
            seen["contrib"] += total
            if sync._dense:
                seen["sent"] += total
                return
            seen["ghat"], seen["mask"] = sync._ghat.clone(), sync.mask.clone()
            # exactly k values per partition
            per_partition = torch.bincount(sync.mask // layout.partition_size,
                                           minlength=layout.num_partitions)
            assert per_partition.tolist() == [sync.k_at(step)] * layout.num_partitions

        def check_sent(step):  # after the step: its residual pass folds and clears
            mask = seen.pop("mask")
            contribution = c * seen["grad"]
            sent = seen["residual"] + contribution - sync.residual.cpu_copy()
            off_mask = torch.ones(layout.padded_numel, dtype=torch.bool)
            off_mask[mask] = False
            # only the mask leaves (off the mask: e + c g - (e + c g), up to the rounding of c g)
            assert sent[off_mask].abs().max() <= 1e-7, overrides
            if overrides.get("value_dtype", "fp32") == "fp32":
                assert torch.count_nonzero(sync.residual.cpu_copy()[mask]) == 0
            dist.all_reduce(sent)
            seen["sent"] += sent
            # the all-reduced payload is exactly what the ranks took out of their residuals
            tol = 2e-2 if overrides.get("value_dtype") == "bf16" else 1e-6
            torch.testing.assert_close(seen.pop("ghat"), sent[mask] / (world * c), rtol=tol,
                                       atol=tol * 1e-2, msg=str(overrides))

        def check_replicas(step):
            if "mask" in seen:
                check_sent(step)
            for name, tensor in (("params", sync.flat.data), ("momentum", sync.optimizer.momentum)):
                first, second = _gathered(tensor, world)
                assert torch.equal(first, second), f"{name} differ at step {step}: {overrides}"
            assert sync.step_count == step

        train(model, sync, 5, rank, max_norm=0.0, before_reduce=before, hook=check_reduce,
              after=check_replicas)
        residual = sync.residual.cpu_copy()
        dist.all_reduce(residual)
        # conservation: sent mass plus residual equals the total contribution
        torch.testing.assert_close(seen["sent"] + residual, seen["contrib"], rtol=0, atol=1e-6,
                                   msg=str(overrides))
        if overrides.get("sparsity_warmup_steps"):
            assert sync.k_at(3) > sync.k_at(4) == sync.k_at(9)  # warm-up ends at step 4


def test_replicas_identical_conservation_and_k_per_partition():
    run_distributed(_replicas_conservation_k, world_size=2)


