"""One-row W4A16 / W8A16 GEMVs in float32 FMAs: `_gemv_kernel` on row-major codes (and INT8),
`_gemv_nmajor_kernel` on N-major INT4 codes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.formats.weight import QuantizedWeight
from tandem.kernels import pdl
from tandem.kernels._triton import tl, triton
from tandem.kernels.w4a16._common import (
    _code_hi,
    _code_lo,
    _code_words,
    _compiled_cuda,
    _finish_row,
    _row_program,
    _scales_of_group,
    _split_launch,
)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] activations
    qw_ptr,  # [N, KW] int32 packed codes
    s_ptr,  # [N, Kp // GROUP] fp16 scales
    mn_ptr,  # [N, Kp // GROUP] fp16 zero points (value of code 0)
    out_ptr,  # [M, N] (float32 when ATOMIC)
    N,
    K,
    words_per_split,  # packed words each K-split covers (a multiple of BLOCK_W)
    KW,  # packed words per row
    stride_xm,
    stride_qn,
    stride_qw,
    stride_sn,
    stride_sg,
    stride_om,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,  # packed words per row per iteration
    ATOMIC: tl.constexpr,
    EVEN: tl.constexpr,  # whole tiles only (N, K and the split sizes divide evenly): no masks
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2).to(tl.int64)
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    q_row = qw_ptr + rows[:, None] * stride_qn
    s_row = s_ptr + rows[:, None] * stride_sn
    mn_row = mn_ptr + rows[:, None] * stride_sn
    x_row = x_ptr + m * stride_xm
    offs_w = tl.arange(0, BLOCK_W)

    w_start = pid_k * words_per_split
    w_end = tl.minimum(w_start + words_per_split, KW)
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    for w0 in range(w_start, w_end, BLOCK_W):
        wi = w0 + offs_w  # [BLOCK_W] word index
        g = (wi * PER) // GROUP
        if EVEN:
            q = tl.load(q_row + wi[None, :] * stride_qw)  # [BLOCK_N, BLOCK_W] int32
            s = tl.load(s_row + g[None, :] * stride_sg).to(tl.float32)
            mn = tl.load(mn_row + g[None, :] * stride_sg).to(tl.float32)
        else:
            w_mask = wi < w_end
            mask = n_mask[:, None] & w_mask[None, :]
            q = tl.load(q_row + wi[None, :] * stride_qw, mask=mask, other=0)
            s = tl.load(s_row + g[None, :] * stride_sg, mask=mask, other=0.0).to(tl.float32)
            mn = tl.load(mn_row + g[None, :] * stride_sg, mask=mask, other=0.0).to(tl.float32)
        qx = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        xsum = tl.zeros([BLOCK_W], dtype=tl.float32)
        for j in tl.static_range(PER):
            k = wi * PER + j
            if EVEN:
                xj = tl.load(x_row + k).to(tl.float32)
            else:
                xj = tl.load(x_row + k, mask=w_mask & (k < K), other=0.0).to(tl.float32)
            xsum += xj
            # >> is arithmetic on int32: the mask drops the sign bits of the top code. (Decoding
            # through the float exponent instead of a convert measured no faster on the H200.)
            cj = ((q >> (j * BITS)) & MASK).to(tl.float32)
            qx += cj * xj[None, :]
        acc += s * qx + mn * xsum[None, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if ATOMIC:
        tl.atomic_add(out_ptr + m * stride_om + offs_n, y, mask=n_mask)
    elif EVEN:
        tl.store(out_ptr + m * stride_om + offs_n, y.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + m * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemv_nmajor_kernel(
    x_ptr,  # [M, K] activations
    qw_ptr,  # packed codes, word w of row n at qw_ptr + w * stride_qw + n (N-major storage)
    s_ptr,  # fp16 scales, group g of row n at s_ptr + g * stride_sg + n
    mn_ptr,  # fp16 zero points (value of code 0), same layout as the scales
    out_ptr,  # [M, N]
    ws_ptr,  # float32 [SPLIT, M, N] partial sums (REDUCE)
    cnt_ptr,  # int32 [M * cdiv(N, BLOCK_N)] arrival counters, zero between calls (REDUCE)
    M,
    N,
    K,
    G,  # groups per row (Kp // GROUP)
    groups_per_split,
    SPLIT,  # programs along K
    stride_xm,
    stride_qw,
    stride_sg,
    stride_om,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    REDUCE: tl.constexpr,  # SPLIT > 1: the last program of a column block adds the partials
    SPLIT_P2: tl.constexpr,  # SPLIT rounded up to a power of 2 (the partials' load)
    EVEN: tl.constexpr,  # N a multiple of BLOCK_N and K == Kp: no masks
    ASM: tl.constexpr,  # PTX lop3 for the code -> float step (compiled CUDA, not the interpreter)
    PDL: tl.constexpr,  # programmatic dependent launch: the first group's codes load before the wait
    X_PAIRS: tl.constexpr,  # EVEN, compiled, bf16 x with 4-byte aligned rows: x read in pairs
):
    """INT4 GEMV over N-major packed codes: the weight is read as 16-byte vectors across output
    rows, x as broadcasts, and codes become floats without an int->float convert.

    Codes j and j+1 of a word (bits 4j..4j+7) are moved by one shift to bits 15..22; each is
    then masked and OR-ed under a float exponent in one LOP3: code j (bits 15..18) under 256.0
    gives v = 256 + c, code j+1 (bits 19..22) under 16.0 gives v = 16 + c, both exact. So
    v * x = offset * x + c * x and sum_k v x = X' + sum_k c x, X' = sum_k offset_k x_k per
    group. No quarter-rate int->float convert: ~4 instructions per code in all (the SASS count
    of the loop, bench/gemv_probe.py --dump), one LOP3, half a shift and one FFMA of them per code.

    The next group's codes are loaded before this group's are used (two loads in flight per
    program). K is split over SPLIT programs; each writes its partial sums, and the last to
    arrive at its column block (an acq_rel counter) adds them and writes the output, then
    resets the counter: no zero-fill and no cast kernel around the GEMV.
    """
    WPG: tl.constexpr = GROUP // 8  # words per group
    pid_n, pid_k, m, offs_n, n_mask, offs_w, x_row, q_cols, g_start, g_end, w_end, q_next = (
        _row_program(x_ptr, qw_ptr, N, G, groups_per_split, stride_xm, stride_qw, BLOCK_N, WPG)
    )
    offs_k = tl.arange(0, GROUP)
    # The codes ride on 256 (j even) or 16 (j odd): sum_k v x = X' + sum_k c x with
    # X' = sum_k offset_k x_k.
    k_offset = tl.where(offs_k % 2 == 0, 256.0, 16.0)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Codes are never written by a kernel: with PDL they load while the previous kernel finishes.
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    for g in range(g_start, g_end):
        q = q_next
        wi = g * WPG + offs_w  # [WPG] word index
        q_next = _code_words(q_cols, wi + WPG, w_end, n_mask, stride_qw)  # the next group's
        s, mn = _scales_of_group(s_ptr, mn_ptr, g, stride_sg, offs_n, n_mask, EVEN)
        kx = g * GROUP + offs_k
        if EVEN:
            xg = tl.load(x_row + kx).to(tl.float32)
        else:
            xg = tl.load(x_row + kx, mask=kx < K, other=0.0).to(tl.float32)
        x_sum = tl.sum(xg, axis=0)
        xp_sum = tl.sum(xg * k_offset, axis=0)
        for j in tl.static_range(0, 8, 2):
            if X_PAIRS:  # bf16 x: one 32-bit load per pair, each half to float32 by a mask/shift
                xp = tl.load((x_row + wi * 8 + j).to(tl.pointer_type(tl.int32)))
                xa = (xp << 16).to(tl.float32, bitcast=True)
                xb = (xp & -65536).to(tl.float32, bitcast=True)
            elif EVEN:
                xa = tl.load(x_row + wi * 8 + j).to(tl.float32)
                xb = tl.load(x_row + wi * 8 + j + 1).to(tl.float32)
            else:
                ka = wi * 8 + j
                xa = tl.load(x_row + ka, mask=ka < K, other=0.0).to(tl.float32)
                xb = tl.load(x_row + ka + 1, mask=ka + 1 < K, other=0.0).to(tl.float32)
            if j == 0:
                t = q << 15
            elif j == 2:
                t = q << 7
            elif j == 4:
                t = q >> 1
            else:
                t = q >> 9
            if j == 0:  # the first product starts the sums (no zero-fill)
                part = _code_lo(t, ASM) * xa[:, None]
            else:
                part += _code_lo(t, ASM) * xa[:, None]  # two separate FFMAs
            part += _code_hi(t, ASM) * xb[:, None]
        acc += s * (tl.sum(part, axis=0) - xp_sum) + mn * x_sum
    out = out_ptr + m.to(tl.int64) * stride_om + offs_n
    _finish_row(acc, out, ws_ptr, cnt_ptr, pid_n, pid_k, m, M, N, offs_n, n_mask, SPLIT,
                REDUCE, SPLIT_P2, EVEN)  # fmt: skip


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8
    block_w: int = 64
    split_k: int = 1
    num_warps: int = 4


@dataclass(frozen=True)
class GemvNConfig:
    """`_gemv_nmajor_kernel`: INT4, M = 1, N-major codes (`n_major`)."""

    block_n: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2


def launch_gemv_nmajor(x: torch.Tensor, w: QuantizedWeight, config: GemvNConfig):
    """(output, the compiled kernel launched): the latter for benchmarks that read its code."""
    m, k = x.shape
    n = w.out_features
    sl = _split_launch(x, w, config.block_n, config.split_k, m, "GemvNConfig")
    split = sl.split
    even = n % config.block_n == 0 and k == sl.groups * w.group_size
    compiled = _compiled_cuda(x)
    kernel = _gemv_nmajor_kernel[(sl.blocks, split, m)](
        *sl.args(x, w),
        GROUP=w.group_size,
        BLOCK_N=config.block_n,
        REDUCE=split > 1,
        SPLIT_P2=triton.next_power_of_2(split),
        EVEN=even,
        ASM=compiled,
        X_PAIRS=even
        and compiled
        and x.dtype == torch.bfloat16
        and x.data_ptr() % 4 == 0
        and x.stride(0) % 2 == 0,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl.launch_options(x),
    )
    return sl.out, kernel
