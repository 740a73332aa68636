"""Downstream evaluation (lm-evaluation-harness) and sampling on our checkpoints.

    evaluation.checkpoint   load a RUN/step-N folder as (our model, the run's tokenizer)
    evaluation.sampling     temperature / top-k sampling through our model (no HF generate)
    evaluation.harness_lm   CheckpointLM: lm-eval's model interface around our model
    evaluation.harness      task presets, running lm-eval, results files, eval/* metrics, wandb
    evaluation.in_loop      a small downstream evaluation the trainer can call every N steps

lm-eval is an optional dependency (``pip install -e .[eval]``); only ``harness_lm``,
``harness`` and ``in_loop`` import it.
"""
