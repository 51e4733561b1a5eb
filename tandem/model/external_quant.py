"""Load AWQ, GPTQ and compressed-tensors checkpoints into Tandem's per-group integer format.

A Hugging Face directory whose config.json has a `quantization_config` is read here: each
quantized layer's codes, zero points and scales are repacked (never re-quantized) into a
`QuantizedWeight` (see `tandem.formats.weight`). All three formats store the same grid,

    w[n, k] = (q[n, k] - z[n, g]) * s[n, g],   g = the group of input channel k,

which is Tandem's `q * scale + min` with `min = -z * s` (exact for symmetric groups, where z is
2**(bits-1) and the product a power-of-two multiple; for asymmetric ones `min` is z * s rounded
to FP16, within half an FP16 unit of the stored grid). Formats, as their writers pack them:

- AWQ (`quant_method: awq`, `version: gemm`, AutoAWQ): `qweight` int32 [K, N/8] packs 8 output
  columns per word in the order 0, 2, 4, 6, 1, 3, 5, 7 (column `order[i]` at bits 4i);
  `qzeros` int32 [K/G, N/8] the same way; `scales` fp16 [K/G, N].
- GPTQ (`quant_method: gptq`, AutoGPTQ / GPTQModel): `qweight` int32 [K*bits/32, N] packs
  32/bits input rows per word, lowest bits first; `qzeros` int32 [groups, N*bits/32] packs
  output columns the same way, and in the original ("gptq", v1) checkpoint format holds z - 1
  (read back as (stored + 1) mod 2**bits, as AutoGPTQ does; "gptq_v2" holds z); `scales`
  fp16 [groups, N]; `g_idx` int32 [K]: the group of each input channel.
- compressed-tensors `pack-quantized`: `weight_packed` int32 [N, K*bits/32] packs input
  channels lowest bits first, each code stored as signed + 2**(bits-1); `weight_scale` [N,
  groups]; `weight_zero_point` (asymmetric only) int32 [N*bits/32, groups], packed along N the
  same way; `weight_g_idx` [K] with activation ordering.

Group sizes: Tandem's kernels read groups of 32, 64 or 128 channels. A larger group that is a
multiple of one of them (256, or -1: one group per output channel) is the same grid with its
scale and zero point repeated, and is loaded so; other sizes are refused.

Activation order (GPTQ `desc_act`, compressed-tensors `actorder: group`): `g_idx` assigns input
channels to groups in an arbitrary order, while Tandem's kernels need each group to be a run
of contiguous channels. The loader sorts the channels by group (a stable argsort of g_idx) and
stores the weight with its input columns in that order, W' = W[:, perm]; since
W x = W[:, perm] x[perm], the layer must then read its input permuted. That permutation is
returned beside the weight as `<layer>.input_perm` (int64 [K]). The alternative, one scale and
zero-point lookup per input channel inside the GEMV, would change every kernel and slow the
common case; re-quantizing into contiguous groups would change the weights. The model folds
down_proj's permutation into the rows of gate_proj and up_proj (silu(gate) * up is elementwise,
so permuting its producers' rows permutes it for free). The other layers' inputs are permuted by
the kernels that write them: decode attention stores its output in o_proj's order, and on one
row RMSNorm writes the GEMV's input form in qkv's and gate/up's order; several rows (prefill,
batched decode) are gathered (one index_select per layer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from tandem.formats.weight import SUPPORTED_GROUP_SIZES, QuantizedWeight, pack

# AutoAWQ GEMM packs output columns (c0..c7) into a word as c0 c2 c4 c6 c1 c3 c5 c7, lowest first.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
INPUT_PERM = "input_perm"  # suffix of the permutation tensor an act-order layer comes with


class UnsupportedQuantization(ValueError):
    """A checkpoint's quantization_config asks for something this loader does not implement."""


@dataclass
class IntGrid:
    """One layer's integer grid in a format-neutral form: w = (codes - zeros) * scales."""

    codes: torch.Tensor  # int32 [N, K], 0 .. 2**bits - 1
    zeros: torch.Tensor  # int32 [N, groups]
    scales: torch.Tensor  # float [N, groups]
    bits: int
    group_size: int  # channels per group; K for one group per output channel
    g_idx: torch.Tensor | None = None  # int [K]: group of each input channel (act-order)


