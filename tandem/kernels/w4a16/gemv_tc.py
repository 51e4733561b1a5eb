"""The INT4 GEMV on tensor cores for 2 <= M <= 32 (`_gemv_tc_kernel`): N-major codes become
bf16 pairs, one LOP3 per two codes, and the tensor cores multiply them by x."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.formats.weight import QuantizedWeight
from tandem.kernels import pdl
from tandem.kernels._triton import tl, triton
from tandem.kernels.w4a16._common import _compiled_cuda, _split_launch


@triton.jit
def _code_pairs(t, shift, ASM: tl.constexpr):
    """bf16 128 + code for t [n, k'] holding each word twice along k' (k' = 2w + h): bits 0..3
    of the word for even k', bits 16..19 for odd (`shift`, [k'], is 0 or 16). Compiled, one LOP3
    makes both values of a 32-bit register (code c under the bf16 exponent of 128 is 128 + c)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;",
            "=r,r,r",
            [t],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=2,
        )
    # The interpreter, one code at a time (through float32: its int -> bf16 cast is a bitcast).
    return (128 + ((t >> shift[None, :]) & 15)).to(tl.float32).to(tl.bfloat16)


@triton.jit
def _tc_slice(q, d: tl.constexpr, xt, part, offs_c, KP: tl.constexpr, ASM: tl.constexpr):
    """part + W_d x_d: codes d and d + 4 of every word of q [WPG, n] as bf16 [n, k'] (k' = 2w + h)
    times xt [k', BLOCK_M] on the tensor cores."""
    t = q >> (4 * d)
    tt = tl.reshape(tl.permute(tl.join(t, t), (1, 0, 2)), (t.shape[1], KP))  # [n, k']
    w = _code_pairs(tt, (offs_c % 2) * 16, ASM)
    if ASM:
        return tl.dot(w, xt.to(tl.bfloat16), part)
    # The interpreter's dot: float32 operands (the values are the same).
    return tl.dot(w.to(tl.float32), xt.to(tl.float32), part, input_precision="ieee")


