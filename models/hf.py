"""HF transformers interop: export our checkpoints as LlamaForCausalLM / GPT2LMHeadModel folders,
and import HF weights into our model, so lm-eval, generation and the hub work on our runs.

    python -m models.hf export --checkpoint RUN/step-N --out DIR [--dtype bf16]
    python -m models.hf import --hf DIR --out INIT     # then: python train.py train.init_from=INIT

A checkpoint folder (core/checkpoint.py) holds ``model.safetensors`` (our state dict) and a
checksummed ``meta.json`` whose ``config.model`` entry is the ModelConfig and whose optional
``tokenizer_path`` names an HF tokenizer.json or tokenizer folder.

The mapping is exact (no permutation): our RoPE uses HF's half-split layout, and GPT-2's fused
``c_attn`` (a Conv1D, weights stored input-major) is the transposed concatenation of our q/k/v.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Dict, Mapping, Optional, Tuple

import torch
from safetensors.torch import load_file, save_file

from core.checkpoint import read_weights, write_model_folder
from models.config import ModelConfig

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def model_config_from_dict(fields: Mapping) -> ModelConfig:
    """A ModelConfig from a resolved Hydra dict, ignoring keys this version does not know."""
    return ModelConfig(**{k: v for k, v in fields.items() if k in _CONFIG_FIELDS})


def _strip_wrappers(state_dict: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    # DDP ("module.") and torch.compile ("_orig_mod.") prefixes, should a caller save a wrapper.
    cleaned = {}
    for name, tensor in state_dict.items():
        changed = True
        while changed:
            changed = False
            for prefix in _WRAPPER_PREFIXES:
                if name.startswith(prefix):
                    name, changed = name[len(prefix):], True
        cleaned[name] = tensor
    return cleaned


# ---------------------------------------------------------------------------------------------
# Configs


def to_hf_config(cfg: ModelConfig):
    """The transformers config of identical architecture (dropout off, as we train without it)."""
    from models.common import resolved_ffn_hidden, resolved_kv_heads

    if cfg.family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
            intermediate_size=resolved_ffn_hidden(cfg), num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head, num_key_value_heads=resolved_kv_heads(cfg),
            head_dim=cfg.d_model // cfg.n_head, hidden_act="silu",
            max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
            tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False,
            attention_dropout=0.0, initializer_range=cfg.init_std,
            architectures=["LlamaForCausalLM"])
    if cfg.family == "gpt":
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.d_model,
            n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=resolved_ffn_hidden(cfg),
            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            layer_norm_epsilon=cfg.norm_eps, initializer_range=cfg.init_std,
            tie_word_embeddings=cfg.tie_embeddings, scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
            # GPT-2's <|endoftext|> is 50256; smaller vocabularies have no such token.
            bos_token_id=50256 if cfg.vocab_size > 50256 else None,
            eos_token_id=50256 if cfg.vocab_size > 50256 else None,
            architectures=["GPT2LMHeadModel"])
    raise ValueError(f"model.family={cfg.family!r}: expected llama or gpt")


def _rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported RoPE scaling {params!r}: only plain RoPE maps to our Llama")
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def from_hf_config(hf_config, name: Optional[str] = None) -> ModelConfig:
    """Our ModelConfig for an HF Llama / GPT-2 config; rejects variants our code would compute
    differently (biases in Llama, RoPE scaling, other activations)."""
    model_type = hf_config.model_type
    if model_type == "llama":
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        if (hf_config.attention_bias or hf_config.mlp_bias or hf_config.hidden_act != "silu"
                or head_dim * hf_config.num_attention_heads != hf_config.hidden_size):
            raise ValueError("this Llama variant (biases, non-SiLU MLP or head_dim * heads != "
                             "hidden_size) has no equivalent in models/llama.py")
        return ModelConfig(
            name=name or "imported_llama", family="llama", n_layer=hf_config.num_hidden_layers,
            n_head=hf_config.num_attention_heads,
            n_kv_head=hf_config.num_key_value_heads or hf_config.num_attention_heads,
            d_model=hf_config.hidden_size, ffn_hidden=hf_config.intermediate_size,
            vocab_size=hf_config.vocab_size, seq_len=hf_config.max_position_embeddings,
            rope_theta=_rope_theta(hf_config), norm_eps=hf_config.rms_norm_eps,
            tie_embeddings=bool(hf_config.tie_word_embeddings),
            init_std=hf_config.initializer_range)
    if model_type == "gpt2":
        if (hf_config.activation_function not in ("gelu_new", "gelu_pytorch_tanh")
                or not hf_config.scale_attn_weights or hf_config.scale_attn_by_inverse_layer_idx):
            raise ValueError("this GPT-2 variant (activation or attention scaling) has no "
                             "equivalent in models/gpt.py")
        return ModelConfig(
            name=name or "imported_gpt", family="gpt", n_layer=hf_config.n_layer,
            n_head=hf_config.n_head, d_model=hf_config.n_embd,
            ffn_hidden=hf_config.n_inner or 4 * hf_config.n_embd, vocab_size=hf_config.vocab_size,
            seq_len=hf_config.n_positions, norm_eps=hf_config.layer_norm_epsilon,
            tie_embeddings=bool(hf_config.tie_word_embeddings),
            init_std=hf_config.initializer_range)
    raise ValueError(f"HF model_type {model_type!r}: only llama and gpt2 are supported")


# ---------------------------------------------------------------------------------------------
# Weights

_LLAMA_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
# GPT-2's Conv1D stores [in, out]: transpose linear weights.
_GPT_BLOCK = {
    "attn_norm.weight": ("ln_1.weight", False),
    "attn_norm.bias": ("ln_1.bias", False),
    "attn.o_proj.weight": ("attn.c_proj.weight", True),
    "attn.o_proj.bias": ("attn.c_proj.bias", False),
    "mlp_norm.weight": ("ln_2.weight", False),
    "mlp_norm.bias": ("ln_2.bias", False),
    "mlp.fc.weight": ("mlp.c_fc.weight", True),
    "mlp.fc.bias": ("mlp.c_fc.bias", False),
    "mlp.proj.weight": ("mlp.c_proj.weight", True),
    "mlp.proj.bias": ("mlp.c_proj.bias", False),
}


def to_hf_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """Our (full-model) state dict under transformers' names and layouts (new contiguous tensors)."""
    sd = _strip_wrappers(state_dict)
    out: Dict[str, torch.Tensor] = {}
    if cfg.family == "llama":
        out["model.embed_tokens.weight"] = sd["tok_embeddings.weight"]
        for layer in range(cfg.n_layer):
            for ours, theirs in _LLAMA_BLOCK.items():
                out[f"model.layers.{layer}.{theirs}"] = sd[f"blocks.{layer}.{ours}"]
        out["model.norm.weight"] = sd["final_norm.weight"]
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = sd["lm_head.weight"]
    elif cfg.family == "gpt":
        out["transformer.wte.weight"] = sd["tok_embeddings.weight"]
        out["transformer.wpe.weight"] = sd["pos_embeddings.weight"]
        for layer in range(cfg.n_layer):
            ours = f"blocks.{layer}."
            theirs = f"transformer.h.{layer}."
            out[theirs + "attn.c_attn.weight"] = torch.cat(
                [sd[ours + f"attn.{p}_proj.weight"] for p in "qkv"], dim=0).t()
            out[theirs + "attn.c_attn.bias"] = torch.cat(
                [sd[ours + f"attn.{p}_proj.bias"] for p in "qkv"], dim=0)
            for our_name, (their_name, transpose) in _GPT_BLOCK.items():
                tensor = sd[ours + our_name]
                out[theirs + their_name] = tensor.t() if transpose else tensor
        out["transformer.ln_f.weight"] = sd["final_norm.weight"]
        out["transformer.ln_f.bias"] = sd["final_norm.bias"]
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = sd["lm_head.weight"]
    else:
        raise ValueError(f"model.family={cfg.family!r}: expected llama or gpt")
    return {name: tensor.detach().contiguous() for name, tensor in out.items()}


