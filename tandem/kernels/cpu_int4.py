"""y = x @ W^T on CPU for a per-group integer weight, reading its 4-bit codes (W4A16 on CPU).

PyTorch's CPU INT4 kernel (`aten._weight_int4pack_mm_for_cpu`) takes codes packed by
`_convert_weight_to_int4pack_for_cpu` and one (scale, zero) pair per group, and computes

    w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]      (g = k // group_size)

in float32 from bfloat16 scales and zeros, with bfloat16 activations and output and a float32
accumulator. Only its bfloat16 form is vectorized: float32 activations run a scalar loop, ~30x
slower (measured on a 2-core Xeon VM). A `QuantizedWeight`'s grid
(w = q * scale + min, see `tandem.formats.weight`) maps onto it as zero = min + 8 * scale; the codes
are kept as they are, the FP16 scales and zero points are rounded to bfloat16.

8-bit codes (GGUF Q8_0, the tied embedding / LM head of the default model) are split into two
4-bit halves, q = 16 * hi + lo, laid side by side along K: W' = [W_hi | W_lo] with the same
groups, so that x @ W^T = [x, x] @ W'^T. That reads 1 byte a weight plus scales, against 4 for
the float32 weight it replaces.

`int4_linear_ref` is the same maths in float64, for the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.formats.weight import QuantizedWeight

GROUP_SIZES = (32, 64, 128, 256)  # what the CPU kernel accepts


@dataclass
class CpuInt4Weight:
    """A linear weight [N, K] in the CPU INT4 kernel's layout (see the module docstring)."""

    packed: torch.Tensor  # uint8 [Np, Kw / 2]: the kernel's packing of the 4-bit codes
    scales_zeros: torch.Tensor  # bfloat16 [Kw / group_size, Np, 2]
    group_size: int
    in_features: int  # K, the input width
    out_features: int  # N; Np = N rounded up to the kernel's 16 rows (padding rows are zero)
    halves: int  # 1: 4-bit codes; 2: 8-bit codes as two 4-bit halves (Kw = 2 * Kp)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_zeros))


def can_pack(w: QuantizedWeight) -> bool:
    """Whether `pack_int4_cpu` takes this weight."""
    return w.bits in (4, 8) and w.group_size in GROUP_SIZES and w.device.type == "cpu"


def _scales_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """[N, G] float32 scales and zeros -> the kernel's bfloat16 [G, N, 2]."""
    return torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()


def pack_int4_cpu(w: QuantizedWeight) -> CpuInt4Weight:
    """`w` (4- or 8-bit codes, a group size of `GROUP_SIZES`) in the CPU kernel's layout."""
    if not can_pack(w):
        raise ValueError(
            f"the CPU INT4 kernel takes 4- or 8-bit CPU weights in groups of {GROUP_SIZES}, "
            f"got {w.bits} bits in groups of {w.group_size} on {w.device}"
        )
    n = w.out_features
    pad = -n % 16  # the kernel packs rows in blocks of 16
    q = torch.nn.functional.pad(w.codes(), (0, 0, 0, pad))  # int32 [Np, Kp]
    s = torch.nn.functional.pad(w.scales.float(), (0, 0, 0, pad))
    m = torch.nn.functional.pad(w.mins.float(), (0, 0, 0, pad))
    if w.bits == 4:
        codes, sz = q, _scales_zeros(s, m + 8 * s)
    else:
        # w = s * (16 hi + lo) + m = 16 s * (hi - 8) + (128 s + m)  +  s * (lo - 8) + 8 s
        codes = torch.cat([q >> 4, q & 0xF], dim=1)
        sz = torch.cat([_scales_zeros(16 * s, 128 * s + m), _scales_zeros(s, 8 * s)], dim=0)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
    return CpuInt4Weight(packed, sz, w.group_size, w.in_features, n, 1 if w.bits == 4 else 2)


def _padded_input(x: torch.Tensor, w: CpuInt4Weight) -> torch.Tensor:
    """x [T, K] -> [T, Kw] in bfloat16: zero-padded to whole groups, repeated for two halves."""
    kp = w.packed.shape[1] * 2 // w.halves
    x = x.to(torch.bfloat16)
    if kp != w.in_features:
        x = torch.nn.functional.pad(x, (0, kp - w.in_features))
    return x.repeat(1, 2) if w.halves == 2 else x


def int4_linear_cpu(
    x: torch.Tensor, w: CpuInt4Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] (float32) @ w^T (+ bias) -> [T, N] float32, through the CPU INT4 kernel."""
    xb = _padded_input(x.reshape(-1, x.shape[-1]), w)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w.packed, w.group_size, w.scales_zeros)
    if y.shape[1] != w.out_features:
        y = y[:, : w.out_features]
    y = y.to(x.dtype).view(*x.shape[:-1], w.out_features)
    return y if bias is None else y + bias


def dequantize_int4_cpu(w: CpuInt4Weight, codes: torch.Tensor) -> torch.Tensor:
    """The float64 weight [N, Kw] the kernel computes with, from its unpacked `codes` [N, Kw]."""
    sz = w.scales_zeros[:, : w.out_features].double()  # [G, N, 2]
    n, kw = codes.shape
    q = codes.double().view(n, -1, w.group_size) - 8
    return (q * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]).view(n, kw)


def int4_linear_ref(x: torch.Tensor, w: CpuInt4Weight, codes: torch.Tensor) -> torch.Tensor:
    """`int4_linear_cpu` in float64 (x rounded to bfloat16 as the kernel reads it; the output
    not rounded), from the weight's unpacked `codes` [N, Kw]."""
    xb = _padded_input(x, w).double()
    return xb @ dequantize_int4_cpu(w, codes).t()
