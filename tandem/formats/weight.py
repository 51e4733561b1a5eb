"""Per-group integer weights (W4A16 / W8A16): the packed format, round-to-nearest quantization.

A linear weight W [N, K] (out, in) is cut along K into groups of `group_size`. Each group has an
FP16 scale and an FP16 zero point, stored as the weight value at code 0 (the "min" of GGUF Q4_1):

    w[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G],   q in 0 .. 2**bits - 1

An integer zero point z is the same grid with mins = -z * scale; a symmetric group (zero_point
False) has mins = -2**(bits-1) * scale. The dequantization is computed in float32, which makes a
GGUF Q4_1 tensor loaded into this format bit-identical to `gguf.quants.dequantize`.

Packing, for the kernels in `tandem.kernels.w4a16`: K is padded up to a multiple of the group size
(padding codes are 0 and the padded input columns are never read), and the codes of one row are
packed 32 // bits to an int32 word, lowest bits first: code k of row n sits in word k // per at
bit offset bits * (k % per). Rows stay rows, so row permutations and concatenations (fused q/k/v)
act on `qweight`, `scales` and `mins` alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)


@dataclass
class QuantizedWeight:
    """One linear layer's packed integer weight; see the module docstring for the maths."""

    qweight: torch.Tensor  # int32 [N, Kp * bits // 32]
    scales: torch.Tensor  # float16 [N, Kp // group_size]
    mins: torch.Tensor  # float16 [N, Kp // group_size]: the zero point, as the value of code 0
    bits: int
    group_size: int
    in_features: int  # K; Kp = K rounded up to a multiple of group_size
    zero_point: bool = True  # False: symmetric groups (mins = -2**(bits-1) * scales)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the float weight this stands for, [N, K]."""
        return (self.out_features, self.in_features)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def padded_in_features(self) -> int:
        return self.qweight.shape[1] * (32 // self.bits)

    @property
    def nbytes(self) -> int:
        """Bytes held in memory (codes, scales and zero points)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins))

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        """Move to `device`. `dtype` (the activation dtype) is accepted and ignored: the codes,
        scales and zero points keep their storage types whatever the model computes in."""
        del dtype
        return QuantizedWeight(
            self.qweight.to(device),
            self.scales.to(device),
            self.mins.to(device),
            self.bits,
            self.group_size,
            self.in_features,
            self.zero_point,
        )

    def codes(self) -> torch.Tensor:
        """The unpacked integer codes, int32 [N, Kp]."""
        return unpack(self.qweight, self.bits)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K]: q * scale + min in float32, then cast to `dtype`."""
        n, kp = self.out_features, self.padded_in_features
        g = self.group_size
        q = self.codes().float().view(n, kp // g, g)
        # Two separate float32 operations, as gguf's numpy dequantizer does (no fused multiply-add).
        w = q * self.scales.float()[:, :, None]
        w = w + self.mins.float()[:, :, None]
        return w.view(n, kp)[:, : self.in_features].to(dtype)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes [N, Kp] (values 0 .. 2**bits - 1, Kp a multiple of 32 // bits) into int32."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    per = 32 // bits
    n, kp = q.shape
    if kp % per:
        raise ValueError(f"{kp} columns cannot be packed {per} to a word")
    q = q.to(torch.int64).view(n, kp // per, per)
    words = q[..., 0].clone()
    for j in range(1, per):
        words |= q[..., j] << (bits * j)  # [N, Kp/per], < 2**32
    words -= (words >= 2**31).to(torch.int64) << 32  # two's complement int32
    return words.to(torch.int32)


def unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack`: int32 words [N, W] -> codes int32 [N, W * 32 // bits]."""
    per = 32 // bits
    shifts = torch.arange(per, device=qweight.device, dtype=torch.int32) * bits
    # >> is arithmetic on int32, so the top code of a negative word carries sign bits: mask them.
    q = (qweight.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return q.reshape(qweight.shape[0], -1)


def _padded(k: int, group_size: int) -> int:
    return (k + group_size - 1) // group_size * group_size


def fp16_grid(
    scale: torch.Tensor, lo: torch.Tensor | None, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP16 scale and zero point (value of code 0) stored for float `scale` and, with a zero
    point, the group's low end `lo` (None: symmetric, code 0 at -2**(bits-1) scales). A zero
    scale (a constant group) becomes 1, and one that underflows FP16 the smallest normal."""
    levels = (1 << bits) - 1
    scale16 = torch.where(scale > 0, scale, 1.0).to(torch.float16)
    scale16 = torch.where(scale16 > 0, scale16, torch.finfo(torch.float16).tiny)
    if lo is not None:
        return scale16, lo.to(torch.float16)
    return scale16, (-(levels // 2 + 1) * scale16.float()).to(torch.float16)


def quantize_rtn(
    w: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    zero_point: bool = True,
    clip: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Round-to-nearest per-group quantization of a float weight [N, K].

    `clip` [N, Kp // group_size] (ratios in (0, 1]) shrinks each group's range before rounding:
    the extreme values saturate, the rest get a finer grid (AWQ's clipping search picks it).
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    kp = _padded(k, group_size)
    wf = w.float()
    levels = (1 << bits) - 1
    groups = wf.new_zeros(n, kp)
    groups[:, :k] = wf
    groups = groups.view(n, kp // group_size, group_size)
    # The last group may be partly padding: its range comes from its real columns only.
    real = torch.zeros(kp, dtype=torch.bool, device=w.device)
    real[:k] = True
    real = real.view(1, kp // group_size, group_size)
    if zero_point:
        lo = torch.where(real, groups, torch.inf).amin(-1)
        hi = torch.where(real, groups, -torch.inf).amax(-1)
        if clip is not None:
            lo, hi = lo * clip, hi * clip
        scale = (hi - lo) / levels
    else:
        amax = torch.where(real, groups.abs(), 0).amax(-1)
        if clip is not None:
            amax = amax * clip
        scale = amax / (levels // 2)
        lo = None
    # Codes are chosen against the FP16-rounded scale and zero point the kernels will use.
    scale16, mins16 = fp16_grid(scale, lo, bits)
    q = torch.round((groups - mins16.float()[..., None]) / scale16.float()[..., None])
    q = q.clamp(0, levels).to(torch.int32)
    q = torch.where(real, q, 0).view(n, kp)
    return QuantizedWeight(pack(q, bits), scale16, mins16, bits, group_size, k, zero_point)


def cat_rows(parts: list) -> torch.Tensor | QuantizedWeight:
    """Concatenate weights along the output dimension (fused q/k/v, gate/up).

    Float tensors are concatenated as they are; quantized ones must share bits and group size.
    A mix of float and quantized parts is an error: the quantize tool gives fused layers one spec.
    """
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if not all(isinstance(p, QuantizedWeight) for p in parts):
        raise ValueError("cannot fuse float and quantized weights into one layer")
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size, p.in_features) != (
            first.bits,
            first.group_size,
            first.in_features,
        ):
            raise ValueError(
                f"cannot fuse quantized weights of bits/group_size {p.bits}/{p.group_size} and "
                f"{first.bits}/{first.group_size}: fused layers need one spec"
            )
    return QuantizedWeight(
        torch.cat([p.qweight for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.mins for p in parts]),
        first.bits,
        first.group_size,
        first.in_features,
        all(p.zero_point for p in parts),
    )


def permute_rows(w: QuantizedWeight, index: torch.Tensor) -> QuantizedWeight:
    """The same weight with its output rows reordered (`index[i]` is the source of row i)."""
    return QuantizedWeight(
        w.qweight[index],
        w.scales[index],
        w.mins[index],
        w.bits,
        w.group_size,
        w.in_features,
        w.zero_point,
    )


@dataclass(frozen=True)
class LayerSpec:
    bits: int = 4  # 4 or 8: per-group integers; 16: left in floating point
    group_size: int = 128
    zero_point: bool = True  # asymmetric groups (scale + zero point); False: symmetric

    @property
    def quantized(self) -> bool:
        return self.bits != 16

    def precision_key(self) -> tuple[int, int, bool]:
        """Larger is more precise: more bits, then smaller groups, then a zero point."""
        return (self.bits, -self.group_size, self.zero_point)


def quantize_weights(
    weights: dict[str, Any],
    specs: dict[str, LayerSpec],
    clips: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """RTN-quantize the layers `specs` marks as quantized (with per-group clipping ratios where
    `clips` has them); other tensors pass through."""
    out = dict(weights)
    clips = clips or {}
    for name, spec in specs.items():
        key = name + ".weight"
        w = out.get(key)
        if spec.quantized and isinstance(w, torch.Tensor):
            c = clips.get(name)
            out[key] = quantize_rtn(
                w,
                spec.bits,
                spec.group_size,
                spec.zero_point,
                None if c is None else c.to(w.device),
            )
    return out


def dequantize_weights(weights: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every quantized weight replaced by its float value in `dtype`."""
    return {
        k: v.dequantize(dtype) if isinstance(v, QuantizedWeight) else v for k, v in weights.items()
    }
