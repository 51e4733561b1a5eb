"""A float forward pass over calibration tokens, one linear-layer group at a time: what the
calibration methods (AWQ scaling, GPTQ) are built on.

The decoder layers run one after another on the whole calibration batch. Before each group of
linear layers that read one input (q/k/v, o, gate/up, down) the pass calls `visit(group, x)`
with that input; the callback may rewrite the group's weights in the dict (scaled, or replaced by
their quantized values), and the pass then computes the group's output with the rewritten
weights, so every later group sees the effect of every earlier choice (GPTQ's sequential
quantization, AWQ's scales on scaled inputs).

The callback may return a per-input-channel scale s [K]: the members' weights were multiplied by
s, and the pass folds 1/s into the operation producing the input, so the float model is
unchanged (q/k/v, gate/up: the preceding RMSNorm weight; o: the v_proj rows, one scale per kv
channel under grouped-query attention; down: the up_proj rows, as the MLP input is
silu(gate) * up).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.model.config import ModelConfig
from tandem.model.rotary import apply_rotary, cos_sin_table


@dataclass(frozen=True)
class LayerGroup:
    """Linear layers reading one input, e.g. `model.layers.3.self_attn.qkv`."""

    name: str
    members: tuple[str, ...]  # layer names, without `.weight`
    # o_proj under grouped-query attention: (kv_heads, query heads per kv head, head_dim), so a
    # scale can be shared over the query heads of a group (it folds into v_proj's rows).
    tie: tuple[int, int, int] | None = None


Visit = Callable[[LayerGroup, torch.Tensor], torch.Tensor | None]


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class _Stream:
    """Hidden states [S*L, H] of the calibration batch through one set of weights."""

    def __init__(self, w: dict[str, torch.Tensor], cfg: ModelConfig, calib: torch.Tensor):
        self.w, self.cfg = w, cfg
        self.s, self.length = calib.shape
        d = cfg.head_dim
        dev = w["model.embed_tokens.weight"].device
        calib = calib.to(dev)
        cs = cos_sin_table(cfg, self.length, dev)
        self.cos = cs[:, None, : d // 2].repeat(self.s, 1, 1)  # [S*L, 1, D/2]
        self.sin = cs[:, None, d // 2 :].repeat(self.s, 1, 1)
        self.h = F.embedding(calib, w["model.embed_tokens.weight"].float())
        self.h = self.h.reshape(self.s * self.length, -1)

    def attn_input(self, p: str) -> torch.Tensor:
        return _rms_norm(self.h, self.w[p + "input_layernorm.weight"], self.cfg.rms_norm_eps)

    def attention(self, p: str, x: torch.Tensor) -> torch.Tensor:
        """The o_proj input [S*L, Hq*D] (causal attention within each calibration sequence)."""
        cfg, w = self.cfg, self.w
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, k, v = (x @ w[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        if cfg.attention_bias and p + "self_attn.q_proj.bias" in w:
            q = q + w[p + "self_attn.q_proj.bias"]
            k = k + w[p + "self_attn.k_proj.bias"]
            v = v + w[p + "self_attn.v_proj.bias"]
        q = apply_rotary(q.view(-1, hq, d), self.cos, self.sin)
        k = apply_rotary(k.view(-1, hkv, d), self.cos, self.sin)
        s, n = self.s, self.length
        qs = q.view(s, n, hq, d).transpose(1, 2)
        ks = k.view(s, n, hkv, d).transpose(1, 2)
        vs = v.view(s, n, hkv, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).reshape(s * n, hq * d)

    def add_o(self, p: str, a: torch.Tensor) -> None:
        self.h = self.h + a @ self.w[p + "self_attn.o_proj.weight"].T

    def mlp_input(self, p: str) -> torch.Tensor:
        return _rms_norm(
            self.h, self.w[p + "post_attention_layernorm.weight"], self.cfg.rms_norm_eps
        )

    def gate_up(self, p: str, x: torch.Tensor) -> torch.Tensor:
        """The down_proj input, silu(gate) * up."""
        w = self.w
        return F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)

    def add_down(self, p: str, act: torch.Tensor) -> None:
        self.h = self.h + act @ self.w[p + "mlp.down_proj.weight"].T


def layer_groups(cfg: ModelConfig, i: int) -> list[LayerGroup]:
    """The four groups of decoder layer i, in the order the forward pass reaches them."""
    p = f"model.layers.{i}."
    tie = (cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
    return [
        LayerGroup(p + "self_attn.qkv", tuple(p + f"self_attn.{n}_proj" for n in "qkv")),
        LayerGroup(p + "self_attn.o_proj", (p + "self_attn.o_proj",), tie),
        LayerGroup(p + "mlp.gate_up", (p + "mlp.gate_proj", p + "mlp.up_proj")),
        LayerGroup(p + "mlp.down_proj", (p + "mlp.down_proj",)),
    ]


def walk_groups(
    w: dict[str, torch.Tensor],
    cfg: ModelConfig,
    calib: torch.Tensor,  # [S, L] token ids
    visit: Visit,
) -> None:
    """Run the calibration batch through the model, calling `visit(group, x)` before each
    linear-layer group; see the module docstring. `w` holds float32 tensors, updated in place."""
    run = _Stream(w, cfg, calib)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv, o, gate_up, down = layer_groups(cfg, i)
        # -- attention: q/k/v read the input norm's output
        x = run.attn_input(p)
        s = visit(qkv, x)
        if s is not None:
            w[p + "input_layernorm.weight"] = w[p + "input_layernorm.weight"] / s
            x = x / s
        a = run.attention(p, x)
        # -- o_proj reads the attention output; its scale folds into v_proj's rows
        s = visit(o, a)
        if s is not None:
            hkv, group, d = o.tie
            s_kv = s.view(hkv, group, d)[:, 0, :].reshape(-1)
            w[p + "self_attn.v_proj.weight"] = w[p + "self_attn.v_proj.weight"] / s_kv[:, None]
            if p + "self_attn.v_proj.bias" in w:
                w[p + "self_attn.v_proj.bias"] = w[p + "self_attn.v_proj.bias"] / s_kv
            a = a / s
        run.add_o(p, a)
        # -- MLP: gate/up read the post-attention norm's output
        x = run.mlp_input(p)
        s = visit(gate_up, x)
        if s is not None:
            w[p + "post_attention_layernorm.weight"] = w[p + "post_attention_layernorm.weight"] / s
            x = x / s
        act = run.gate_up(p, x)
        # -- down_proj reads silu(gate) * up; its scale folds into up_proj's rows
        s = visit(down, act)
        if s is not None:
            w[p + "mlp.up_proj.weight"] = w[p + "mlp.up_proj.weight"] / s[:, None]
            act = act / s
        run.add_down(p, act)
