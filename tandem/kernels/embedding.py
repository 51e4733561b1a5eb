"""The token embedding lookup of a quantized table (a recipe's `model.embed_tokens` override, or
a tied INT4 LM head) in one Triton pass: gather each token's packed codes, scales and minimums,
dequantize, cast.

The torch path (`permute_rows(w, ids).dequantize(dtype)`) is about ten small launches (three
gathers, the unpacking shifts and masks, the two float32 operations and the cast), none of them
with programmatic dependent launch, at the head of every decode step. The arithmetic here is
that path's: code * scale, then + min, as two float32 operations (no fused multiply-add), then
rounded to the activation dtype, so the rows are bit-equal to it.
"""

from __future__ import annotations

import torch

from tandem.formats.weight import QuantizedWeight
from tandem.kernels import pdl
from tandem.kernels._triton import tl, triton


@triton.jit
def _embed_dequant_kernel(
    ids_ptr,  # [T] token ids
    qw_ptr,  # int32 [N, W] packed codes (any strides: row-major or N-major)
    s_ptr,  # fp16 [N, G] scales
    mn_ptr,  # fp16 [N, G] minimums (the value of code 0)
    out_ptr,  # [T, H]
    n_rows,  # N: ids outside [0, N) give zero rows
    n_cols,  # H
    stride_qn,
    stride_qw,
    stride_sn,
    stride_sg,
    stride_mn,
    stride_mg,
    stride_o,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    # The ids may come from a kernel (a decode graph's sampled tokens): read after the wait.
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    row = tl.load(ids_ptr + tok).to(tl.int64)
    PER: tl.constexpr = 32 // BITS
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    # Masks as vectors (the interpreter rejects a scalar one beside a vector).
    rows = cols.to(tl.int64) * 0 + row
    mask = (cols < n_cols) & (rows >= 0) & (rows < n_rows)
    row = tl.maximum(tl.minimum(row, n_rows - 1), 0)  # an address in the table either way
    word = tl.load(qw_ptr + row * stride_qn + (cols // PER) * stride_qw, mask=mask, other=0)
    code = (word >> ((cols % PER) * BITS)) & ((1 << BITS) - 1)
    g = cols // GROUP
    s = tl.load(s_ptr + row * stride_sn + g * stride_sg, mask=mask, other=0.0).to(tl.float32)
    mn = tl.load(mn_ptr + row * stride_mn + g * stride_mg, mask=mask, other=0.0).to(tl.float32)
    v = code.to(tl.float32) * s
    v = v + mn
    tl.store(out_ptr + tok * stride_o + cols, v.to(out_ptr.dtype.element_ty), mask=cols < n_cols)


def embed_dequant_triton(w: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` [T] of the quantized table `w` [N, H], dequantized to `dtype`: [T, H], equal
    to `permute_rows(w, ids).dequantize(dtype)` (ids outside [0, N) give zero rows; callers
    validate ids before they get here)."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
    if 32 % w.bits:
        raise ValueError(f"{w.bits}-bit codes do not pack whole into 32-bit words")
    if ids.device != w.qweight.device:
        raise ValueError(f"ids on {ids.device}, the table on {w.qweight.device}")
    t, h = ids.shape[0], w.in_features
    out = torch.empty((t, h), dtype=dtype, device=ids.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(h))
    _embed_dequant_kernel[(t, triton.cdiv(h, block))](
        ids, w.qweight, w.scales, w.mins, out, w.out_features, h,
        w.qweight.stride(0), w.qweight.stride(1), w.scales.stride(0), w.scales.stride(1),
        w.mins.stride(0), w.mins.stride(1), out.stride(0),
        BITS=w.bits,
        GROUP=w.group_size,
        BLOCK=block,
        num_warps=4,
        enable_fp_fusion=False,  # code * scale and + min rounded one by one, as torch does
        **pdl.launch_options(ids),
    )  # fmt: skip
    return out
