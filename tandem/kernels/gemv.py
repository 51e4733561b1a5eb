"""y = x @ W^T for a single row x (batch-1 decode): a Triton matrix-vector product on CUDA.

At batch 1 every linear layer is a pass over its weight, so its speed is the memory bandwidth the
kernel sustains. cuBLAS measured about 0.85 of the H200's copy bandwidth on Llama-3-8B's shapes
(bench/results/h200_quant.json); this kernel streams each weight row block once with wide,
contiguous loads, several programs per multiprocessor, and keeps a float32 accumulator per
(row, column lane) that is reduced once at the end. The tile shape is chosen per (N, K) by
Triton's autotuner on first use (timed with the L2 cache flushed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels import pdl
from tandem.kernels._triton import tl, triton

_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=nw)
    for bn, bk, nw in [
        (2, 2048, 4),
        (4, 1024, 4),
        (4, 2048, 8),
        (8, 512, 4),
        (8, 1024, 8),
        (16, 256, 4),
        (16, 512, 8),
    ]
]


@triton.autotune(configs=_CONFIGS, key=["N", "K"])
@triton.jit
def _gemv_kernel(
    x_ptr,  # [K]
    w_ptr,  # [N, K], unit column stride
    bias_ptr,  # [N], read only when HAS_BIAS
    y_ptr,  # [N]
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    # The first weight tile is read before the wait for the previous kernel (no kernel writes
    # weights), so with PDL it loads while that kernel finishes.
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    w = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    acc = w.to(tl.float32) * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def gemv_triton(
    x: torch.Tensor,  # [1, K]
    w: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """[1, K] @ [N, K]^T (+ bias) -> [1, N] in x's dtype, float32 accumulation."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes one row, got x of shape {tuple(x.shape)}")
    n, k = w.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, weight has {k}")
    if w.stride(1) != 1:
        w = w.contiguous()
    x = x.contiguous()
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _gemv_kernel[grid](
        x,
        w,
        bias if bias is not None else y,
        y,
        n,
        k,
        w.stride(0),
        HAS_BIAS=bias is not None,
        **pdl.launch_options(x),
    )
    return y


def linear_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the Triton GEMV for a single CUDA row."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and w.dtype == x.dtype:
        return gemv_triton(x, w, bias)
    return F.linear(x, w, bias)
