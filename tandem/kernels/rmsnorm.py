"""Fused residual-add + RMSNorm: a Triton kernel (CUDA) beside its plain-torch reference (CPU).

Semantics are Hugging Face's LlamaRMSNorm applied after the decoder's residual add:
    new_residual = x + residual                      (rounded to the activation dtype)
    h = float32(new_residual)
    out = weight * (h * rsqrt(mean(h^2) + eps)).to(activation dtype)
so the normalised value is rounded to the activation dtype before the weight multiply, and the
product takes torch's promoted dtype of (weight, activation), exactly as the unfused module does.
"""

from __future__ import annotations

import torch

from tandem.kernels import pdl
from tandem.kernels._triton import tl, triton
from tandem.kernels.w4a16 import GemvX, store_gemv_x


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [N, H]
    residual_ptr,  # [N, H], read only when HAS_RESIDUAL
    weight_ptr,  # [H]
    out_ptr,  # [N, H]
    new_residual_ptr,  # [N, H], written only when HAS_RESIDUAL
    n_cols,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    scaled_ptr,  # XQ: GemvX.scaled [N, H]
    scal_ptr,  # XQ: GemvX.scalars [N, H // GROUP, 2]
    perm_ptr,  # PERM: int32 [H], GemvX holds out[perm] (an act-order consumer's input order)
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # n_cols padded to a power of 2: one program holds a whole row
    PDL: tl.constexpr,
    XQ: tl.constexpr = False,  # also write the output in the INT4 GEMV's GemvX form
    GROUP: tl.constexpr = 128,
    ACC_IN: tl.constexpr = False,  # x: a GEMV's float32 accumulator, rounded here, then zeroed
    PERM: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    if XQ:  # the row as [groups, GROUP] tiles, the shape the GemvX epilogue works in
        cols = tl.arange(0, BLOCK // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    else:
        cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # no kernel writes it
    if PERM:  # a weight too
        src = tl.load(perm_ptr + cols, mask=mask, other=0)
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)

    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # issued beside h's load: with ACC_IN, not after the barrier below
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    if ACC_IN:
        # Rounded as the GEMV would have stored it; zeroed for the GEMV's next call once every
        # lane has read its part.
        h = h.to(new_residual_ptr.dtype.element_ty)
        tl.debug_barrier()
        tl.store(x_ptr + row * stride_x + cols, tl.zeros(cols.shape, tl.float32), mask=mask)
    h = h.to(tl.float32)
    if HAS_RESIDUAL:
        # Round the sum to the stored dtype before normalising it, as the unfused add does.
        s = (h + r).to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nr + cols, s, mask=mask)
        h = s.to(tl.float32)

    var = tl.sum(h * h) / n_cols
    normed = h * tl.rsqrt(var + eps)
    # The cast HF makes: back to the dtype of the tensor being normalised, before the weight.
    if HAS_RESIDUAL:
        normed = normed.to(new_residual_ptr.dtype.element_ty)
    else:
        normed = normed.to(x_ptr.dtype.element_ty)
    out = (normed.to(tl.float32) * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)
    if PERM:
        # The row in the consumer's input order, read back from the row just stored: after the
        # barrier every lane's stores are visible to the whole program.
        tl.debug_barrier()
        out = tl.load(out_ptr + row * stride_o + src, mask=mask, other=0.0)
    if XQ:
        store_gemv_x(out.to(tl.float32), 0, n_cols, scaled_ptr + row * n_cols,
                     scal_ptr + row * (2 * (n_cols // GROUP)), GROUP)  # fmt: skip


def rmsnorm_ref(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then Llama RMSNorm in plain torch; returns (out, new_residual)."""
    if residual is not None:
        x = x + residual
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype), x


def rmsnorm_triton(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]
    acc_input: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then Llama RMSNorm in one Triton pass; returns (out, new_residual).
    `acc_input`: x is an INT4 GEMV's float32 accumulator (`w4a16.gemv_accumulates`): it is
    rounded to the residual's dtype as the GEMV would have stored it, and left zeroed."""
    out, new_residual, _ = _rmsnorm_launch(x, weight, eps, residual, None, acc_input)
    return out, new_residual


def rmsnorm_gemv_x(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None,
    group: int,
    acc_input: bool = False,
    perm: torch.Tensor | None = None,  # int32 [H]
) -> tuple[torch.Tensor, torch.Tensor, GemvX]:
    """`rmsnorm_triton` that also writes its output in the GemvX form of the INT4 GEMV that
    reads it (`tandem.kernels.w4a16.gemv_x_group`), in the same pass. With `perm` (an
    act-order layer's input permutation) the GemvX form holds out[..., perm]; out itself is
    in the natural order."""
    hidden = x.shape[-1]
    if x.dim() != 2 or hidden % group or group & (group - 1):
        raise ValueError(f"GemvX needs [T, H] rows of whole groups: x {tuple(x.shape)}, "
                         f"group {group}")  # fmt: skip
    if perm is not None and (perm.shape != (hidden,) or perm.dtype != torch.int32):
        raise ValueError(f"perm must be int32 [{hidden}], got {perm.dtype} {tuple(perm.shape)}")
    xq = GemvX.empty(x.shape[0], hidden, group, x.device)
    out, new_residual, _ = _rmsnorm_launch(x, weight, eps, residual, xq, acc_input, perm)
    return out, new_residual, xq


def _rmsnorm_launch(x, weight, eps, residual, xq: GemvX | None, acc_input: bool = False, perm=None):
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden {hidden}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    if acc_input and (residual is None or x.dtype != torch.float32 or not x.is_contiguous()):
        raise ValueError(
            "acc_input needs a contiguous float32 accumulator and a residual (whose dtype it is "
            f"rounded to), got x {x.dtype} contiguous={x.is_contiguous()}, residual "
            f"{None if residual is None else residual.dtype}"
        )

    if weight.stride(0) != 1:
        weight = weight.contiguous()
    # Rows may be strided, columns must be contiguous (reshape copies only when they are not).
    x2 = x.reshape(-1, hidden)  # [N, H]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if residual is not None:
        new_dtype = residual.dtype if acc_input else torch.promote_types(x.dtype, residual.dtype)
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        new_residual = torch.empty(x.shape, dtype=new_dtype, device=x.device)
        nr2 = new_residual.view(-1, hidden)
        # The norm reads the rounded sum, so its "input dtype" is the sum's dtype.
        norm_dtype = new_dtype
    else:
        r2 = nr2 = x2  # unused by the kernel
        new_residual = x
        norm_dtype = x.dtype
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, norm_dtype), device=x.device)
    o2 = out.view(-1, hidden)
    rows = x2.shape[0]
    if rows == 0:
        return out, new_residual, xq

    block = triton.next_power_of_2(hidden)
    # Enough warps that each thread holds a handful of elements of the row.
    num_warps = min(16, max(1, block // 512))
    _rmsnorm_kernel[(rows,)](
        x2,
        r2,
        weight,
        o2,
        nr2,
        hidden,
        eps,
        x2.stride(0),
        r2.stride(0),
        o2.stride(0),
        nr2.stride(0),
        xq.scaled if xq is not None else o2,
        xq.scalars if xq is not None else o2,
        perm if perm is not None else o2,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        XQ=xq is not None,
        GROUP=xq.group if xq is not None else 128,
        ACC_IN=acc_input,
        PERM=perm is not None,
        num_warps=num_warps,
        **pdl.launch_options(x2),
    )
    return out, new_residual, xq


def rmsnorm(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]
    acc_input: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual-add + RMSNorm: the Triton kernel on CUDA, the torch reference elsewhere
    (`acc_input`: see `rmsnorm_triton`; CUDA only)."""
    if x.is_cuda:
        return rmsnorm_triton(x, weight, eps, residual, acc_input)
    if acc_input:
        raise ValueError("acc_input is for CUDA tensors")
    return rmsnorm_ref(x, weight, eps, residual)
