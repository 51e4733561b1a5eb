"""Second-order error compensation while quantizing (GPTQ, Frantar et al. 2022).

A linear layer's output error on calibration inputs X [T, K] is
||X W^T - X Q^T||^2 = tr((W - Q) H (W - Q)^T) with H = X^T X. GPTQ quantizes the columns of W one
at a time and, after each, spreads that column's rounding error over the columns not yet
quantized, in the direction that H says cancels it best (the row of the inverse Hessian's
Cholesky factor). Updates are applied lazily, one quantization group at a time.

Fitting the packed format (`tandem.formats.weight`) unchanged:
- groups are contiguous runs of `group_size` input columns, so a group's FP16 scale and zero
  point are computed when GPTQ reaches the group, from its columns as they are by then (already
  carrying the error of earlier groups);
- "act order" (the most activated columns first, as they are the most sensitive) is applied per
  group: groups are visited by decreasing total activation energy (sum of diag H over the
  group), and the columns inside a group by decreasing diag H. A group is never split, so its
  scale and zero point stay those of one contiguous run of columns;
- each (row, group)'s range is searched over clipping ratios, keeping the one with the smallest
  GPTQ loss on that group (the error it adds to the layer output);
- codes are chosen against the FP16-rounded scale and zero point, and `dequantize()` of the
  result is exactly the weight the error compensation assumed.

`gptq_quantize` runs this for every quantized layer of a model in forward order
(`tandem.quant.walk`), each group's Hessian taken from the inputs produced by the already
quantized layers before it. It can follow AWQ scaling (`awq_scale(clip=False)`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.formats.weight import LayerSpec, QuantizedWeight, fp16_grid, pack, quantize_rtn
from tandem.model.config import ModelConfig
from tandem.quant.walk import LayerGroup, walk_groups

CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(8))  # 1.0 down to 0.65


@dataclass
class GptqReport:
    """Per layer: output error on the calibration inputs as RTN would leave it and as GPTQ did,
    both relative to the layer's output energy (tr(W H W^T))."""

    errors: dict[str, tuple[float, float]] = field(default_factory=dict)


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch ops on one thread. GPTQ's column loop is thousands of ops on a few thousand
    elements; some (round, floor, broadcast multiply) enter an OpenMP parallel region whatever
    their size, and on a busy machine each region waits milliseconds for its second thread
    (measured: torch.round of 8 x 576 floats 12 ms on 2 threads, 2 us on one)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _grid(
    wg: torch.Tensor, bits: int, zero_point: bool, ratio: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP16 scale and zero point (the value of code 0) of groups wg [..., N, g], range shrunk by
    `ratio` ([...,  N] or a float): the arithmetic of `quantize_rtn`."""
    levels = (1 << bits) - 1
    if zero_point:
        lo, hi = wg.amin(-1) * ratio, wg.amax(-1) * ratio
        return fp16_grid((hi - lo) / levels, lo, bits)
    return fp16_grid(wg.abs().amax(-1) * ratio / (levels // 2), None, bits)


def _round(w: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, levels: int):
    """Codes and their dequantized values for w [..., N] on the grid (scale, mins) [..., N]."""
    q = torch.round((w - mins) / scale).clamp(0, levels)
    # Two separate float32 operations, as QuantizedWeight.dequantize computes them.
    deq = q * scale
    deq = deq + mins
    return q, deq


def _column_order(diag: torch.Tensor, group_size: int, act_order: bool) -> torch.Tensor:
    """The order in which GPTQ visits the columns: whole groups, see the module docstring."""
    k = diag.numel()
    starts = list(range(0, k, group_size))
    if not act_order:
        return torch.arange(k)
    energy = torch.stack([diag[a : a + group_size].sum() for a in starts])
    order = []
    for gi in torch.argsort(energy, descending=True, stable=True).tolist():
        a = starts[gi]
        inner = torch.argsort(diag[a : a + group_size], descending=True, stable=True)
        order.append(inner + a)
    return torch.cat(order)


def gptq_layer(
    w: torch.Tensor,  # [N, K] float
    h: torch.Tensor,  # [K, K] X^T X of the layer's calibration inputs
    spec: LayerSpec,
    damp: float = 0.01,
    act_order: bool = True,
    clip_ratios: tuple[float, ...] = CLIP_RATIOS,
    sub_block: int = 32,
) -> tuple[QuantizedWeight, float, float]:
    """GPTQ-quantize one weight; returns it and the relative output error (tr(E H E^T) /
    tr(W H W^T)) of plain RTN and of GPTQ on these inputs."""
    with _one_thread():
        return _gptq_layer(w, h, spec, damp, act_order, clip_ratios, sub_block)


def _gptq_layer(
    w: torch.Tensor,
    h: torch.Tensor,
    spec: LayerSpec,
    damp: float,
    act_order: bool,
    clip_ratios: tuple[float, ...],
    sub_block: int,
) -> tuple[QuantizedWeight, float, float]:
    n, k = w.shape
    g, bits, levels = spec.group_size, spec.bits, (1 << spec.bits) - 1
    w_in = w.double()
    h0 = h.double()
    h = h0.clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(damp * h.diagonal().mean())
    order = _column_order(h.diagonal(), g, act_order)
    hp = h[order][:, order]
    # Upper Cholesky factor of H^-1: row i holds how column i's error propagates to later ones.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hp)), upper=True)
    hinv = hinv.float()
    wp = w.float()[:, order].clone()
    wp[:, dead[order]] = 0.0
    dev = w.device
    codes = torch.zeros(n, k, dtype=torch.int32, device=dev)
    scales = torch.zeros(n, (k + g - 1) // g, dtype=torch.float16, device=dev)
    mins = torch.zeros_like(scales)
    r = len(clip_ratios)
    ratios = torch.tensor(clip_ratios, dtype=torch.float32, device=dev)[:, None]  # [R, 1]
    rows = torch.arange(n, device=dev)
    a = 0
    while a < k:
        gi = int(order[a]) // g  # the group these columns belong to
        b = a + min(g, k - gi * g)
        c = b - a
        # Every clipping ratio at once: grids [R, N], the group's columns [R, N, c].
        cur = wp[:, a:b].expand(r, n, c).clone()
        s16, m16 = _grid(cur, bits, spec.zero_point, ratios)
        s, m = s16.float(), m16.float()
        err = torch.empty_like(cur)
        qs = torch.empty_like(cur)
        hb = hinv[a:b, a:b]
        for s0 in range(0, c, sub_block):
            s1 = min(s0 + sub_block, c)
            for i in range(s0, s1):
                col = cur[:, :, i]
                q, deq = _round(col, s, m, levels)
                e = (col - deq) / hb[i, i]
                cur[:, :, i:s1] -= e[:, :, None] * hb[i, i:s1]
                err[:, :, i] = e
                qs[:, :, i] = q
            if s1 < c:
                cur[:, :, s1:] -= err[:, :, s0:s1] @ hb[s0:s1, s1:]
        best = err.pow(2).sum(-1).argmin(0)  # [N]: each row keeps its best clipping ratio
        cols = order[a:b]
        codes[:, cols] = qs[best, rows].to(torch.int32)
        scales[:, gi] = s16[best, rows]
        mins[:, gi] = m16[best, rows]
        if b < k:
            wp[:, b:] -= err[best, rows] @ hinv[a:b, b:]
        a = b
    kp = scales.shape[1] * g
    qw = QuantizedWeight(
        pack(F.pad(codes, (0, kp - k)), bits), scales, mins, bits, g, k, spec.zero_point
    )
    energy = _output_error(w_in, h0) or 1.0
    rtn = quantize_rtn(w_in.float(), bits, g, spec.zero_point).dequantize().double() - w_in
    got = qw.dequantize().double() - w_in
    return qw, _output_error(rtn, h0) / energy, _output_error(got, h0) / energy


def _output_error(e: torch.Tensor, h: torch.Tensor) -> float:
    """tr(E H E^T): the summed squared output error of a weight error E on inputs with Hessian H."""
    return float(((e @ h) * e).sum())


def gptq_quantize(
    weights: dict[str, torch.Tensor],
    cfg: ModelConfig,
    specs: dict[str, LayerSpec],
    calib: torch.Tensor,  # [S, L] token ids
    damp: float = 0.01,
    act_order: bool = True,
    clip_ratios: tuple[float, ...] = CLIP_RATIOS,
    log=None,
) -> tuple[dict[str, torch.Tensor | QuantizedWeight], GptqReport]:
    """`weights` with every layer `specs` marks as quantized GPTQ-quantized (the rest as given,
    float32), and the per-layer report."""
    w = {k: v.float().clone() for k, v in weights.items()}
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    report = GptqReport()

    def visit(group: LayerGroup, x: torch.Tensor) -> None:
        spec = specs[group.members[0]]
        if not spec.quantized:
            return None
        h = x.T @ x  # [K, K], shared by the group's members
        for m in group.members:
            qw, e_rtn, e_got = gptq_layer(w[m + ".weight"], h, spec, damp, act_order, clip_ratios)
            out[m + ".weight"] = qw
            w[m + ".weight"] = qw.dequantize()  # later groups see this layer quantized
            report.errors[m] = (e_rtn, e_got)
            if log is not None:
                log(f"  {m}: relative output error RTN {e_rtn:.3e} -> GPTQ {e_got:.3e}")
        return None

    walk_groups(w, cfg, calib, visit)
    for k, v in w.items():
        out.setdefault(k, v)
    return out, report
