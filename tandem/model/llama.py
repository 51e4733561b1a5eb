"""The Llama-family transformer (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Plain tensors in, tensors out. Activations are packed: T tokens of many sequences in one
[T, hidden] tensor; `AttentionMetadata` says which tokens belong to which sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.kernels.paged_attention import paged_attention_decode, paged_attention_varlen_ref
from tandem.kv.cache import KVCache
from tandem.model.config import ModelConfig
from tandem.model.rotary import apply_rotary, cos_sin_table


@dataclass
class AttentionMetadata:
    """Where each packed token's KV goes and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] long: flat cache slot of every token
    block_tables: torch.Tensor  # [B, max_blocks] long
    context_lens: torch.Tensor  # [B] long: tokens in cache after this step
    context_lens_list: list[int]
    query_start_loc: list[int]  # B + 1 offsets into the packed tokens
    decode_only: bool  # every sequence has exactly one query token


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) * D, H]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [H, Hq * D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with transformers' cast order (normalize in float32, cast, then scale)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    """Weights plus the forward pass; no KV allocation, no scheduling."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return weights[name].to(device=self.device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")
        if self.embed.shape != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"model.embed_tokens.weight has shape {tuple(self.embed.shape)}, "
                f"config says ({cfg.vocab_size}, {cfg.hidden_size})"
            )
        self.norm = w("model.norm.weight")
        if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed
        else:
            self.lm_head = w("lm_head.weight")
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            bias = None
            if cfg.attention_bias and p + "self_attn.q_proj.bias" in weights:
                bias = torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            self.layers.append(
                LayerWeights(
                    input_norm=w(p + "input_layernorm.weight"),
                    qkv=torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                    qkv_bias=bias,
                    o=w(p + "self_attn.o_proj.weight"),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                    down=w(p + "mlp.down_proj.weight"),
                )
            )
        self.max_positions = max_positions or cfg.max_position_embeddings
        self.cos_sin = cos_sin_table(cfg, self.max_positions, self.device)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run every layer over the packed tokens, writing their KV; returns final hidden [T, H]."""
        cfg = self.cfg
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        t = input_ids.shape[0]
        half = d // 2
        cs = self.cos_sin[positions]  # [T, D]
        cos = cs[:, None, :half].to(self.dtype)
        sin = cs[:, None, half:].to(self.dtype)
        h = F.embedding(input_ids, self.embed)
        for i, lw in enumerate(self.layers):
            x = rms_norm(h, lw.input_norm, cfg.rms_norm_eps)
            qkv = F.linear(x, lw.qkv, lw.qkv_bias)
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q = apply_rotary(q.view(t, hq, d), cos, sin)
            k = apply_rotary(k.view(t, hkv, d), cos, sin)
            v = v.view(t, hkv, d)
            k_cache, v_cache = kv.layer(i)
            k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
            v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
            if meta.decode_only:
                attn = paged_attention_decode(
                    q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale
                )
            else:
                attn = paged_attention_varlen_ref(
                    q,
                    k_cache,
                    v_cache,
                    meta.block_tables,
                    meta.query_start_loc,
                    meta.context_lens_list,
                    self.scale,
                )
            h = h + F.linear(attn.reshape(t, hq * d), lw.o)
            x = rms_norm(h, lw.post_norm, cfg.rms_norm_eps)
            gate, up = F.linear(x, lw.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, lw.down)
        return rms_norm(h, self.norm, cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, vocab] float32."""
        return F.linear(hidden, self.lm_head).float()
