"""GGUF Q4_1 and Q8_0 blocks as per-group integer weights: the same grid, no re-quantization."""

from __future__ import annotations

import numpy as np
import torch

from tandem.formats.weight import QuantizedWeight, pack

# GGUF Q4_1 block: fp16 scale d, fp16 min m, then 16 bytes holding 32 codes (element j in the
# low nibble of byte j, element j + 16 in its high nibble); w = d * q + m.
Q4_1_BLOCK = 32
Q4_1_BYTES = 20
# GGUF Q8_0 block: fp16 scale d, then 32 int8 codes; w = d * q.
Q8_0_BLOCK = 32
Q8_0_BYTES = 34


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
