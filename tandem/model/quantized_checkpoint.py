"""Read a `tandem quantize` checkpoint directory: safetensors + config.json + tokenizer +
quantization.json (written by `tandem.quant.checkpoint`).

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

QUANT_FILE = "quantization.json"
FORMAT = "tandem-groupwise-int"
VERSION = 1
_PARTS = ("qweight", "scales", "mins")


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
