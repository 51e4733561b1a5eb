"""Rotary position embedding of q and k, and the write of k and v into a layer's paged KV cache
(one fused kernel on CUDA; FP8 / INT8 caches quantize on write)."""

from __future__ import annotations

import torch

from tandem.kernels.rotary import rope_cache_write, rope_cache_write_scaled
from tandem.layers.linear import Accumulated
from tandem.layers.step import Step
from tandem.model.rotary import apply_rotary


class RotaryKVWrite:
    """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D] rotated; k rotated and v written to layer
    `layer`'s KV cache at the step's slots."""

    def __init__(
        self, cos_sin: torch.Tensor, layer: int, heads: int, kv_heads: int, head_dim: int
    ) -> None:
        self.cos_sin = cos_sin  # [max_positions, D] float32, shared by every layer
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def takes_accumulator(self, step: Step) -> bool:
        """The fused kernel into an unquantized cache rounds and zeroes a GEMV's float32 row."""
        return step.kv.scales is None

    def _cos_sin(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] of the step's positions, in its dtype (built once a step)."""
        if step.rope is None:
            half = self.head_dim // 2
            cs = self.cos_sin.index_select(0, step.positions).to(step.dtype)  # [T, D]
            step.rope = cs[:, None, :half], cs[:, None, half:]
        return step.rope

    def __call__(self, qkv: torch.Tensor | Accumulated, step: Step) -> torch.Tensor:
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        kv, meta = step.kv, step.meta
        k_cache, v_cache = kv.layer(self.layer)
        k_scale, v_scale = kv.layer_scales(self.layer)
        acc_dtype = None
        if isinstance(qkv, Accumulated):
            qkv, acc_dtype = qkv
        if step.cuda and k_scale is None:
            return rope_cache_write(
                qkv, step.positions, self.cos_sin, meta.slot_mapping, k_cache, v_cache, hq, hkv,
                acc_dtype,
            )  # fmt: skip
        if step.cuda and meta.decode_only:  # FP8 / INT8 cache, one token per block: one launch
            return rope_cache_write_scaled(
                qkv, step.positions, self.cos_sin, meta.slot_mapping, k_cache, v_cache, k_scale,
                v_scale, hq, hkv,
            )  # fmt: skip
        t = qkv.shape[0]
        cos, sin = self._cos_sin(step)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q = apply_rotary(q.view(t, hq, d), cos, sin)
        k = apply_rotary(k.view(t, hkv, d), cos, sin)
        v = v.view(t, hkv, d)
        if k_scale is None:
            k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
            v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
        else:  # FP8 / INT8 cache: quantize on write, per-block scales
            kv.write_quantized(self.layer, meta.slot_mapping, k, v, meta.decode_only)
        return q