@triton.jit
def _gemv_tc_kernel(
    x_ptr,  # [M, K] bf16 activations
    qw_ptr,  # packed codes, N-major (word w of row n at qw_ptr + w * stride_qw + n)
    s_ptr,  # fp16 scales, group g of row n at s_ptr + g * stride_sg + n
    mn_ptr,  # fp16 zero points (value of code 0), same layout
    out_ptr,  # [M, N]
    ws_ptr,  # float32 [SPLIT, M, N] partial sums (REDUCE)
    cnt_ptr,  # int32 arrival counters, zero between calls (REDUCE)
    M,
    N,
    K,
    G,  # groups per row
    groups_per_split,
    SPLIT,
    stride_xm,
    stride_qw,
    stride_sg,
    stride_om,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows of x per program: 16 (the matrix instruction's smallest) to 64
    REDUCE: tl.constexpr,
    ONE_ROW: tl.constexpr,  # M == 1: the group sums of x are scalars
    ASM: tl.constexpr,
    PDL: tl.constexpr,
):
    """INT4 x bf16 on the tensor cores, BLOCK_M rows of x per program, N-major codes: codes
    become bf16 pairs in registers and the matrix instruction multiplies them by x, so a code
    costs half a LOP3 and ~0.4 of a shift instead of the FFMA kernel's LOP3, FFMA, shifts and x
    handling.

    Word w of a group holds codes k = 8w + j at bits 4j. (q >> 4d) under the mask 0x000F000F
    gives codes d and d + 4 as the two bf16 halves of one register, 128 + c each (exact). The
    product for slice d runs over k' = 2w + h (h: low or high half), that is input k = 4k' + d,
    so x is read at stride 4. Per group and column: sum_k x (128 + c) = 128 X + sum_k x c, with
    X the group's sum of x, and y += s * (that) + (zero - 128 s) * X, all in float32.
    The weight is the matrix instruction's first operand ([BLOCK_N, k']) and x^T the second,
    BLOCK_M columns (rows of x past M are zeros; each block of BLOCK_M rows re-reads the weight).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    WPG: tl.constexpr = GROUP // 8
    KP: tl.constexpr = 2 * WPG  # k' per slice
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, WPG)
    offs_c = tl.arange(0, KP)
    offs_g = tl.arange(0, GROUP)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    x_rows = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm  # [1, BLOCK_M]
    q_cols = qw_ptr + offs_n[None, :]

    g_start = pid_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, G)
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # Scales, zero points and the group's x are loaded a group ahead: their latency would
    # otherwise stall every group (the codes are pipelined by Triton, num_stages).
    # (Every program has at least one group: the launch sizes the splits so.)
    s_next = tl.load(s_ptr + g_start * stride_sg + offs_n, mask=n_mask)
    mn_next = tl.load(mn_ptr + g_start * stride_sg + offs_n, mask=n_mask)
    kx = g_start * GROUP + offs_g
    if ONE_ROW:
        x_next = tl.load(x_ptr + kx, mask=kx < K, other=0.0)
    else:
        x_next = tl.load(x_rows + kx[:, None], mask=(kx < K)[:, None] & m_mask[None, :], other=0.0)
    col0 = (tl.arange(0, BLOCK_M) == 0)[None, :]
    for g in range(g_start, g_end):
        q = tl.load(
            q_cols + (g * WPG + offs_w)[:, None].to(tl.int64) * stride_qw,
            mask=n_mask[None, :],
            other=0,
        )  # [WPG, BLOCK_N]
        s = s_next.to(tl.float32)
        mn = mn_next.to(tl.float32)
        xg = x_next  # [GROUP] (one row) or [GROUP, BLOCK_M], bf16
        gn = g + 1
        # (gn < g_end as a tensor: the interpreter refuses a scalar inside a mask.)
        nmask = n_mask & ((offs_n * 0 + gn) < g_end)
        s_next = tl.load(s_ptr + gn * stride_sg + offs_n, mask=nmask)
        mn_next = tl.load(mn_ptr + gn * stride_sg + offs_n, mask=nmask)
        kx = gn * GROUP + offs_g
        kmask = (kx < K) & ((offs_g * 0 + gn) < g_end)
        xs = tl.sum(xg.to(tl.float32), axis=0)  # the group's sum of x: a scalar, or [BLOCK_M]
        # x at k = 4k' + d for slice d: [k', a, b] with d = 2a + b.
        if ONE_ROW:
            x_next = tl.load(x_ptr + kx, mask=kmask, other=0.0)
            xa, xb = tl.split(tl.reshape(xg, (KP, 2, 2)))
            x0, x2 = tl.split(xa)
            x1, x3 = tl.split(xb)
            x0 = tl.where(col0, x0[:, None], 0.0)
            x1 = tl.where(col0, x1[:, None], 0.0)
            x2 = tl.where(col0, x2[:, None], 0.0)
            x3 = tl.where(col0, x3[:, None], 0.0)
        else:
            x_next = tl.load(x_rows + kx[:, None], mask=kmask[:, None] & m_mask[None, :], other=0.0)
            x4 = tl.permute(tl.reshape(xg, (KP, 2, 2, BLOCK_M)), (0, 3, 1, 2))  # [k', m, a, b]
            xa, xb = tl.split(x4)
            x0, x2 = tl.split(xa)
            x1, x3 = tl.split(xb)
        part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        part = _tc_slice(q, 0, x0, part, offs_c, KP, ASM)
        part = _tc_slice(q, 1, x1, part, offs_c, KP, ASM)
        part = _tc_slice(q, 2, x2, part, offs_c, KP, ASM)
        part = _tc_slice(q, 3, x3, part, offs_c, KP, ASM)
        if ONE_ROW:
            acc += s[:, None] * part + ((mn - 128.0 * s) * xs)[:, None]
        else:
            acc += s[:, None] * part + (mn - 128.0 * s)[:, None] * xs[None, :]
    out = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    omask = n_mask[:, None] & m_mask[None, :]
    if REDUCE:
        ws = ws_ptr + (pid_k * M + offs_m).to(tl.int64)[None, :] * N + offs_n[:, None]
        tl.store(ws, acc, mask=omask)
        tl.debug_barrier()  # every thread's partials are written before the counter moves
        cnt = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for sk in range(0, SPLIT):
                total += tl.load(
                    ws_ptr + (sk * M + offs_m).to(tl.int64)[None, :] * N + offs_n[:, None],
                    mask=omask,
                    other=0.0,
                    cache_modifier=".cg",
                )
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next call
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=omask)


@dataclass(frozen=True)
class GemvTCConfig:
    """`_gemv_tc_kernel`: INT4, N-major codes, tensor cores, `block_m` rows of x per program."""

    block_n: int = 256
    split_k: int = 4
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 16  # rows of x per program (16, 32 or 64); more rows re-read the weight


def launch_gemv_tc(x: torch.Tensor, w: QuantizedWeight, config: GemvTCConfig):
    """(output, the compiled kernel launched) of `_gemv_tc_kernel`."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"GemvTCConfig needs bf16 activations, got {x.dtype}")
    m = x.shape[0]
    m_blocks = triton.cdiv(m, config.block_m)
    sl = _split_launch(x, w, config.block_n, config.split_k, m_blocks, "GemvTCConfig")
    kernel = _gemv_tc_kernel[(sl.blocks, sl.split, m_blocks)](
        *sl.args(x, w),
        GROUP=w.group_size,
        BLOCK_N=config.block_n,
        BLOCK_M=config.block_m,
        REDUCE=sl.split > 1,
        ONE_ROW=m == 1,
        ASM=_compiled_cuda(x),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl.launch_options(x),
    )
    return sl.out, kernel
