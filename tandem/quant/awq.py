"""Activation-aware weight scaling (in the spirit of AWQ, Lin et al. 2023) before quantization.

For each group of linear layers that read the same input X (q/k/v, o, gate/up, down), search a
per-input-channel scale s = mean|X|^alpha (normalised), alpha on a grid in [0, 1], minimising the
layer output error ||X W^T - (X / s) Q(W * s)^T||^2 on calibration activations. The inverse
scale is folded into the operation that produces X, so the float model is unchanged:
- q/k/v and gate/up: the preceding RMSNorm weight is divided by s;
- o: the v_proj rows are divided by s (under grouped-query attention one scale per kv channel,
  shared by the query heads of the group);
- down: the up_proj rows are divided by s (the MLP input is silu(gate) * up).
Layers run one after another on the calibration batch, each fed the output of the previous
(scaled, still float) layer. Quantization itself happens afterwards (`quantize_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.model.config import ModelConfig
from tandem.model.rotary import apply_rotary, cos_sin_table
from tandem.quant.format import quantize_rtn
from tandem.quant.recipe import LayerSpec


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
    best = torch.full((n, kp // g), torch.inf)
    ratio = torch.ones(n, kp // g)
    for r in CLIP_RATIOS:
        clip = torch.full((n, kp // g), r)
        q = quantize_rtn(w, spec.bits, g, spec.zero_point, clip).dequantize()
        dw = wg - F.pad(q, (0, kp - k)).view(n, kp // g, g)
        err = torch.einsum("tgk,ngk->tng", xs, dw).pow(2).sum(0)  # [N, G]
        better = err < best
        best = torch.where(better, err, best)
        ratio = torch.where(better, r, ratio)
    return ratio


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


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
    s_count, length = calib.shape
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group = hq // hkv
    eps = cfg.rms_norm_eps
    cs = cos_sin_table(cfg, length, "cpu")
    cos = cs[:, None, : d // 2].repeat(s_count, 1, 1)  # [S*L, 1, D/2]
    sin = cs[:, None, d // 2 :].repeat(s_count, 1, 1)
    h = F.embedding(calib, w["model.embed_tokens.weight"]).reshape(s_count * length, -1)
    # The scale search uses a fixed subset of tokens (all of them for a small calibration set).
    gen = torch.Generator().manual_seed(0)
    n_tok = h.shape[0]
    pick = torch.randperm(n_tok, generator=gen)[: min(max_search_tokens, n_tok)]
    pick_clip = pick[:max_clip_tokens]

    def scale_group(
        name: str, x: torch.Tensor, members: list[str], tie=None
    ) -> torch.Tensor | None:
        spec = specs[members[0]]
        if not spec.quantized:
            return None
        ws = [w[m + ".weight"] for m in members]
        s, alpha, base, err = _search(x[pick], ws, spec, grid, tie)
        for m in members:
            w[m + ".weight"] = w[m + ".weight"] * s
            if clip:
                report.clips[m] = _clip_search((x / s)[pick_clip], w[m + ".weight"], spec)
        report.alphas[name] = alpha
        report.errors[name] = (base, err)
        if log is not None:
            log(f"  {name}: alpha {alpha:.2f}, output MSE {base:.3e} -> {err:.3e}")
        return s

    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        # -- attention: q/k/v read the input norm's output
        x = _rms_norm(h, w[p + "input_layernorm.weight"], eps)
        qkv = [p + f"self_attn.{n}_proj" for n in "qkv"]
        s = scale_group(p + "self_attn.qkv", x, qkv)
        if s is not None:
            w[p + "input_layernorm.weight"] = w[p + "input_layernorm.weight"] / s
            x = x / s
        q = x @ w[p + "self_attn.q_proj.weight"].T
        k = x @ w[p + "self_attn.k_proj.weight"].T
        v = x @ w[p + "self_attn.v_proj.weight"].T
        if cfg.attention_bias and p + "self_attn.q_proj.bias" in w:
            q = q + w[p + "self_attn.q_proj.bias"]
            k = k + w[p + "self_attn.k_proj.bias"]
            v = v + w[p + "self_attn.v_proj.bias"]
        q = apply_rotary(q.view(-1, hq, d), cos, sin)
        k = apply_rotary(k.view(-1, hkv, d), cos, sin)
        v = v.view(-1, hkv, d)

        def attend(q=q, k=k, v=v) -> torch.Tensor:
            qs = q.view(s_count, length, hq, d).transpose(1, 2)
            ks = k.view(s_count, length, hkv, d).transpose(1, 2)
            vs = v.view(s_count, length, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            return o.transpose(1, 2).reshape(s_count * length, hq * d)

        a = attend()
        # -- o_proj reads the attention output; its scale folds into v_proj's rows
        s = scale_group(p + "self_attn.o_proj", a, [p + "self_attn.o_proj"], tie=(hkv, group, d))
        if s is not None:
            s_kv = s.view(hkv, group, d)[:, 0, :].reshape(-1)
            w[p + "self_attn.v_proj.weight"] = w[p + "self_attn.v_proj.weight"] / s_kv[:, None]
            if p + "self_attn.v_proj.bias" in w:
                w[p + "self_attn.v_proj.bias"] = w[p + "self_attn.v_proj.bias"] / s_kv
            a = a / s
        h = h + a @ w[p + "self_attn.o_proj.weight"].T
        # -- MLP: gate/up read the post-attention norm's output
        x = _rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        s = scale_group(p + "mlp.gate_up", x, [p + "mlp.gate_proj", p + "mlp.up_proj"])
        if s is not None:
            w[p + "post_attention_layernorm.weight"] = w[p + "post_attention_layernorm.weight"] / s
            x = x / s
        act = F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
        # -- down_proj reads silu(gate) * up; its scale folds into up_proj's rows
        s = scale_group(p + "mlp.down_proj", act, [p + "mlp.down_proj"])
        if s is not None:
            w[p + "mlp.up_proj.weight"] = w[p + "mlp.up_proj.weight"] / s[:, None]
            act = act / s
        h = h + act @ w[p + "mlp.down_proj.weight"].T
    return w, report
