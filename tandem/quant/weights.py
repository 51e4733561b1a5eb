"""Turning a loaded checkpoint's weights into the ones the engine runs: quantize, load GGUF Q4_1
and Q8_0 natively, or dequantize, as `EngineConfig.quantization` asks."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tandem.model.config import ModelConfig
from tandem.quant.format import QuantizedWeight, pack, permute_rows, quantize_rtn
from tandem.quant.recipe import LayerSpec, linear_layer_names

# GGUF Q4_1 block: fp16 scale d, fp16 min m, then 16 bytes holding 32 codes (element j in the
# low nibble of byte j, element j + 16 in its high nibble); w = d * q + m.
Q4_1_BLOCK = 32
Q4_1_BYTES = 20
# GGUF Q8_0 block: fp16 scale d, then 32 int8 codes; w = d * q.
Q8_0_BLOCK = 32
Q8_0_BYTES = 34


def quantize_weights(
    weights: dict[str, Any],
    specs: dict[str, LayerSpec],
    clips: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """RTN-quantize the layers `specs` marks as quantized (with per-group clipping ratios where
    `clips` has them); other tensors pass through."""
    out = dict(weights)
    clips = clips or {}
    for name, spec in specs.items():
        key = name + ".weight"
        w = out.get(key)
        if spec.quantized and isinstance(w, torch.Tensor):
            c = clips.get(name)
            out[key] = quantize_rtn(
                w,
                spec.bits,
                spec.group_size,
                spec.zero_point,
                None if c is None else c.to(w.device),
            )
    return out


def dequantize_weights(weights: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every quantized weight replaced by its float value in `dtype`."""
    return {
        k: v.dequantize(dtype) if isinstance(v, QuantizedWeight) else v for k, v in weights.items()
    }


def q4_1_to_quantized(raw: np.ndarray | torch.Tensor, rows: int, cols: int) -> QuantizedWeight:
    """GGUF Q4_1 blocks of a [rows, cols] tensor -> the same grid as a QuantizedWeight (no
    re-quantization: identical codes, scales and minimums)."""
    if cols % Q4_1_BLOCK:
        raise ValueError(f"Q4_1 tensor has {cols} columns, not a multiple of {Q4_1_BLOCK}")
    groups = cols // Q4_1_BLOCK
    t = torch.as_tensor(np.array(raw, copy=True)).view(torch.uint8)
    t = t.reshape(rows, groups, Q4_1_BYTES)
    scales = t[:, :, 0:2].contiguous().view(torch.float16).reshape(rows, groups)
    mins = t[:, :, 2:4].contiguous().view(torch.float16).reshape(rows, groups)
    qs = t[:, :, 4:].to(torch.int32)  # [rows, groups, 16]
    codes = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(rows, cols)
    return QuantizedWeight(pack(codes, 4), scales, mins, 4, Q4_1_BLOCK, cols, True)


def q8_0_to_quantized(raw: np.ndarray | torch.Tensor, rows: int, cols: int) -> QuantizedWeight:
    """GGUF Q8_0 blocks of a [rows, cols] tensor -> the same grid as a symmetric 8-bit
    QuantizedWeight: code q + 128, min -128 * d (exact in FP16), so values are identical."""
    if cols % Q8_0_BLOCK:
        raise ValueError(f"Q8_0 tensor has {cols} columns, not a multiple of {Q8_0_BLOCK}")
    groups = cols // Q8_0_BLOCK
    t = torch.as_tensor(np.array(raw, copy=True)).view(torch.uint8)
    t = t.reshape(rows, groups, Q8_0_BYTES)
    scales = t[:, :, 0:2].contiguous().view(torch.float16).reshape(rows, groups)
    codes = t[:, :, 2:].contiguous().view(torch.int8).to(torch.int32) + 128
    mins = (-128 * scales.float()).to(torch.float16)
    return QuantizedWeight(
        pack(codes.reshape(rows, cols), 8), scales, mins, 8, Q8_0_BLOCK, cols, False
    )


def q4_1_tensor(t: Any, cfg: ModelConfig, permuted: bool) -> tuple[str, QuantizedWeight]:
    """One GGUF Q4_1 (or Q8_0) tensor (a GGUFReader tensor) as (HF name, QuantizedWeight).

    `permuted`: the file's architecture reorders q/k rows for llama.cpp's rotary layout; they
    are put back in HF order, as the float loader does.
    """
    import gguf

    from tandem.model import gguf_loader as gl

    hf = gl._hf_name(t.name)
    cols, rows = (int(d) for d in t.shape.tolist())  # ggml order: fastest dimension first
    if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
        qw = q8_0_to_quantized(t.data, rows, cols)
    else:
        qw = q4_1_to_quantized(t.data, rows, cols)
    if permuted and ".attn_q." in t.name:
        qw = permute_rows(qw, gl._unpermute(torch.arange(rows), cfg.num_heads))
    elif permuted and ".attn_k." in t.name:
        qw = permute_rows(qw, gl._unpermute(torch.arange(rows), cfg.num_kv_heads))
    return hf, qw


def load_gguf_q4_1(path: str, cfg: ModelConfig, heads: bool = False) -> dict[str, QuantizedWeight]:
    """The Q4_1 linear weights of a GGUF file as QuantizedWeights under HF names; with `heads`
    also the token embedding and LM head when they are Q4_1 or Q8_0."""
    import gguf

    from tandem.model import gguf_loader as gl
    from tandem.model.gguf_meta import Metadata, open_reader

    reader = open_reader(path)
    meta = Metadata(reader, path)
    permuted = meta.architecture in gl._PERMUTED_QK
    types = (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0)
    out: dict[str, QuantizedWeight] = {}
    for t in reader.tensors:
        if t.tensor_type not in types:
            continue
        hf = gl._hf_name(t.name)
        if hf is None or not hf.endswith(".weight"):
            continue
        layer = ".layers." in hf
        if not (layer and t.tensor_type == types[0]) and not (heads and not layer):
            continue  # without `heads`, embeddings and lm_head stay in float
        name, qw = q4_1_tensor(t, cfg, permuted)
        out[name] = qw
    return out


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
            return {**loaded.weights, **load_gguf_q4_1(loaded.path, loaded.config, heads=True)}
        return loaded.weights
    if mode == "none":
        return dequantize_weights(loaded.weights, dtype)
    if mode != "int4":
        raise ValueError(f"quantization must be one of auto, int4, none; got {mode!r}")
    weights = dict(loaded.weights)
    group = 128
    if str(loaded.path).endswith(".gguf"):
        native = load_gguf_q4_1(loaded.path, loaded.config)
        weights.update(native)
        # Layers stored in other GGUF types are quantized at Q4_1's group size, so fused
        # q/k/v and gate/up parts agree.
        group = 32
    spec = LayerSpec(bits=4, group_size=group, zero_point=True)
    names = linear_layer_names(loaded.config.num_layers)
    return quantize_weights(weights, {n: spec for n in names})
