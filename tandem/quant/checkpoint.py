"""Write a quantized checkpoint directory, in the layout `tandem.model.quantized_checkpoint`
describes and reads back (`tandem.LLM(DIR)`, the services' `--model DIR`, `load_model`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from tandem.formats.weight import QuantizedWeight
from tandem.model.config import ModelConfig
from tandem.model.quantized_checkpoint import FORMAT, QUANT_FILE, VERSION

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """A config.json that `ModelConfig.from_hf` reads back as `cfg`."""
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids),
    }
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.model_type == "mistral":
        out["sliding_window"] = None
    return out


def save_quantized(
    out_dir: str,
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor | QuantizedWeight],
    tokenizer: Any,
    info: dict[str, Any],
    float_dtype: torch.dtype = torch.float16,
) -> None:
    """Write the checkpoint directory (created if needed; files in it are overwritten)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, Any]] = {}
    for name, w in weights.items():
        if isinstance(w, QuantizedWeight):
            base = name.removesuffix(".weight")
            tensors[base + ".qweight"] = w.qweight.contiguous().cpu()
            tensors[base + ".scales"] = w.scales.contiguous().cpu()
            tensors[base + ".mins"] = w.mins.contiguous().cpu()
            layers[base] = {
                "bits": w.bits,
                "group_size": w.group_size,
                "zero_point": w.zero_point,
                "in_features": w.in_features,
            }
        else:
            tensors[name] = w.detach().to(float_dtype).contiguous().cpu()
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config(cfg), f, indent=2)
    meta = {"format": FORMAT, "version": VERSION, **info, "layers": layers}
    with open(os.path.join(out_dir, QUANT_FILE), "w") as f:
        json.dump(meta, f, indent=2)
    tokenizer.hf.save_pretrained(out_dir)


def info_of(meta: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's quantization.json without what `save_quantized` adds itself (format,
    version, the per-layer table): the `info` that wrote it, to tune it further and save again."""
    return {k: v for k, v in meta.items() if k not in ("format", "version", "layers")}
