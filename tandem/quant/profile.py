"""Per-layer weight statistics and a suggested recipe (`tandem quantize MODEL --profile`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.formats.weight import LayerSpec, quantize_rtn
from tandem.model.layer_names import FUSED_GROUPS, linear_layer_names
from tandem.quant.recipe import Recipe

OUTLIER_SIGMAS = 6.0


@dataclass
class LayerStats:
    name: str
    shape: tuple[int, int]
    min: float
    max: float
    std: float
    kurtosis: float  # excess kurtosis (0 for a Gaussian); heavy tails quantize badly
    outlier_ratio: float  # fraction of weights beyond OUTLIER_SIGMAS standard deviations
    rtn_error: float  # relative Frobenius error of INT4 round-to-nearest at the probe group size


def layer_stats(name: str, w: torch.Tensor, group_size: int = 128) -> LayerStats:
    wf = w.float()
    mean = wf.mean()
    std = wf.std()
    z = (wf - mean) / std.clamp(min=1e-12)
    kurt = z.pow(4).mean().item() - 3.0
    outliers = (z.abs() > OUTLIER_SIGMAS).float().mean().item()
    q = quantize_rtn(wf, 4, group_size).dequantize()
    err = ((q - wf).norm() / wf.norm().clamp(min=1e-12)).item()
    return LayerStats(
        name,
        (w.shape[0], w.shape[1]),
        wf.min().item(),
        wf.max().item(),
        std.item(),
        kurt,
        outliers,
        err,
    )


def profile_weights(weights: dict, num_layers: int, group_size: int = 128) -> list[LayerStats]:
    """Statistics of every quantizable float layer (quantized ones are dequantized first)."""
    out = []
    for name in linear_layer_names(num_layers):
        w = weights[name + ".weight"]
        if not isinstance(w, torch.Tensor):
            w = w.dequantize()
        out.append(layer_stats(name, w, group_size))
    return out


def suggest_recipe(stats: list[LayerStats], group_size: int = 128, ratio: float = 1.5) -> Recipe:
    """INT4 by default; INT8 for a fused group whose RTN error or kurtosis stands out.

    A layer stands out when its INT4 error exceeds `ratio` times the median over layers of the
    same kind (q_proj with q_proj, ...), or its kurtosis exceeds 4x that median (and 10).
    """
    by_kind: dict[str, list[LayerStats]] = {}
    for s in stats:
        by_kind.setdefault(s.name.split(".", 3)[-1], []).append(s)

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    flagged: set[str] = set()
    for group in by_kind.values():
        err_med = median([s.rtn_error for s in group])
        kurt_med = median([s.kurtosis for s in group])
        for s in group:
            if s.rtn_error > ratio * err_med or s.kurtosis > max(10.0, 4 * kurt_med):
                flagged.add(s.name)
    overrides: list[tuple[str, LayerSpec]] = []
    eight = LayerSpec(bits=8, group_size=group_size, zero_point=True)
    for name in linear_layer_names(len({s.name.split(".")[2] for s in stats})):
        layer, part = name.split(".", 3)[:3], name.split(".", 3)[3]
        # The loader fuses q/k/v and gate/up: a flagged member lifts its whole group.
        members = next(m for m in FUSED_GROUPS.values() if part in m)
        if any(".".join(layer + [m]) in flagged for m in members):
            overrides.append((name, eight))
    return Recipe(LayerSpec(bits=4, group_size=group_size, zero_point=True), overrides)


def format_table(stats: list[LayerStats]) -> str:
    head = (
        f"{'layer':44s} {'shape':>12s} {'min':>9s} {'max':>9s} {'std':>8s} "
        f"{'kurt':>7s} {'>6sd':>8s} {'int4err':>8s}"
    )
    lines = [head, "-" * len(head)]
    for s in stats:
        shape = f"{s.shape[0]}x{s.shape[1]}"
        lines.append(
            f"{s.name:44s} {shape:>12s} {s.min:9.4f} {s.max:9.4f} {s.std:8.5f} "
            f"{s.kurtosis:7.2f} {s.outlier_ratio:8.2e} {s.rtn_error:8.4f}"
        )
    return "\n".join(lines)
