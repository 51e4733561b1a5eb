"""Random Llama-family weights under HF names, built directly on a device (benchmarks, GPU tests):
no checkpoint, no transformers model, nothing downloaded."""

from __future__ import annotations

import torch

from tandem.model.config import ModelConfig


def random_llama_weights(
    cfg: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    std: float = 0.02,
    embed_std: float | None = None,
    norm_std: float = 0.0,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Normal(0, std) linear weights, Normal(0, embed_std or std) embedding and LM head, and
    norm weights 1 + Normal(0, norm_std) (all ones when 0)."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, i_ = cfg.hidden_size, cfg.intermediate_size
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def r(*shape, s=std):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype) * s

    def norm():
        return torch.ones(h, device=device, dtype=dtype) + (r(h, s=norm_std) if norm_std else 0)

    e = std if embed_std is None else embed_std
    w = {"model.embed_tokens.weight": r(cfg.vocab_size, h, s=e), "model.norm.weight": norm()}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = r(cfg.vocab_size, h, s=e)
    for li in range(cfg.num_layers):
        p = f"model.layers.{li}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = r(qd, h)
        w[p + "self_attn.k_proj.weight"] = r(kvd, h)
        w[p + "self_attn.v_proj.weight"] = r(kvd, h)
        w[p + "self_attn.o_proj.weight"] = r(h, qd)
        w[p + "mlp.gate_proj.weight"] = r(i_, h)
        w[p + "mlp.up_proj.weight"] = r(i_, h)
        w[p + "mlp.down_proj.weight"] = r(h, i_)
    return w
