"""2 gloo ranks: the byte counters equal the analytic formula."""
from scape.accounting import scape_step_bytes
from scape.synchronizer import ScapeSynchronizer
from tests.dist_helpers import run_distributed
from tests.scape.helpers import make_model, scape_config, train


def _byte_counts(rank: int, world: int) -> None:
    combos = [("bitmap", "fp32", 0.9), ("bitmap", "bf16", 0.99), ("indices", "fp32", 0.99),
              ("indices", "bf16", 0.9), ("auto", "fp32", 0.99), ("auto", "bf16", 0.9)]
    for transport, value_dtype, sparsity in combos:
        cfg = scape_config(sparsity=sparsity, mask_transport=transport,
                           value_dtype=value_dtype)
        model = make_model()
        sync = ScapeSynchronizer(model, cfg)
        counted = {}

        def record(step):  # per step as the Trainer counts: from forward to after_step
            counted[step] = dict(sync.comm.counter.bytes)
            counted[step].pop("control")
            sync.comm.counter.reset()

        sync.comm.counter.reset()
        train(model, sync, 3, rank, after=record)  # the values may leave during backward
        expected = scape_step_bytes(sync.layout.numel, world, sparsity, transport,
                                    value_dtype)
        assert expected["transport"] == (transport if transport != "auto" else
                                         "indices" if sparsity == 0.99 else "bitmap")
        # step 1: dense all-reduce of the gradients, then the first mask's all-gather
        assert counted[1]["grad_allreduce"] == 2 * (world - 1) / world * 4 * \
            sync.layout.padded_numel
        assert counted[1]["scape_mask"] == expected["mask"]
        for step in (2, 3):
            assert set(counted[step]) == {"scape_values", "scape_mask"}
            assert counted[step]["scape_values"] == expected["values"], (cfg, counted)
            assert counted[step]["scape_mask"] == expected["mask"], (cfg, counted)


def test_byte_counters_equal_the_analytic_formula():
    run_distributed(_byte_counts, world_size=2)


