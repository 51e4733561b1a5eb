"""Block-wise reconstruction: learned rounding and clipping per decoder layer (in the spirit of
AutoRound, Cheng et al. 2023, and OmniQuant's learnable weight clipping, Shao et al. 2023).

Round-to-nearest picks each code on its own. Here, for every decoder layer in forward order, the
layer's quantized weights are tuned together so that the whole layer's output matches the float
model's: per weight a rounding offset v in [-0.5, 0.5] added before rounding, and per (row, group)
factors on the group's max and min (its range, hence the FP16 scale and zero point):

    scale = (hi * a_hi - lo * a_lo) / 15,  zero = lo * a_lo   (both rounded to FP16)
    q     = clamp(round((w - zero) / scale + v), 0, 15),   w_hat = q * scale + zero

round() passes gradients straight through; v and the factors (a in [0.5, 1]) take signed-gradient
steps (lr decaying linearly to 0) on the mean squared error of the layer's output over minibatches
of calibration sequences. The result is an ordinary INT4 g128 `QuantizedWeight` (codes 0..15, an
FP16 scale and zero point per group); the kernels and checkpoints do not change.

What the layer is fed, and what it must reproduce: the layer's input is the output of the already
quantized earlier layers (what it will see when served); its target is the float layer's output on
the float model's hidden states. So each layer is also asked to undo, as far as its weights can, the
error the earlier layers left in its input, rather than to reproduce faithfully a hidden state that
is already off (AutoRound's default, which its authors found better than matching the float layer
on the quantized input). Errors therefore do not accumulate unchecked through the 30 layers.

The weights may come AWQ-scaled (`tandem.quant.awq.awq_scale(clip=False)`, the scales folded into
the preceding operations, the float model unchanged); v then starts at 0 and the factors at 1, i.e.
at AWQ's round-to-nearest. If the tuned weights do worse than that start on the whole calibration
set, the start is kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.formats.weight import LayerSpec, QuantizedWeight, fp16_grid, pack
from tandem.model.config import ModelConfig
from tandem.model.rotary import apply_rotary, cos_sin_table
from tandem.quant.walk import _rms_norm

CLIP_MIN = 0.5  # the range factors stay in [CLIP_MIN, 1]


@dataclass
class AutoRoundReport:
    """Per decoder layer: the mean squared error of its output on all calibration tokens, at the
    start (v = 0, factors 1) and after tuning (the kept one is the smaller)."""

    errors: dict[str, tuple[float, float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def check_options(iters: int, lr: float | None, batch: int) -> None:
    """Raise ValueError with an actionable message for unusable hyper-parameters."""
    if not isinstance(iters, int) or iters < 0:
        raise ValueError(f"autoround iterations must be an integer >= 0, got {iters!r}")
    if lr is not None and not lr > 0:
        raise ValueError(f"autoround lr must be > 0 (or unset for 1 / iterations), got {lr!r}")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"autoround batch must be at least 1 calibration sequence, got {batch!r}")


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (torch.round(x) - x).detach()


def _fp16_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (x.to(torch.float16).float() - x).detach()


class LearnedWeight:
    """One linear weight's rounding offsets and range factors, and its fake-quantized value."""

    def __init__(self, w: torch.Tensor, spec: LayerSpec):
        if spec.bits not in (4, 8):
            raise ValueError(f"autoround quantizes to 4 or 8 bits, got {spec.bits}")
        n, k = w.shape
        g = spec.group_size
        kp = (k + g - 1) // g * g
        self.spec, self.k, self.levels = spec, k, (1 << spec.bits) - 1
        self.groups = F.pad(w.float(), (0, kp - k)).view(n, kp // g, g)  # [N, G, g]
        # The last group may be partly padding: its range comes from its real columns only.
        real = torch.zeros(kp, dtype=torch.bool, device=w.device)
        real[:k] = True
        self.real = real.view(1, kp // g, g)
        if spec.zero_point:
            self.lo = torch.where(self.real, self.groups, torch.inf).amin(-1)  # [N, G]
            self.hi = torch.where(self.real, self.groups, -torch.inf).amax(-1)
        else:
            self.hi = torch.where(self.real, self.groups.abs(), 0).amax(-1)
            self.lo = None
        self.v = torch.zeros_like(self.groups, requires_grad=True)
        self.a_hi = torch.ones_like(self.hi, requires_grad=True)
        self.a_lo = torch.ones_like(self.hi, requires_grad=spec.zero_point)

    def params(self) -> list[torch.Tensor]:
        return [self.v, self.a_hi] + ([self.a_lo] if self.spec.zero_point else [])

    def _grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Float scale and zero point [N, G] of the current factors (not yet FP16)."""
        if self.lo is not None:
            lo, hi = self.lo * self.a_lo, self.hi * self.a_hi
            return (hi - lo) / self.levels, lo
        scale = self.hi * self.a_hi / (self.levels // 2)
        return scale, -(self.levels // 2 + 1) * scale

    def fake(self) -> torch.Tensor:
        """The dequantized weight [N, K] the packed result will hold; differentiable in the
        offsets and factors (straight-through rounding, FP16 rounding of scale and zero)."""
        scale, zero = self._grid()
        scale = _fp16_ste(scale.clamp(min=torch.finfo(torch.float16).tiny))[..., None]
        zero = _fp16_ste(zero)[..., None]
        q = _round_ste((self.groups - zero) / scale + self.v).clamp(0, self.levels)
        w = q * scale + zero
        return w.flatten(1)[:, : self.k]

    @torch.no_grad()
    def clamp_(self) -> None:
        self.v.clamp_(-0.5, 0.5)
        self.a_hi.clamp_(CLIP_MIN, 1.0)
        self.a_lo.clamp_(CLIP_MIN, 1.0)

    @torch.no_grad()
    def state(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params()]

    @torch.no_grad()
    def load(self, state: list[torch.Tensor]) -> None:
        for p, s in zip(self.params(), state, strict=True):
            p.copy_(s)

    @torch.no_grad()
    def packed(self) -> QuantizedWeight:
        """The current weight in the packed format: `dequantize()` equals `fake()` exactly."""
        scale, zero = self._grid()
        scale16, zero16 = fp16_grid(scale, zero if self.lo is not None else None, self.spec.bits)
        s, z = scale16.float()[..., None], zero16.float()[..., None]
        q = torch.round((self.groups - z) / s + self.v).clamp(0, self.levels).to(torch.int32)
        q = torch.where(self.real, q, 0).flatten(1)
        g = self.spec
        return QuantizedWeight(
            pack(q, g.bits), scale16, zero16, g.bits, g.group_size, self.k, g.zero_point
        )


def decoder_layer(
    w: dict[str, torch.Tensor],  # this layer's tensors, keys without the layer prefix
    cfg: ModelConfig,
    h: torch.Tensor,  # [S*L, H] hidden states of S sequences of L tokens
    cos: torch.Tensor,  # [S*L, 1, D/2]
    sin: torch.Tensor,
    seqs: int,
) -> torch.Tensor:
    """One Llama decoder layer on the calibration layout (causal within each sequence): the
    arithmetic of `tandem.quant.walk`, differentiable."""
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    n = h.shape[0] // seqs
    x = _rms_norm(h, w["input_layernorm.weight"], cfg.rms_norm_eps)
    q, k, v = (x @ w[f"self_attn.{c}_proj.weight"].T for c in "qkv")
    if cfg.attention_bias and "self_attn.q_proj.bias" in w:
        q = q + w["self_attn.q_proj.bias"]
        k = k + w["self_attn.k_proj.bias"]
        v = v + w["self_attn.v_proj.bias"]
    q = apply_rotary(q.view(-1, hq, d), cos, sin).view(seqs, n, hq, d).transpose(1, 2)
    k = apply_rotary(k.view(-1, hkv, d), cos, sin).view(seqs, n, hkv, d).transpose(1, 2)
    v = v.view(seqs, n, hkv, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    h = h + o.transpose(1, 2).reshape(seqs * n, hq * d) @ w["self_attn.o_proj.weight"].T
    x = _rms_norm(h, w["post_attention_layernorm.weight"], cfg.rms_norm_eps)
    act = F.silu(x @ w["mlp.gate_proj.weight"].T) * (x @ w["mlp.up_proj.weight"].T)
    return h + act @ w["mlp.down_proj.weight"].T


def tune_layer(
    layer_w: dict[str, torch.Tensor],  # keys without the layer prefix, float32
    specs: dict[str, LayerSpec],  # linear layer (no `.weight`, no prefix) -> spec, quantized only
    cfg: ModelConfig,
    h_in: torch.Tensor,  # [S*L, H] the quantized model's hidden states entering the layer
    target: torch.Tensor,  # [S*L, H] what the layer should output (the float model's)
    seqs: int,
    iters: int = 200,
    lr: float | None = None,
    batch: int = 4,
    seed: int = 0,
) -> tuple[dict[str, QuantizedWeight], float, float]:
    """Tune one decoder layer's quantized weights; returns them (keys with `.weight`), and the
    output MSE on all of `h_in` at the start and at the end (the returned weights')."""
    check_options(iters, lr, batch)
    n = h_in.shape[0] // seqs
    learned = {m: LearnedWeight(layer_w[m + ".weight"], s) for m, s in specs.items()}
    params = [p for lw in learned.values() for p in lw.params()]
    cs = cos_sin_table(cfg, n, h_in.device)
    d = cfg.head_dim

    def rope(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (cs[:, None, : d // 2].repeat(s, 1, 1), cs[:, None, d // 2 :].repeat(s, 1, 1))

    def loss_on(idx: torch.Tensor, cos, sin) -> torch.Tensor:
        w = dict(layer_w)
        for m, lw in learned.items():
            w[m + ".weight"] = lw.fake()
        rows = (idx[:, None] * n + torch.arange(n)).reshape(-1)
        out = decoder_layer(w, cfg, h_in[rows], cos, sin, len(idx))
        return (out - target[rows]).pow(2).mean()

    @torch.no_grad()
    def full_loss() -> float:
        total = 0.0
        for a in range(0, seqs, batch):
            idx = torch.arange(a, min(a + batch, seqs))
            cos, sin = rope(len(idx))
            total += float(loss_on(idx, cos, sin)) * len(idx)
        return total / seqs

    start_state = [lw.state() for lw in learned.values()]
    start = full_loss()
    b = min(batch, seqs)
    cos, sin = rope(b)
    step0 = lr if lr is not None else 1.0 / max(iters, 1)
    gen = torch.Generator().manual_seed(seed)
    for it in range(iters):
        idx = torch.randperm(seqs, generator=gen)[:b]
        loss = loss_on(idx, cos, sin)
        grads = torch.autograd.grad(loss, params)
        step = step0 * (1.0 - it / iters)  # linear decay to 0
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.sub_(step * g.sign())
        for lw in learned.values():
            lw.clamp_()
    end = full_loss() if iters else start
    if end > start:
        for lw, st in zip(learned.values(), start_state, strict=True):
            lw.load(st)
        end = start
    return {m + ".weight": lw.packed() for m, lw in learned.items()}, start, end


def autoround_quantize(
    weights: dict[str, torch.Tensor],
    cfg: ModelConfig,
    specs: dict[str, LayerSpec],
    calib: torch.Tensor,  # [S, L] token ids
    iters: int = 200,
    lr: float | None = None,
    batch: int = 4,
    log=None,
) -> tuple[dict[str, torch.Tensor | QuantizedWeight], AutoRoundReport]:
    """`weights` with every layer `specs` marks as quantized replaced by its tuned INT weight (the
    rest as given, float32), decoder layer by decoder layer; see the module docstring."""
    check_options(iters, lr, batch)
    w = {k: v.float() for k, v in weights.items()}
    out: dict[str, torch.Tensor | QuantizedWeight] = dict(w)
    report = AutoRoundReport()
    s, n = calib.shape
    dev = w["model.embed_tokens.weight"].device
    h_float = F.embedding(calib.to(dev), w["model.embed_tokens.weight"]).reshape(s * n, -1)
    h_quant = h_float
    cs = cos_sin_table(cfg, n, dev)
    d = cfg.head_dim
    cos, sin = cs[:, None, : d // 2].repeat(s, 1, 1), cs[:, None, d // 2 :].repeat(s, 1, 1)

    @torch.no_grad()
    def run(layer: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        # A few sequences at a time: the attention scores of all of them would not be small.
        step = 8
        parts = []
        for a in range(0, s, step):
            b = min(a + step, s)
            parts.append(
                decoder_layer(
                    layer, cfg, h[a * n : b * n], cos[a * n : b * n], sin[a * n : b * n], b - a
                )
            )
        return torch.cat(parts)

    for i in range(cfg.num_layers):
        t0 = time.monotonic()
        p = f"model.layers.{i}."
        layer = {k[len(p) :]: v for k, v in w.items() if k.startswith(p)}
        quant = {
            m[len(p) :]: spec
            for m, spec in specs.items()
            if m.startswith(p) and spec.quantized and m + ".weight" in w
        }
        target = run(layer, h_float)
        tuned, e0, e1 = tune_layer(layer, quant, cfg, h_quant, target, s, iters, lr, batch, i)
        for m, qw in tuned.items():
            out[p + m] = qw
            layer[m] = qw.dequantize()
        h_quant = run(layer, h_quant)
        h_float = target
        report.errors[p.rstrip(".")] = (e0, e1)
        report.seconds[p.rstrip(".")] = round(time.monotonic() - t0, 1)
        if log is not None:
            log(f"  layer {i}: output MSE {e0:.4e} -> {e1:.4e} ({time.monotonic() - t0:.1f}s)")
    return out, report
