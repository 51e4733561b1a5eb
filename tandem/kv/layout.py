"""The layout of a KV pool as two workers agree on it, and what identifies a host.

A worker's pool is `[layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim]`; two pools
exchange blocks only when every field but the block count agrees (`check_compatible`, checked
once at peer registration).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.config import host_group
from tandem.formats.kv import is_quantized_kv
from tandem.kv.cache import LAYOUT_VERSION, KVCache

if TYPE_CHECKING:
    from tandem.rpc import stages_pb2

DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    # Quantized pools: codes plus per-(block, kv head) float32 scales (tandem.formats.kv).
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.int8: "int8",
}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


class LayoutMismatch(ValueError):
    """Two pools cannot exchange blocks: their layouts differ."""


@dataclass(frozen=True)
class PoolLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str
    layout_version: int = LAYOUT_VERSION

    @property
    def quantized(self) -> bool:
        return is_quantized_kv(DTYPES[self.dtype])

    @property
    def scales_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.kv_heads)

    @classmethod
    def of(cls, kv: KVCache) -> PoolLayout:
        n_layers, _, n_blocks, bs, heads, dim = kv.data.shape
        return cls(n_layers, n_blocks, bs, heads, dim, DTYPE_NAMES[kv.data.dtype])

    @classmethod
    def from_proto(cls, m: stages_pb2.PoolLayout) -> PoolLayout:
        """The layout a peer sent at registration (its fields read off the message, so this
        module loads no protobuf; `tandem.rpc.convert.layout_to_proto` writes it)."""
        return cls(
            m.num_layers,
            m.num_blocks,
            m.block_size,
            m.kv_heads,
            m.head_dim,
            m.dtype,
            m.layout_version,
        )

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across layers, k and v, scales included."""
        return KVCache.bytes_per_block(
            self.num_layers, self.block_size, self.kv_heads, self.head_dim, DTYPES[self.dtype]
        )

    def check_compatible(self, other: PoolLayout) -> None:
        """Raise `LayoutMismatch` naming every field (but the block count) that differs."""
        diffs = [
            f"{name}: {getattr(self, name)} here vs {getattr(other, name)} at the peer"
            for name in (
                "num_layers",
                "block_size",
                "kv_heads",
                "head_dim",
                "dtype",
                "layout_version",
            )
            if getattr(self, name) != getattr(other, name)
        ]
        if diffs:
            raise LayoutMismatch("KV pool layouts differ (" + "; ".join(diffs) + ")")


def host_id() -> str:
    """Identity of this host (and boot): processes with the same id can share memory.

    Containers on one host each have their own hostname, yet two of them can share memory when
    they share an IPC namespace (compose.yaml: decode joins prefill's). TANDEM_HOST_ID names
    such a group in place of the hostname; the boot id still guards against other machines.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{host_group() or socket.gethostname()}/{boot}"


def numel(shape: tuple[int, ...]) -> int:
    """The number of elements of a tensor of this shape."""
    n = 1
    for s in shape:
        n *= s
    return n