def from_hf_state_dict(hf_state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """transformers' state dict (LlamaForCausalLM / GPT2LMHeadModel) under our names."""
    hf = dict(hf_state_dict)
    out: Dict[str, torch.Tensor] = {}
    if cfg.family == "llama":
        out["tok_embeddings.weight"] = hf["model.embed_tokens.weight"]
        for layer in range(cfg.n_layer):
            for ours, theirs in _LLAMA_BLOCK.items():
                out[f"blocks.{layer}.{ours}"] = hf[f"model.layers.{layer}.{theirs}"]
        out["final_norm.weight"] = hf["model.norm.weight"]
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = hf["lm_head.weight"]
    elif cfg.family == "gpt":
        def get(name: str) -> torch.Tensor:
            # Some GPT-2 files on the hub omit the "transformer." prefix.
            return hf[name] if name in hf else hf[name[len("transformer."):]]

        out["tok_embeddings.weight"] = get("transformer.wte.weight")
        out["pos_embeddings.weight"] = get("transformer.wpe.weight")
        for layer in range(cfg.n_layer):
            ours = f"blocks.{layer}."
            theirs = f"transformer.h.{layer}."
            qkv_weight = get(theirs + "attn.c_attn.weight").t()
            qkv_bias = get(theirs + "attn.c_attn.bias")
            for i, p in enumerate("qkv"):
                rows = slice(i * cfg.d_model, (i + 1) * cfg.d_model)
                out[ours + f"attn.{p}_proj.weight"] = qkv_weight[rows]
                out[ours + f"attn.{p}_proj.bias"] = qkv_bias[rows]
            for our_name, (their_name, transpose) in _GPT_BLOCK.items():
                tensor = get(theirs + their_name)
                out[ours + our_name] = tensor.t() if transpose else tensor
        out["final_norm.weight"] = get("transformer.ln_f.weight")
        out["final_norm.bias"] = get("transformer.ln_f.bias")
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = hf["lm_head.weight"]
    else:
        raise ValueError(f"model.family={cfg.family!r}: expected llama or gpt")
    return {name: tensor.detach().contiguous() for name, tensor in out.items()}


def to_hf_model(model: torch.nn.Module, cfg: ModelConfig):
    """A transformers model carrying exactly our weights (for parity checks and generation)."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_config(to_hf_config(cfg))
    missing, unexpected = hf_model.load_state_dict(to_hf_state_dict(model.state_dict(), cfg), strict=False)
    _check_only_tied_missing(missing, unexpected, cfg)
    if cfg.tie_embeddings:
        hf_model.tie_weights()
    return hf_model


def _check_only_tied_missing(missing, unexpected, cfg: ModelConfig) -> None:
    allowed = {"lm_head.weight"} if cfg.tie_embeddings else set()
    missing = [m for m in missing if m not in allowed and not m.endswith(".attn.bias")]
    if missing or unexpected:
        raise RuntimeError(f"weight mapping mismatch: missing {missing}, unexpected {list(unexpected)}")


# ---------------------------------------------------------------------------------------------
# Folders


def read_checkpoint(checkpoint_dir: str) -> Tuple[ModelConfig, Dict[str, torch.Tensor], dict]:
    """(config, our state dict, meta) of a checkpoint folder (RUN/step-N or an import), verified."""
    state_dict, meta = read_weights(checkpoint_dir)
    model_fields = (meta.get("config") or {}).get("model")
    if model_fields is None:
        raise ValueError(f"{checkpoint_dir}/meta.json has no config.model entry")
    return model_config_from_dict(model_fields), _strip_wrappers(state_dict), meta


def _resolve_tokenizer_path(path: str, checkpoint_dir: str) -> Optional[str]:
    for candidate in (path, os.path.join(checkpoint_dir, path),
                      os.path.join(os.path.dirname(os.path.abspath(checkpoint_dir)), path)):
        if os.path.exists(candidate):
            return candidate
    return None


_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def _save_tokenizer(tokenizer_path: str, out_dir: str) -> Optional[int]:
    """Save the run's tokenizer as an HF tokenizer folder; returns its EOS id when known.

    A bare tokenizer.json carries no notion of EOS, so it is taken from the data pipeline's
    manifest.json beside it, else from the usual EOS spellings in the vocabulary.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if os.path.isdir(tokenizer_path):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    else:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_path)
        manifest_path = os.path.join(os.path.dirname(tokenizer_path), "manifest.json")
        candidates = list(_EOS_CANDIDATES)
        if os.path.exists(manifest_path):
            with open(manifest_path) as f:
                eos = json.load(f).get("eos_token")
            if eos:
                candidates.insert(0, eos)
        vocab = tokenizer.get_vocab()
        eos = next((token for token in candidates if token in vocab), None)
        if eos is not None:
            tokenizer.eos_token = eos
    tokenizer.save_pretrained(out_dir)
    return tokenizer.eos_token_id


