"""Find and load a checkpoint: a Hugging Face directory, a GGUF file, or the embedded default."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from tandem.formats.weight import LayerSpec, dequantize_weights, quantize_weights
from tandem.model.config import ModelConfig
from tandem.model.external_quant import check_quantization_config, load_external
from tandem.model.info import read_hf_config, resolve_model_path
from tandem.model.layer_names import linear_layer_names
from tandem.model.quantized_checkpoint import (
    assemble_quantized,
    is_quantized_part,
    read_quantization,
)
from tandem.model.tokenizer import Tokenizer
from tandem.progress import Percent


@dataclass
class LoadedModel:
    config: ModelConfig
    # Float tensors, and QuantizedWeights (tandem.formats) for a quantized checkpoint.
    weights: dict[str, Any]
    tokenizer: Tokenizer
    path: str


def load_model(path: str | None = None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load weights, config and tokenizer; `None` means the default SmolLM2 GGUF."""
    path = resolve_model_path(path)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(
                f"model file {path!r} is not a .gguf file; pass a GGUF file or a Hugging Face "
                "directory holding config.json, *.safetensors and tokenizer files"
            )
        from tandem.model.gguf_loader import load_gguf  # needs the gguf package

        cfg, weights, tok = load_gguf(path, dtype)
        return LoadedModel(cfg, weights, tok, path)
    return load_hf_dir(path, dtype)


def load_hf_dir(path: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a local Hugging Face Llama-family directory (single or sharded safetensors).

    A directory written by `tandem quantize` (it holds quantization.json) loads its quantized
    layers as QuantizedWeights; their codes, scales and zero points keep their stored dtypes.
    So does a directory whose config.json has a `quantization_config` (AWQ, GPTQ,
    compressed-tensors: repacked by `tandem.model.external_quant`, which refuses what it cannot load).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    hf = read_hf_config(path)
    cfg = ModelConfig.from_hf(hf, name=os.path.basename(os.path.normpath(path)))
    external = hf.get("quantization_config")
    if external is not None:
        check_quantization_config(external, path)  # refuse before reading gigabytes
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path!r} holds no *.safetensors weights")
    quant = read_quantization(path)
    if quant and external is not None:
        raise ValueError(
            f"{path!r} has both a quantization.json and a quantization_config in config.json; "
            "remove the one that does not describe its weights"
        )
    weights: dict[str, Any] = {}
    progress = Percent("loading weights", len(files), every=1)
    for name in files:
        fp = os.path.join(path, name)
        if not os.path.isfile(fp):
            raise FileNotFoundError(f"weight shard {fp!r} named by the index is missing")
        try:
            shard = load_file(fp)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ValueError(f"cannot read {fp!r} (truncated or corrupt safetensors?): {e}") from e
        if external is not None:
            weights.update(shard)  # cast by load_external, which knows the integer tensors
        else:
            weights.update(
                {k: v if quant and is_quantized_part(k) else v.to(dtype) for k, v in shard.items()}
            )
        progress.advance()
    if quant:
        weights = assemble_quantized(weights, quant, path)
    elif external is not None:
        weights = load_external(weights, external, path, dtype)
    tok = Tokenizer.from_dir(path, cfg.eos_token_ids)
    return LoadedModel(cfg, weights, tok, path)


def prepare_weights(
    loaded: Any, mode: str, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> dict[str, Any]:
    """The weights an engine runs for `EngineConfig.quantization` = mode (auto | int4 | none).

    "auto" on CPU keeps a GGUF file's Q4_1 and Q8_0 tensors (the token embedding / LM head
    too) as they are stored: the CPU kernels read the codes (`tandem.kernels.cpu_int4`), a
    quarter of the float32 bytes a decode step would read. Elsewhere "auto" is the checkpoint's
    own weights (a GGUF file dequantized to float)."""
    if mode == "auto":
        if torch.device(device).type == "cpu" and str(loaded.path).endswith(".gguf"):
            from tandem.model.gguf_loader import load_gguf_q4_1

            return {**loaded.weights, **load_gguf_q4_1(loaded.path, loaded.config, heads=True)}
        return loaded.weights
    if mode == "none":
        return dequantize_weights(loaded.weights, dtype)
    if mode != "int4":
        raise ValueError(f"quantization must be one of auto, int4, none; got {mode!r}")
    weights = dict(loaded.weights)
    group = 128
    if str(loaded.path).endswith(".gguf"):
        from tandem.model.gguf_loader import load_gguf_q4_1

        native = load_gguf_q4_1(loaded.path, loaded.config)
        weights.update(native)
        # Layers stored in other GGUF types are quantized at Q4_1's group size, so fused
        # q/k/v and gate/up parts agree.
        group = 32
    spec = LayerSpec(bits=4, group_size=group, zero_point=True)
    names = linear_layer_names(loaded.config.num_layers)
    return quantize_weights(weights, {n: spec for n in names})