def _refuse(path: str, field: str, value: Any, supported: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(
        f"{path}: quantization_config {field} = {value!r} is not supported; "
        f"Tandem loads {supported}"
    )


# ----------------------------------------------------------------------------- unpacking


def _unpack_cols(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, W] -> [R, W * 32/bits]: value j of word w is bits j*bits.. of it."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=words.device) * bits
    q = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return q.reshape(words.shape[0], -1)


def _unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [W, C] packed along rows -> [W * 32/bits, C]."""
    return _unpack_cols(words.t().contiguous(), bits).t()


def _awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM int32 [R, N/8] -> int32 [R, N] in column order."""
    raw = _unpack_cols(words, 4).view(words.shape[0], -1, 8)  # raw[..., i] = column order[i]
    inverse = [AWQ_ORDER.index(c) for c in range(8)]
    return raw[..., inverse].reshape(words.shape[0], -1)


# ----------------------------------------------------------------------------- repacking


def _tile(group_size: int, path: str, name: str) -> int:
    """The Tandem group size that tiles a stored group of `group_size` channels exactly."""
    if group_size in SUPPORTED_GROUP_SIZES:
        return group_size
    for t in sorted(SUPPORTED_GROUP_SIZES, reverse=True):
        if group_size % t == 0:
            return t
    raise UnsupportedQuantization(
        f"{path}: {name} = {group_size} is not supported; Tandem's kernels read groups of "
        f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))} channels (and multiples of them, or -1)"
    )


