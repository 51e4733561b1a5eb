"""Activation-aware weight scaling (in the spirit of AWQ, Lin et al. 2023) before quantization.

For each group of linear layers that read the same input X (q/k/v, o, gate/up, down), search a
per-input-channel scale s = mean|X|^alpha (normalised), alpha on a grid in [0, 1], minimising the
layer output error ||X W^T - (X / s) Q(W * s)^T||^2 on calibration activations. The inverse
scale is folded into the operation that produces X, so the float model is unchanged:
- q/k/v and gate/up: the preceding RMSNorm weight is divided by s;
- o: the v_proj rows are divided by s (under grouped-query attention one scale per kv channel,
  shared by the query heads of the group);
- down: the up_proj rows are divided by s (the MLP input is silu(gate) * up).
Layers run one after another on the calibration batch (`tandem.quant.walk`), each fed the output
of the previous (scaled, still float) layer. Quantization itself happens afterwards
(`quantize_weights`, or `tandem.quant.gptq` on the scaled weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.formats.weight import LayerSpec, quantize_rtn
from tandem.model.config import ModelConfig
from tandem.quant.walk import LayerGroup, walk_groups


@dataclass
class AwqReport:
    """The chosen alpha and output error (before -> after) of every scaled layer group, and the
    per-group clipping ratios chosen for each quantized layer (`quantize_weights(clips=...)`)."""

    alphas: dict[str, float] = field(default_factory=dict)
    errors: dict[str, tuple[float, float]] = field(default_factory=dict)
    clips: dict[str, torch.Tensor] = field(default_factory=dict)


CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(10))  # 1.0 down to 0.55


def _clip_search(x: torch.Tensor, w: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """Per-(row, group) range ratio minimising that group's contribution to the output error.

    A group's share of the output error is sum_t (x_t,g . (w_g - Q(w_g)))^2, independent of the
    other groups' rounding, so each (row, group) keeps its best ratio.
    """
    n, k = w.shape
    g = spec.group_size
    kp = (k + g - 1) // g * g
    xs = F.pad(x, (0, kp - k)).view(x.shape[0], kp // g, g)  # [T, G, g]
    wg = F.pad(w, (0, kp - k)).view(n, kp // g, g)
    best = torch.full((n, kp // g), torch.inf, device=w.device)
    ratio = torch.ones(n, kp // g, device=w.device)
    for r in CLIP_RATIOS:
        clip = torch.full((n, kp // g), r, device=w.device)
        q = quantize_rtn(w, spec.bits, g, spec.zero_point, clip).dequantize()
        dw = wg - F.pad(q, (0, kp - k)).view(n, kp // g, g)
        err = torch.einsum("tgk,ngk->tng", xs, dw).pow(2).sum(0)  # [N, G]
        better = err < best
        best = torch.where(better, err, best)
        ratio = torch.where(better, r, ratio)
    return ratio


def _fake_quant(w: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    return quantize_rtn(w, spec.bits, spec.group_size, spec.zero_point).dequantize()


def _search(
    x: torch.Tensor,  # [T, K] the group's input
    weights: list[torch.Tensor],  # each [N_i, K]
    spec: LayerSpec,
    grid: int,
    tie: tuple[int, int, int] | None = None,  # (kv_heads, group, head_dim): share over query heads
) -> tuple[torch.Tensor, float, float, float]:
    """(scale [K], alpha, error at alpha 0 i.e. plain RTN, best error)."""
    w = torch.cat(weights)
    y = x @ w.T
    stat = x.abs().mean(0)  # [K]
    if tie is not None:
        hkv, group, d = tie
        stat = stat.view(hkv, group, d).mean(1)  # [Hkv, D]
    stat = stat.clamp(min=1e-8)
    best = (torch.ones_like(x[0]), 0.0, float("inf"))
    base = float("nan")
    for i in range(grid + 1):
        alpha = i / grid
        s = stat.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        if tie is not None:
            s = s[:, None, :].expand(hkv, group, d).reshape(-1)
        err = (y - (x / s) @ _fake_quant(w * s, spec).T).pow(2).mean().item()
        if i == 0:
            base = err
        if err < best[2]:
            best = (s, alpha, err)
    return best[0], best[1], base, best[2]


def awq_scale(
    weights: dict[str, torch.Tensor],
    cfg: ModelConfig,
    specs: dict[str, LayerSpec],
    calib: torch.Tensor,  # [S, L] token ids
    grid: int = 20,
    max_search_tokens: int = 2048,
    log=None,
    clip: bool = True,
    max_clip_tokens: int = 512,
) -> tuple[dict[str, torch.Tensor], AwqReport]:
    """A float32 copy of `weights` with activation-aware scales folded in, and the search report.

    `clip`: also search per-group clipping ratios on the scaled weights (report.clips).
    """
    w = {k: v.float().clone() for k, v in weights.items()}
    report = AwqReport()
    # The scale search uses a fixed subset of tokens (all of them for a small calibration set).
    gen = torch.Generator().manual_seed(0)
    n_tok = calib.numel()
    pick = torch.randperm(n_tok, generator=gen)[: min(max_search_tokens, n_tok)]
    pick_clip = pick[:max_clip_tokens]

    def visit(group: LayerGroup, x: torch.Tensor) -> torch.Tensor | None:
        spec = specs[group.members[0]]
        if not spec.quantized:
            return None
        ws = [w[m + ".weight"] for m in group.members]
        s, alpha, base, err = _search(x[pick], ws, spec, grid, group.tie)
        for m in group.members:
            w[m + ".weight"] = w[m + ".weight"] * s
            if clip:
                report.clips[m] = _clip_search((x / s)[pick_clip], w[m + ".weight"], spec)
        report.alphas[group.name] = alpha
        report.errors[group.name] = (base, err)
        if log is not None:
            log(f"  {group.name}: alpha {alpha:.2f}, output MSE {base:.3e} -> {err:.3e}")
        return s

    walk_groups(w, cfg, calib, visit)
    return w, report
