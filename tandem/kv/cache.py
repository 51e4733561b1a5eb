"""The KV pool tensor of one worker, laid out as in DESIGN §3."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.formats.kv import is_quantized_kv, write_kv_block_scaled

# Bumped whenever the pool layout changes; peers compare it at registration.
# 2: FP8 / INT8 pools carry per-(block, kv head) float32 scales after the codes.
LAYOUT_VERSION = 2


@dataclass
class KVCache:
    """`data` is [layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim].

    For an FP8 / INT8 pool, `scales` is [layers, 2, num_blocks, kv_heads] float32: the value of
    a code is code * scale of its block and head (see `tandem.formats.kv`).
    """

    data: torch.Tensor
    scales: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        shape = (num_layers, 2, num_blocks, block_size, kv_heads, head_dim)
        scales = None
        if is_quantized_kv(dtype):
            scales = torch.zeros(
                (num_layers, 2, num_blocks, kv_heads), dtype=torch.float32, device=device
            )
        # Touch every page now (zero_ rather than a lazily mapped calloc): the pool's memory is
        # reserved at start-up, so usage does not creep up as new blocks are first written.
        return cls(torch.empty(shape, dtype=dtype, device=device).zero_(), scales)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        per = (
            num_layers
            * 2
            * block_size
            * kv_heads
            * head_dim
            * torch.empty((), dtype=dtype).element_size()
        )
        if is_quantized_kv(dtype):
            per += num_layers * 2 * kv_heads * 4  # the float32 scales
        return per

    @property
    def num_layers(self) -> int:
        return self.data.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    @property
    def block_size(self) -> int:
        return self.data.shape[3]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer i, each [num_blocks, block_size, kv_heads, head_dim]."""
        return self.data[i, 0], self.data[i, 1]

    def layer_scales(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scales, v_scales) of layer i, each [num_blocks, kv_heads]; (None, None) unquantized."""
        if self.scales is None:
            return None, None
        return self.scales[i, 0], self.scales[i, 1]

    def write_quantized(
        self,
        i: int,
        slot_mapping: torch.Tensor,  # [T]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,
        unique_blocks: bool = False,
    ) -> None:
        """Quantize new keys and values of layer i into their slots (FP8 / INT8 pools)."""
        if self.scales is None:
            raise ValueError("write_quantized on an unquantized KV pool")
        kc, vc = self.layer(i)
        ks, vs = self.layer_scales(i)
        write_kv_block_scaled(kc, ks, slot_mapping, k, unique_blocks)
        write_kv_block_scaled(vc, vs, slot_mapping, v, unique_blocks)