def export_checkpoint(checkpoint_dir: str, out_dir: str, dtype: Optional[torch.dtype] = None) -> str:
    """Write an HF model folder for a trainer checkpoint; returns the tokenizer written, if any."""
    cfg, state_dict, meta = read_checkpoint(checkpoint_dir)
    hf_state = to_hf_state_dict(state_dict, cfg)
    if dtype is not None:
        hf_state = {k: v.to(dtype) for k, v in hf_state.items()}
    os.makedirs(out_dir, exist_ok=True)
    hf_config = to_hf_config(cfg)
    if dtype is not None:
        hf_config.dtype = dtype
    tokenizer_written = ""
    if meta.get("tokenizer_path"):
        tokenizer_path = _resolve_tokenizer_path(meta["tokenizer_path"], checkpoint_dir)
        if tokenizer_path is None:
            print(f"warning: tokenizer {meta['tokenizer_path']!r} not found; exported without it",
                  file=sys.stderr)
        else:
            eos_id = _save_tokenizer(tokenizer_path, out_dir)
            if eos_id is not None:
                hf_config.eos_token_id = eos_id
            tokenizer_written = tokenizer_path
    hf_config.save_pretrained(out_dir)
    save_file(hf_state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return tokenizer_written


def load_hf_folder(hf_dir: str) -> Tuple[ModelConfig, Dict[str, torch.Tensor]]:
    """(our config, our state dict) from an HF model folder (safetensors, sharded or not)."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(hf_dir)
    cfg = from_hf_config(hf_config, name=os.path.basename(os.path.normpath(hf_dir)))
    hf_state: Dict[str, torch.Tensor] = {}
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    for shard in shards:
        hf_state.update(load_file(os.path.join(hf_dir, shard)))
    return cfg, from_hf_state_dict(hf_state, cfg)


def import_hf(hf_dir: str, device: Optional[str] = None):
    """Our model loaded with an HF folder's weights, and its config."""
    from models import build_model

    cfg, state_dict = load_hf_folder(hf_dir)
    model = build_model(cfg, device="meta")
    model.load_state_dict(state_dict, assign=True)
    if device is not None:
        model = model.to(device)
    return model, cfg


def write_checkpoint(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig, out_dir: str,
                     tokenizer_path: Optional[str] = None) -> None:
    """A weights-only checkpoint folder (model.safetensors + checksummed meta.json): a run starts
    from it with ``train.init_from=DIR`` and evaluation reads it like a step-N folder."""
    meta = {"config": {"model": dataclasses.asdict(cfg)}, "step": 0}
    if tokenizer_path:
        meta["tokenizer_path"] = tokenizer_path
    write_model_folder(out_dir, state_dict, meta)


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.hf", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="trainer checkpoint -> HF model folder")
    export.add_argument("--checkpoint", required=True, help="RUN/step-N folder")
    export.add_argument("--out", required=True, help="HF folder to write")
    export.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="cast weights (default: as stored)")
    imp = commands.add_parser("import", help="HF model folder -> trainer checkpoint folder")
    imp.add_argument("--hf", required=True, help="HF model folder (config.json + safetensors)")
    imp.add_argument("--out", required=True, help="checkpoint folder to write (a run starts from it with "
                                                  "train.init_from=DIR)")
    args = parser.parse_args(argv)
    if args.command == "export":
        tokenizer = export_checkpoint(args.checkpoint, args.out, _DTYPES.get(args.dtype))
        print(json.dumps({"exported": args.out, "tokenizer": tokenizer or None}))
    else:
        cfg, state_dict = load_hf_folder(args.hf)
        has_tokenizer = os.path.exists(os.path.join(args.hf, "tokenizer.json"))
        write_checkpoint(state_dict, cfg, args.out, os.path.abspath(args.hf) if has_tokenizer else None)
        print(json.dumps({"imported": args.out, "model": dataclasses.asdict(cfg)}))


if __name__ == "__main__":
    main()
