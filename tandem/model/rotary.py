"""Rotary position embedding tables (plain RoPE, `linear` and Llama 3.1 `llama3` scaling)."""

from __future__ import annotations

import math

import torch

from tandem.model.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32, with the checkpoint's rope scaling applied."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / float(rs["factor"])
    if kind == "llama3":
        factor = float(rs["factor"])
        low = float(rs.get("low_freq_factor", 1.0))
        high = float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs.get("original_max_position_embeddings", 8192))
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv
        # Long wavelengths are slowed down by `factor`, short ones kept, the middle interpolated.
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def cos_sin_table(cfg: ModelConfig, max_positions: int, device: torch.device | str) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half of the last dim, sin in the second."""
    inv = inv_frequencies(cfg)
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = pos[:, None] * inv[None, :]  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by per-token cos/sin [T, 1, D/2] (rotate-half convention, as transformers)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
