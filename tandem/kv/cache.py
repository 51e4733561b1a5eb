"""The KV pool tensor of one worker, laid out as in DESIGN §3."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Bumped whenever the pool layout changes; peers compare it at registration.
LAYOUT_VERSION = 1


@dataclass
class KVCache:
    """`data` is [layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim]."""

    data: torch.Tensor

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
        return cls(torch.zeros(shape, dtype=dtype, device=device))

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            num_layers
            * 2
            * block_size
            * kv_heads
            * head_dim
            * torch.empty((), dtype=dtype).element_size()
        )

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
