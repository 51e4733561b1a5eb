"""W4A16 / W8A16 matrix multiply: Triton kernels (CUDA) beside the torch reference (CPU).

y[M, N] = x[M, K] @ W^T with W held as per-group integer codes (see `tandem.quant.format`):
    W[n, k] = q[n, k] * scale[n, k // G] + min[n, k // G]

Two kernels, both dequantizing in registers (the weight is read from memory once, packed):
- `_gemv_kernel` for M = 1 (single-stream decode, memory-bound): one program per BLOCK_N output
  rows streams their packed words and keeps a [BLOCK_N, BLOCK_W] float32 accumulator. The zero
  point is folded out of the inner loop: sum_k (q s + m) x = s * sum_k q x + m * sum_k x per group.
- `_gemm_kernel` for M > 1: a tiled tl.dot over dequantized [BLOCK_K, BLOCK_N] weight tiles in
  the activation dtype, float32 accumulation.
Both can split K across programs (SPLIT_K > 1) for small grids; the partial sums are then added
with float32 atomics into a zeroed buffer that is cast to the activation dtype afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tandem.quant.format import QuantizedWeight


def w4a16_matmul_ref(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [M, K] @ dequantize(w)^T in x's dtype: the plain-torch reference (used on CPU)."""
    return F.linear(x, w.dequantize(x.dtype))


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
    stride_sn,
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
            q = tl.load(q_row + wi[None, :])  # [BLOCK_N, BLOCK_W] int32
            s = tl.load(s_row + g[None, :]).to(tl.float32)
            mn = tl.load(mn_row + g[None, :]).to(tl.float32)
        else:
            w_mask = wi < w_end
            mask = n_mask[:, None] & w_mask[None, :]
            q = tl.load(q_row + wi[None, :], mask=mask, other=0)
            s = tl.load(s_row + g[None, :], mask=mask, other=0.0).to(tl.float32)
            mn = tl.load(mn_row + g[None, :], mask=mask, other=0.0).to(tl.float32)
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
    stride_sn,
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
        q = tl.load(qw_ptr + rows[None, :] * stride_qn + wi[:, None], mask=mask, other=0)
        g = (wi * PER) // GROUP
        s = tl.load(s_ptr + rows[None, :] * stride_sn + g[:, None], mask=mask, other=0.0)
        mn = tl.load(mn_ptr + rows[None, :] * stride_sn + g[:, None], mask=mask, other=0.0)
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
class GemvConfig:
    block_n: int = 8
    block_w: int = 64
    split_k: int = 1
    num_warps: int = 4


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def default_config(m: int, n: int, k: int, device: torch.device) -> GemvConfig | GemmConfig:
    """A launch configuration by shape: enough programs in flight to cover every SM."""
    sms = _num_sms(device)
    if m == 1:
        # The best of the sweep in bench/results/h200_quant.json (H200, Llama-3-8B shapes).
        return GemvConfig(block_n=8, block_w=256 if n >= 8192 else 128, split_k=1, num_warps=4)
    if m > 64 and n >= 8192:
        return GemmConfig(block_m=128, block_n=128, block_k=64, split_k=1, num_warps=8)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    # Split K while the grid is under two programs per SM and each split keeps >= 1024 inputs.
    while tiles * split < 2 * sms and k // (split * 2) >= 1024:
        split *= 2
    warps = 4 if block_m * block_n <= 64 * 64 else 8
    return GemmConfig(block_m=block_m, block_n=block_n, block_k=128, split_k=split, num_warps=warps)


def w4a16_matmul_triton(
    x: torch.Tensor,  # [M, K]
    w: QuantizedWeight,
    config: GemvConfig | GemmConfig | None = None,
) -> torch.Tensor:
    """x @ dequantize(w)^T with the Triton kernels; returns [M, N] in x's dtype."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of shape {w.shape}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = w.out_features
    per = 32 // w.bits
    kw = w.qweight.shape[1]
    if config is None:
        config = default_config(m, n, k, x.device)
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    if isinstance(config, GemvConfig):
        block_w = config.block_w
        words = triton.cdiv(triton.cdiv(kw, config.split_k), block_w) * block_w
        split = triton.cdiv(kw, words)
    else:
        block_w = config.block_k // per
        words = triton.cdiv(triton.cdiv(kw, config.split_k), block_w) * block_w
        split = triton.cdiv(kw, words)
    atomic = split > 1
    out = (
        torch.zeros((m, n), dtype=torch.float32, device=x.device)
        if atomic
        else torch.empty((m, n), dtype=x.dtype, device=x.device)
    )
    common = (w.qweight, w.scales, w.mins, out)
    if isinstance(config, GemvConfig):
        _gemv_kernel[(triton.cdiv(n, config.block_n), split, m)](
            x,
            *common,
            n,
            k,
            words,
            kw,
            x.stride(0),
            w.qweight.stride(0),
            w.scales.stride(0),
            out.stride(0),
            BITS=w.bits,
            GROUP=w.group_size,
            BLOCK_N=config.block_n,
            BLOCK_W=block_w,
            ATOMIC=atomic,
            EVEN=n % config.block_n == 0 and kw % block_w == 0 and k == kw * per,
            num_warps=config.num_warps,
        )
    else:
        dot_fp32 = x.dtype == torch.float32 or not x.is_cuda
        grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), split)
        _gemm_kernel[grid](
            x,
            *common,
            m,
            n,
            k,
            words,
            kw,
            x.stride(0),
            w.qweight.stride(0),
            w.scales.stride(0),
            out.stride(0),
            BITS=w.bits,
            GROUP=w.group_size,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            ATOMIC=atomic,
            DOT_FP32=dot_fp32,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    return out.to(x.dtype) if atomic else out


def w4a16_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [..., K] @ W^T: the Triton kernels on CUDA, the torch reference elsewhere."""
    if not x.is_cuda:
        return w4a16_matmul_ref(x, w)
    lead = x.shape[:-1]
    y = w4a16_matmul_triton(x.reshape(-1, x.shape[-1]), w)
    return y.view(*lead, w.out_features)
