"""The foundation layer: what every part of training builds on, and nothing above it.

- core.distributed: the process group (gloo on CPU, NCCL on CUDA), rank-0 work shared with all ranks
- core.comm: counted collectives; the byte counter is an object each owner holds, not a global
- core.flat: all trainable parameters as views into one flat buffer
- core.sync: the gradient-synchroniser interface the Trainer talks to, the dense all-reduce, and
  the registry through which scape/ and sdp/ offer theirs
- core.optim: the dense optimizers (AdamW, AdamS) and their config

Nothing here imports models/, data/, scape/, sdp/, evaluation/ or trainer/ (tests/test_layers.py).
"""
