"""Row-wise argmax in one Triton launch (CUDA), equal to `torch.argmax(x, dim=-1)`.

Greedy decoding takes the argmax of every row of the logits, [B, vocab] float32, once a token;
torch's reduction over one row of Llama-3's 128256 logits runs as a single block and took
26.8 us on the H200 (bench/quant_h200.py's `argmax` section, bench/results/h200_quant.json). Here each row is
split over many programs: each finds the largest value of its block and the first column that
holds it, stores both as one int64, and the last program of the row to finish (an acq_rel arrival
counter) takes the largest of those and re-zeroes the counter.

Semantics are torch's: the first of equal maxima, NaN above everything (the first NaN), and
-0.0 equal to 0.0. Values are compared as integers: the float's bits with the magnitude bits
flipped for negative values order like the floats themselves.
"""

from __future__ import annotations

import torch

from tandem.kernels._triton import tl, triton
from tandem.kernels.arrival import arrival_counters

_INT32_MAX = 2**31 - 1


@triton.jit
def _argmax_kernel(
    x_ptr,  # [B, V] float32
    out_ptr,  # [B] int64
    part_ptr,  # int64 [B, NB]: each block's (order key << 32) | (2**31 - 1 - column)
    cnt_ptr,  # int32 [B] arrival counters, zero between calls
    n_cols,
    stride_x,
    BLOCK: tl.constexpr,
    NB_P2: tl.constexpr,  # blocks per row, padded to a power of 2
):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    nb = tl.num_programs(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    v = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    v = tl.where(v == 0.0, 0.0, v)  # -0.0 is 0.0
    bits = v.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(v != v, 0x7FFFFFFF, key)  # NaN above +inf (0x7F800000)
    key = tl.where(mask, key, -(2**31))  # below -inf (0x807FFFFF here)
    best = tl.max(key, axis=0)
    first = tl.min(tl.where(key == best, cols, 0x7FFFFFFF), axis=0)
    packed = (best.to(tl.int64) << 32) | (0x7FFFFFFF - first).to(tl.int64)
    tl.store(part_ptr + row * nb + blk, packed)
    tl.debug_barrier()  # the block's result is written before the counter moves
    cnt = cnt_ptr + row
    arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if arrived == nb - 1:
        offs = tl.arange(0, NB_P2)
        parts = tl.load(part_ptr + row * nb + offs, mask=offs < nb, other=-(2**63),
                        cache_modifier=".cg")  # fmt: skip
        top = tl.max(parts, axis=0)
        tl.store(out_ptr + row, 0x7FFFFFFF - (top & 0xFFFFFFFF))
        tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next call


def argmax_triton(x: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """argmax over the last dim of a 2-D float32 x, [B] int64, in one launch."""
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(
            f"argmax_triton takes a 2-D float32 tensor, got {x.dtype} {tuple(x.shape)}"
        )
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of 2 >= 16, got {block}")
    b, v = x.shape
    if v == 0:
        raise ValueError("argmax of an empty row")
    if v >= _INT32_MAX:
        raise ValueError(f"rows of {v} values: columns must fit in 31 bits")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    if b == 0:
        return out
    nb = triton.cdiv(v, block)
    parts = torch.empty((b, nb), dtype=torch.int64, device=x.device)
    counters = arrival_counters(x.device, b)
    _argmax_kernel[(b, nb)](
        x, out, parts, counters, v, x.stride(0),
        BLOCK=block, NB_P2=triton.next_power_of_2(nb), num_warps=4,
    )  # fmt: skip
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for 2-D x: the one-launch Triton kernel for float32 on CUDA, torch's
    reduction otherwise."""
    if x.is_cuda and x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] > 0:
        return argmax_triton(x)
    return x.argmax(dim=-1)
