"""A quantized checkpoint directory: safetensors + config.json + tokenizer + quantization.json.

Layout (loadable by `tandem.LLM(DIR)`, the services' `--model DIR`, and `load_model`):
    model.safetensors   float tensors under their HF names; each quantized layer X as
                        X.qweight (int32), X.scales (fp16), X.mins (fp16) — see tandem.formats.weight
    quantization.json   {"format": "tandem-groupwise-int", "version": 1, "layers": {X: {bits,
                        group_size, zero_point, in_features}}, plus how it was made}
    config.json         Hugging Face form of the model's ModelConfig
    tokenizer files     as the tokenizer saves them (chat template included)
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from tandem.formats.weight import QuantizedWeight
from tandem.model.config import ModelConfig

QUANT_FILE = "quantization.json"
FORMAT = "tandem-groupwise-int"
VERSION = 1
_PARTS = ("qweight", "scales", "mins")

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


def read_quantization(path: str) -> dict[str, Any] | None:
    """The parsed quantization.json of a model directory, or None when it has none."""
    fp = os.path.join(path, QUANT_FILE)
    if not os.path.isfile(fp):
        return None
    with open(fp) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(
            f"{fp}: unsupported quantization format {meta.get('format')!r} version "
            f"{meta.get('version')!r} (this Tandem reads {FORMAT!r} version {VERSION})"
        )
    return meta


def is_quantized_part(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in _PARTS


def assemble_quantized(
    weights: dict[str, torch.Tensor], meta: dict[str, Any], path: str
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Replace each layer's qweight/scales/mins tensors by one QuantizedWeight at `X.weight`."""
    out: dict[str, Any] = dict(weights)
    for base, spec in meta["layers"].items():
        try:
            parts = [out.pop(f"{base}.{p}") for p in _PARTS]
        except KeyError as e:
            raise ValueError(f"{path}: quantized layer {base!r} lacks tensor {e.args[0]!r}") from e
        out[base + ".weight"] = QuantizedWeight(
            parts[0],
            parts[1],
            parts[2],
            int(spec["bits"]),
            int(spec["group_size"]),
            int(spec["in_features"]),
            bool(spec.get("zero_point", True)),
        )
    return out
