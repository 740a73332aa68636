"""Sample text from a checkpoint with our own model and the run's tokenizer.

    python scripts/generate.py checkpoint=RUN/step-N prompt="Once upon a time" max_new_tokens=100
    python scripts/generate.py checkpoint=RUN/step-N prompt="def " temperature=0      # greedy
    python scripts/generate.py checkpoint=RUN/step-N prompt="The" temperature=0.8 top_k=50 seed=1 num_samples=3

Arguments are Hydra-style key=value. temperature=0 is greedy (argmax) decoding; otherwise
softmax(logits / temperature) restricted to the top_k tokens (top_k=0: all). A fixed seed gives
the same text on the same device. Sampling stops at the EOS token unless stop_at_eos=false.
``json=true`` prints one JSON object per sample (text and token ids) instead of plain text.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@dataclass
class GenerateConfig:
    checkpoint: str = "???"  # RUN/step-N
    prompt: str = ""  # empty: start a new document (the EOS token)
    max_new_tokens: int = 100
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k filtering
    seed: int = 1234
    num_samples: int = 1  # sample i uses seed + i
    stop_at_eos: bool = True
    device: str = "auto"
    dtype: str = "fp32"
    json: bool = False


def parse_config(argv: List[str]) -> GenerateConfig:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    bad = [a for a in argv if "=" not in a]
    if bad:
        raise SystemExit(f"error: arguments are key=value (got {bad}); keys: "
                         f"{', '.join(GenerateConfig.__dataclass_fields__)}")
    # The prompt is taken verbatim (OmegaConf would otherwise parse "1.5" or "[a]" as values).
    values = {}
    for arg in argv:
        key, value = arg.split("=", 1)
        values[key.lstrip("+")] = value
    prompt = values.pop("prompt", None)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(GenerateConfig),
                              OmegaConf.from_dotlist([f"{k}={v}" for k, v in values.items()]))
        if prompt is not None:
            cfg.prompt = prompt
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise SystemExit(f"error: {str(exc).splitlines()[0]}") from None
    if obj.temperature < 0 or obj.top_k < 0 or obj.max_new_tokens < 0:
        raise SystemExit("error: temperature, top_k and max_new_tokens must be >= 0")
    return obj  # type: ignore[return-value]


def main(argv: Optional[List[str]] = None) -> int:
    cfg = parse_config(sys.argv[1:] if argv is None else argv)

    from evaluation.checkpoint import CheckpointLoadError, load_checkpoint_for_inference
    from evaluation.sampling import prompt_token_ids, sample_tokens

    try:
        loaded = load_checkpoint_for_inference(cfg.checkpoint, device=cfg.device, dtype=cfg.dtype)
    except CheckpointLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokenizer = loaded.tokenizer
    prompt_ids = prompt_token_ids(tokenizer, cfg.prompt)
    stop = [tokenizer.eos_token_id] if cfg.stop_at_eos else []
    for index in range(cfg.num_samples):
        new_ids = sample_tokens(loaded.model, prompt_ids, cfg.max_new_tokens,
                                temperature=cfg.temperature, top_k=cfg.top_k or None,
                                seed=cfg.seed + index, stop_token_ids=stop)
        completion = tokenizer.decode(new_ids, skip_special_tokens=True)
        if cfg.json:
            print(json.dumps({"sample": index, "prompt": cfg.prompt, "completion": completion,
                              "prompt_ids": prompt_ids, "new_ids": new_ids}))
        else:
            if cfg.num_samples > 1:
                print(f"--- sample {index} (seed {cfg.seed + index})")
            print(cfg.prompt + completion)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
