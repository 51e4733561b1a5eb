"""FP8 (e4m3) / INT8 KV cache with one float32 scale per (block, kv head).

A cache block holds `block_size` tokens; its scale is amax / SCALE_TARGET over every value written
into the block for that head, so dequantization is `code * scale`. Tokens arrive one at a time during
decode, so a block's scale can grow after it already holds codes: the block is then re-quantized
at the new scale (codes * old / new), which is exact when the scale did not change. A block whose
first slot is written starts afresh, forgetting the scale its previous owner left behind.
"""

from __future__ import annotations

import torch

KV_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
# The value a block's amax maps to when its scale is set. FP8 keeps its relative precision over
# a wide range, so it leaves 4x headroom: later tokens up to 4x larger fit without re-quantizing
# the block (each re-quantization rounds the held codes again). INT8 would lose bits to headroom.
SCALE_TARGET = {torch.float8_e4m3fn: 112.0, torch.int8: 127.0}


def is_quantized_kv(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def quantize_codes(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float values already divided by their scale -> codes of `dtype` (saturating)."""
    qmax = QMAX[dtype]
    if dtype == torch.int8:
        return torch.round(x).clamp_(-qmax, qmax).to(torch.int8)
    return x.clamp(-qmax, qmax).to(dtype)


def dequantize_blocks(
    codes: torch.Tensor,  # [..., block_size, kv_heads, head_dim]
    scales: torch.Tensor,  # [..., kv_heads]
    dtype: torch.dtype,
) -> torch.Tensor:
    """Codes times their block scale, in `dtype`."""
    return (codes.float() * scales.unsqueeze(-2).unsqueeze(-1)).to(dtype)


def write_kv_block_scaled(
    cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] fp8/int8
    scales: torch.Tensor,  # [num_blocks, kv_heads] float32
    slots: torch.Tensor,  # [T] long: flat slot (block * block_size + offset) of each token
    x: torch.Tensor,  # [T, kv_heads, head_dim]
    unique_blocks: bool = False,
) -> None:
    """Quantize `x` into `cache` at `slots`, growing and applying the per-block scales.

    `unique_blocks`: every token goes to a different block (decode), which avoids a
    `torch.unique` (a host sync) and keeps the call capturable in a CUDA graph.
    """
    block_size, heads = cache.shape[1], cache.shape[2]
    target = SCALE_TARGET[cache.dtype]
    blocks = slots // block_size
    index = blocks[:, None].expand(-1, heads)  # [T, H]
    xf = x.float()
    # 1. Blocks whose first slot is written now start afresh (scale 0 before the update).
    first = (slots % block_size == 0)[:, None].expand(-1, heads)
    reset = torch.where(first, 0.0, torch.inf).to(scales.dtype)
    scales.scatter_reduce_(0, index, reset, "amin")
    touched = blocks if unique_blocks else torch.unique(blocks)
    old = scales[touched]  # [U, H] (a copy)
    # 2. Grow each block's scale to cover the new values.
    # amax times the float32 reciprocal of the target (not a division): CUDA torch divides by a
    # Python scalar that way and CPU torch does not; this spelling is one number everywhere, and
    # the fused decode kernel (tandem.kernels.rotary) computes the same.
    scales.scatter_reduce_(0, index, xf.abs().amax(-1) * (1.0 / target), "amax")
    new = scales[touched]
    # 3. Re-quantize what the touched blocks already hold. The ratio is exactly 1 where the scale
    #    did not grow (codes unchanged) and 0 for fresh blocks (stale codes cleared).
    ratio = torch.where(new > 0, old / new, 1.0)
    # Gathers and copies go through a byte view: not every device implements them for float8.
    raw = cache.view(torch.uint8)
    held = raw[touched].view(cache.dtype).float() * ratio[:, None, :, None]
    raw.index_copy_(0, touched, quantize_codes(held, cache.dtype).view(torch.uint8))
    # 4. The new tokens at their block's scale.
    s = scales[blocks]  # [T, H]
    inv = torch.where(s > 0, 1.0 / s, 0.0)
    codes = quantize_codes(xf * inv[:, :, None], cache.dtype)
    raw.view(-1, heads, cache.shape[3]).index_copy_(0, slots, codes.view(torch.uint8))
