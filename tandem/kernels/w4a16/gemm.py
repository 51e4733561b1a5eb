"""The tiled W4A16 / W8A16 GEMM (`_gemm_kernel`) for the other M > 1 cases, either layout: a
tl.dot over dequantized weight tiles in the activation dtype, float32 accumulation."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.kernels._triton import tl, triton


@triton.jit
def _gemm_kernel(
    x_ptr,  # [M, K]
    qw_ptr,  # [N, KW] int32
    s_ptr,  # [N, Kp // GROUP] fp16
    mn_ptr,  # [N, Kp // GROUP] fp16
    out_ptr,  # [M, N] (float32 when ATOMIC)
    M,
    N,
    K,
    words_per_split,  # a multiple of BLOCK_K // PER
    KW,
    stride_xm,
    stride_qn,
    stride_qw,
    stride_sn,
    stride_sg,
    stride_om,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # input features per iteration (a multiple of 32 // BITS)
    ATOMIC: tl.constexpr,
    DOT_FP32: tl.constexpr,  # fp32 operands (fp32 activations, or bf16 under the interpreter)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    PER: tl.constexpr = 32 // BITS
    BLOCK_W: tl.constexpr = BLOCK_K // PER
    MASK: tl.constexpr = (1 << BITS) - 1

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_w = tl.arange(0, BLOCK_W)
    offs_j = tl.arange(0, PER)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm

    w_start = pid_k * words_per_split
    w_end = tl.minimum(w_start + words_per_split, KW)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for w0 in range(w_start, w_end, BLOCK_W):
        wi = w0 + offs_w
        mask = (wi < w_end)[:, None] & n_mask[None, :]
        q = tl.load(
            qw_ptr + rows[None, :] * stride_qn + wi[:, None] * stride_qw, mask=mask, other=0
        )
        g = (wi * PER) // GROUP
        s_off = rows[None, :] * stride_sn + g[:, None] * stride_sg
        s = tl.load(s_ptr + s_off, mask=mask, other=0.0)
        mn = tl.load(mn_ptr + s_off, mask=mask, other=0.0)
        codes = (q[:, None, :] >> (offs_j * BITS)[None, :, None]) & MASK  # [BLOCK_W, PER, BLOCK_N]
        w = codes.to(tl.float32) * s.to(tl.float32)[:, None, :] + mn.to(tl.float32)[:, None, :]
        w = tl.reshape(w, (BLOCK_K, BLOCK_N))  # row kw * PER + j: input feature order
        k = w0 * PER + offs_k
        x = tl.load(
            x_rows + k[None, :],
            mask=m_mask[:, None] & ((k < K) & (k < w_end * PER))[None, :],
            other=0.0,
        )
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    omask = m_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=omask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=omask)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
