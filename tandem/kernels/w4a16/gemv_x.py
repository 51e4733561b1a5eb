"""GemvX: x in the form the packed-fp16 GEMV reads (fp16 values scaled per group, with their
unscale and sum), written by the kernel that produces x (RMSNorm, silu*up) for its consumer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels._triton import tl, triton


@triton.jit
def _x_scale(amax):
    """Exponent field sf of the power of two that takes a group's largest |x| (amax) into
    [2**14, 2**15), clamped (an all-zero group; sf - 4 and 278 - sf stay valid fields), and
    from it sc = 2**(sf - 127), sc / 16 and 2**24 / sc as float32: (sf, sc, sc16, unscale)."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    sf = tl.minimum(tl.maximum(268 - e, 24), 254)
    sc = (sf << 23).to(tl.float32, bitcast=True)
    sc16 = ((sf - 4) << 23).to(tl.float32, bitcast=True)
    unscale = ((278 - sf) << 23).to(tl.float32, bitcast=True)
    return sf, sc, sc16, unscale


@dataclass
class GemvX:
    """A row of activations in the form `_gemv_h2_kernel` reads (XPREP), written by the kernel
    that produces x (`store_gemv_x`): per group of `group` inputs, x scaled by the power of two
    that puts its largest |x| in [2**14, 2**15) (the inputs at odd positions by a sixteenth of
    it, for the GEMV's x16 codes) as fp16; and per group, float32, 2**24 / scale and the sum of
    x; in input order (the GEMV pairs x0 with x4 and so on itself: storing the pairs instead, by
    16-bit stores permuted inside each 16-byte word, made RMSNorm 125 -> 410 us per decode step
    on the H200)."""

    scaled: torch.Tensor  # fp16 [M, K]
    scalars: torch.Tensor  # float32 [M, K // group, 2]
    group: int

    @staticmethod
    def empty(m: int, k: int, group: int, device: torch.device) -> GemvX:
        return GemvX(
            torch.empty((m, k), dtype=torch.float16, device=device),
            torch.empty((m, k // group, 2), dtype=torch.float32, device=device),
            group,
        )


@triton.jit
def store_gemv_x(
    v,  # [NG, GROUP] float32: x at groups g0 .. g0 + NG of one row (as the GEMV will read it)
    g0,
    n_cols,  # K; groups past it are not written
    scaled_ptr,  # this row of GemvX.scaled
    scal_ptr,  # this row of GemvX.scalars
    GROUP: tl.constexpr,
):
    """Write v's whole groups in the GemvX form (a producer kernel's epilogue; the producer
    computes in [groups, GROUP] tiles so that no reshape is needed here)."""
    gi = g0 + tl.arange(0, v.shape[0])
    gmask = (gi + 1) * GROUP <= n_cols
    _, sc, sc16, unscale = _x_scale(tl.max(tl.abs(v), axis=1))
    i = tl.arange(0, GROUP)
    h = (v * tl.where((i % 2 == 1)[None, :], sc16[:, None], sc[:, None])).to(tl.float16)
    tl.store(scaled_ptr + gi[:, None] * GROUP + i[None, :], h, mask=gmask[:, None])
    tl.store(scal_ptr + gi * 2, unscale, mask=gmask)
    tl.store(scal_ptr + gi * 2 + 1, tl.sum(v, axis=1), mask=gmask)


def gemv_x_ref(x: torch.Tensor, group: int) -> GemvX:
    """The GemvX form of x [M, K] (K a multiple of group) in plain torch: the reference the
    producer kernels are tested against."""
    m, k = x.shape
    v = x.float().reshape(m, k // group, group)
    amax = v.abs().amax(-1)
    e = (amax.view(torch.int32) >> 23) & 0xFF
    sf = (268 - e).clamp(24, 254)
    sc = (sf << 23).view(torch.float32)
    sc16 = ((sf - 4) << 23).view(torch.float32)
    odd = (torch.arange(group, device=x.device) % 2 == 1)[None, None, :]
    h = (v * torch.where(odd, sc16[..., None], sc[..., None])).to(torch.float16).reshape(m, k)
    scal = torch.stack([((278 - sf) << 23).view(torch.float32), v.sum(-1)], dim=-1)
    return GemvX(h.contiguous(), scal.contiguous(), group)