def to_quantized(
    grid: IntGrid, path: str, name: str
) -> tuple[QuantizedWeight, torch.Tensor | None]:
    """Repack `grid` as a QuantizedWeight (and the input permutation act-order needs, or None).

    See the module docstring for how groups are re-tiled and act-order is made contiguous.
    """
    n, k = grid.codes.shape
    g = grid.group_size
    codes, perm = grid.codes, None
    dev = codes.device
    if grid.g_idx is not None:
        g_idx = grid.g_idx.to(torch.int64)
        if g_idx.shape != (k,):
            raise ValueError(
                f"{path}: {name} g_idx has shape {tuple(g_idx.shape)}, expected ({k},)"
            )
        contiguous = torch.arange(k, device=dev) // g
        if not torch.equal(g_idx, contiguous):
            perm = torch.sort(g_idx, stable=True).indices
            if not torch.equal(g_idx[perm], contiguous):
                raise ValueError(
                    f"{path}: {name} g_idx does not give each group exactly {g} input channels "
                    "(the act-order layout GPTQ writes); it cannot be loaded as contiguous groups"
                )
            codes = codes[:, perm]
    t = _tile(g, path, f"{name} group_size") if g < k else max(SUPPORTED_GROUP_SIZES)
    kp = (k + t - 1) // t * t
    src = torch.arange(kp // t, device=dev) * t // g  # stored group of each Tandem group
    if src.max() >= grid.scales.shape[1] or grid.zeros.shape != grid.scales.shape:
        raise ValueError(
            f"{path}: {name} has scales {tuple(grid.scales.shape)} and zero points "
            f"{tuple(grid.zeros.shape)} for {k} input channels in groups of {g}"
        )
    scales32 = grid.scales.float()[:, src]
    scales = scales32.to(torch.float16)
    if not torch.equal(scales.float(), scales32):
        raise UnsupportedQuantization(
            f"{path}: {name} has scales that FP16 cannot hold exactly (Tandem's kernels read "
            "FP16 scales); convert the checkpoint's scales to float16"
        )
    zeros = grid.zeros[:, src]
    mins = (-zeros.float() * scales32).to(torch.float16)
    padded = torch.zeros(n, kp, dtype=torch.int32, device=dev)
    padded[:, :k] = codes
    symmetric = bool((zeros == 1 << (grid.bits - 1)).all())
    qw = QuantizedWeight(pack(padded, grid.bits), scales, mins, grid.bits, t, k, not symmetric)
    return qw, perm


# ----------------------------------------------------------------------------- formats


def _int(qc: dict, field: str, path: str, default: Any = None) -> int:
    v = qc.get(field, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise UnsupportedQuantization(f"{path}: quantization_config {field} = {v!r} is not an int")
    return v


def _group_size(qc: dict, path: str, *aliases: str) -> int:
    """The config's group size (-1: one group per output channel), checked against the kernels."""
    field = next((f for f in ("group_size", *aliases) if f in qc), "group_size")
    g = _int(qc, field, path)
    if g != -1:
        if g <= 0:
            raise _refuse(path, field, g, "a positive group size, or -1")
        _tile(g, path, f"quantization_config {field}")
    return g


def _awq_params(qc: dict, path: str) -> tuple[int, int]:
    bits = _int(qc, "bits" if "bits" in qc else "w_bit", path)
    if bits != 4:
        raise _refuse(path, "bits", bits, "AWQ checkpoints of 4 bits")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(path, "version", qc.get("version"), "AutoAWQ's GEMM packing (version gemm)")
    if qc.get("zero_point", True) is not True:
        raise _refuse(path, "zero_point", qc.get("zero_point"), "AWQ with zero points")
    return bits, _group_size(qc, path, "q_group_size")


def _awq(weights: dict, qc: dict, path: str) -> dict[str, IntGrid]:
    _, g = _awq_params(qc, path)
    out = {}
    for base in _bases(weights, ".qweight"):
        q = _awq_unpack(weights.pop(base + ".qweight")).t()  # [N, K]
        z = _awq_unpack(_need(weights, base + ".qzeros", path)).t()
        s = _need(weights, base + ".scales", path).t()
        out[base] = IntGrid(q.contiguous(), z.contiguous(), s, 4, g if g > 0 else q.shape[1])
    return out


def _gptq_params(qc: dict, path: str) -> tuple[int, int, str]:
    bits = _int(qc, "bits", path)
    if bits not in (4, 8):
        raise _refuse(path, "bits", bits, "GPTQ checkpoints of 4 or 8 bits")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(path, "checkpoint_format", fmt, "GPTQ checkpoint formats gptq and gptq_v2")
    if qc.get("is_marlin_format"):
        raise _refuse(path, "is_marlin_format", qc["is_marlin_format"], "GPTQ's own packing")
    return bits, _group_size(qc, path), fmt


def _gptq(weights: dict, qc: dict, path: str) -> dict[str, IntGrid]:
    bits, g, fmt = _gptq_params(qc, path)
    mask = (1 << bits) - 1
    out = {}
    for base in _bases(weights, ".qweight"):
        q = _unpack_rows(weights.pop(base + ".qweight"), bits).t().contiguous()  # [N, K]
        z = _unpack_cols(_need(weights, base + ".qzeros", path), bits)  # [groups, N]
        if fmt == "gptq":
            z = (z + 1) & mask
        s = _need(weights, base + ".scales", path)
        g_idx = weights.pop(base + ".g_idx", None)
        k = q.shape[1]
        if not qc.get("desc_act", False) and g_idx is not None:
            # Without act-order g_idx must be the contiguous layout; check rather than trust.
            contiguous = torch.arange(k, device=q.device) // (g if g > 0 else k)
            if not torch.equal(g_idx.to(torch.int64), contiguous):
                raise ValueError(f"{path}: {base}.g_idx is not contiguous but desc_act is false")
            g_idx = None
        z = z[:, : s.shape[1]]
        out[base] = IntGrid(q, z.t().contiguous(), s.t(), bits, g if g > 0 else k, g_idx)
    return out


def _ct_scheme(qc: dict, path: str) -> list[tuple[list[str], dict]]:
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise _refuse(path, "format", fmt, "compressed-tensors format pack-quantized")
    for field in ("sparsity_config", "kv_cache_scheme", "transform_config"):
        if qc.get(field):
            raise _refuse(path, field, qc[field], "weight-only integer quantization")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse(path, "config_groups", groups, "at least one quantization group")
    schemes = []
    for gname, grp in groups.items():
        where = f"config_groups.{gname}"
        for act in ("input_activations", "output_activations"):
            if grp.get(act):
                raise _refuse(path, f"{where}.{act}", grp[act], "weight-only quantization")
        if grp.get("format") not in (None, "pack-quantized"):
            raise _refuse(path, f"{where}.format", grp["format"], "pack-quantized")
        w = grp.get("weights") or {}
        checks = (
            ("num_bits", w.get("num_bits"), (4, 8), "4 or 8 bits"),
            ("type", w.get("type"), ("int",), "integer weights"),
            ("strategy", w.get("strategy"), ("group", "channel"), "group or channel strategy"),
            ("dynamic", w.get("dynamic", False), (False,), "static scales"),
            ("actorder", w.get("actorder"), (None, "group", "weight", "static"), "actorder"),
        )
        for field, value, ok, what in checks:
            if value not in ok:
                raise _refuse(path, f"{where}.weights.{field}", value, what)
        if w["strategy"] == "group":
            g = w.get("group_size")
            if isinstance(g, bool) or not isinstance(g, int) or g <= 0:
                raise _refuse(path, f"{where}.weights.group_size", g, "a positive group size")
            _tile(g, path, f"quantization_config {where}.weights.group_size")
        schemes.append((list(grp.get("targets") or []), w))
    return schemes


def _ct_matches(target: str, name: str) -> bool:
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _ct(weights: dict, qc: dict, path: str) -> dict[str, IntGrid]:
    schemes = _ct_scheme(qc, path)
    out = {}
    for base in _bases(weights, ".weight_packed"):
        w = next((w for targets, w in schemes if any(_ct_matches(t, base) for t in targets)), None)
        if w is None:
            raise ValueError(f"{path}: {base} is packed but no config group targets it")
        bits = int(w["num_bits"])
        packed = weights.pop(base + ".weight_packed")
        shape = weights.pop(base + ".weight_shape", None)
        n = packed.shape[0]
        k = int(shape[1]) if shape is not None else packed.shape[1] * 32 // bits
        q = _unpack_cols(packed, bits)[:, :k].contiguous()
        s = _need(weights, base + ".weight_scale", path)
        if s.dim() == 1:
            s = s[:, None]
        mid = 1 << (bits - 1)
        if w.get("symmetric", True):
            z = torch.full(s.shape, mid, dtype=torch.int32, device=q.device)
        else:
            zp = _need(weights, base + ".weight_zero_point", path)
            # Signed zero points stored + 2**(bits-1): the unsigned code of the zero point.
            z = _unpack_rows(zp, bits)[:n].contiguous()
        if w["strategy"] == "channel":
            g = k
        else:
            g = int(w["group_size"])
        g_idx = weights.pop(base + ".weight_g_idx", None)
        out[base] = IntGrid(q, z, s, bits, g, g_idx)
    return out


def _bases(weights: dict, suffix: str) -> list[str]:
    return sorted(k.removesuffix(suffix) for k in weights if k.endswith(suffix))


def _need(weights: dict, key: str, path: str) -> torch.Tensor:
    if key not in weights:
        raise ValueError(f"{path}: quantized checkpoint lacks tensor {key!r}")
    return weights.pop(key)


_FORMATS = {"awq": _awq, "gptq": _gptq, "compressed-tensors": _ct}
_CHECKS = {"awq": _awq_params, "gptq": _gptq_params, "compressed-tensors": _ct_scheme}


def check_quantization_config(qc: Any, path: str) -> None:
    """Refuse a `quantization_config` this loader cannot load, before any weight is read."""
    if not isinstance(qc, dict):
        raise _refuse(path, "", qc, "a quantization_config object")
    method = qc.get("quant_method")
    if method not in _CHECKS:
        raise _refuse(path, "quant_method", method, "awq, gptq and compressed-tensors")
    _CHECKS[method](qc, path)


def load_external(
    weights: dict[str, torch.Tensor], qc: dict[str, Any], path: str, dtype: torch.dtype
) -> dict[str, Any]:
    """The raw tensors of a checkpoint with `quantization_config` qc -> Tandem's weights: each
    quantized layer X as a QuantizedWeight at X.weight (plus X.input_perm with act-order),
    every other tensor cast to `dtype`."""
    check_quantization_config(qc, path)
    method = qc["quant_method"]
    rest = dict(weights)
    grids = _FORMATS[method](rest, qc, path)
    if not grids:
        raise ValueError(f"{path}: quantization_config says {method} but no layer is quantized")
    out: dict[str, Any] = {k: v.to(dtype) for k, v in rest.items()}
    for base, grid in grids.items():
        qw, perm = to_quantized(grid, path, base)
        out[base + ".weight"] = qw
        if perm is not None:
            out[f"{base}.{INPUT_PERM}"] = perm
    return out
