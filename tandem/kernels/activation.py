"""SwiGLU's `silu(gate) * up` in one Triton pass (CUDA) beside the two eager ops it replaces.

Numerics are the eager ops' in the activation dtype: silu is computed in float32 and rounded,
then the product is computed in float32 and rounded again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels import pdl
from tandem.kernels._triton import tl, triton
from tandem.kernels.w4a16 import GemvX, store_gemv_x


@triton.jit
def _silu_mul_kernel(
    x_ptr,  # [T, 2 I]: gate in [:I], up in [I:]
    out_ptr,  # [T, I]
    n_cols,  # I
    stride_x,
    stride_o,
    scaled_ptr,  # XQ: GemvX.scaled [T, I]
    scal_ptr,  # XQ: GemvX.scalars [T, I // GROUP, 2]
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    XQ: tl.constexpr = False,  # also write the output in the INT4 GEMV's GemvX form
    GROUP: tl.constexpr = 128,
    ACC_IN: tl.constexpr = False,  # x: a GEMV's float32 accumulator, rounded here, then zeroed
):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    if XQ:  # [groups, GROUP] tiles, the shape the GemvX epilogue works in
        cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK // GROUP)[:, None] * GROUP
                + tl.arange(0, GROUP)[None, :])  # fmt: skip
    else:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    if ACC_IN:  # rounded as the GEMV would have stored them; zeroed once every lane has read
        g = g.to(dt)
        u = u.to(dt)
        tl.debug_barrier()
        zero = tl.zeros(cols.shape, tl.float32)
        tl.store(x_ptr + row * stride_x + cols, zero, mask=mask)
        tl.store(x_ptr + row * stride_x + n_cols + cols, zero, mask=mask)
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    y = (s * u).to(dt)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
    if XQ:
        store_gemv_x(y.to(tl.float32), tl.program_id(1) * (BLOCK // GROUP), n_cols,
                     scaled_ptr + row * n_cols, scal_ptr + row * (2 * (n_cols // GROUP)),
                     GROUP)  # fmt: skip


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 I] -> silu(x[..., :I]) * x[..., I:]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 I] -> silu(x[..., :I]) * x[..., I:] in one pass."""
    return _silu_mul_launch(x, None)[0]


def silu_and_mul_gemv_x(
    x: torch.Tensor, group: int, acc_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, GemvX]:
    """`silu_and_mul_triton` that also writes its output in the GemvX form of the INT4 GEMV that
    reads it (`tandem.kernels.w4a16.gemv_x_group`), in the same pass. `acc_dtype`: x is an INT4
    GEMV's float32 accumulator (`w4a16.gemv_accumulates`), rounded to this dtype as the GEMV
    would have stored it (the output's dtype too), and left zeroed."""
    n = x.shape[-1] // 2
    if x.dim() != 2 or n % group or group & (group - 1) or group > 1024:
        raise ValueError(f"GemvX needs [T, 2 I] rows of whole groups: x {tuple(x.shape)}, "
                         f"group {group}")  # fmt: skip
    return _silu_mul_launch(x, GemvX.empty(x.shape[0], n, group, x.device), acc_dtype)


def _silu_mul_launch(
    x: torch.Tensor, xq: GemvX | None, acc_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, GemvX | None]:
    width = x.shape[-1]
    if width % 2:
        raise ValueError(f"last dimension {width} is not even (gate and up halves)")
    if acc_dtype is not None and (x.dtype != torch.float32 or not x.is_contiguous()):
        raise ValueError(f"acc_dtype needs a contiguous float32 accumulator, got {x.dtype}")
    n = width // 2
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], n), dtype=acc_dtype or x.dtype, device=x.device)
    o2 = out.view(-1, n)
    rows = x2.shape[0]
    if rows == 0 or n == 0:
        return out, xq
    # (A power of 2, so a multiple of the GemvX group: whole groups per program.) One row read
    # from a GEMV's float32 row and written in GemvX form: a group per one-warp program (H200,
    # Llama-3-8B shape: the INT4 step 1.737 against
    # 1.751 ms with 1024 per 4 warps, and bf16 4.398 against 4.389 ms with it, so only there).
    per_group = xq is not None and acc_dtype is not None and rows == 1
    block = min(xq.group if per_group else 1024, triton.next_power_of_2(n))
    if xq is not None:
        block = max(block, xq.group)
    if block & (block - 1):
        raise ValueError(f"the GemvX group must be a power of 2, got {block}")
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](
        x2,
        o2,
        n,
        x2.stride(0),
        o2.stride(0),
        xq.scaled if xq is not None else o2,
        xq.scalars if xq is not None else o2,
        BLOCK=block,
        XQ=xq is not None,
        GROUP=xq.group if xq is not None else 128,
        ACC_IN=acc_dtype is not None,
        num_warps=1 if per_group else 4,
        **pdl.launch_options(x2),
    )
    return out, xq


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: the Triton kernel on CUDA, the eager ops elsewhere."""
    return silu_and_mul_triton(x) if x.is_cuda else silu_and_mul_ref(x)
