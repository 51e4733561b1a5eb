"""Moving KV blocks between workers: pool handles, the choice among them, and the gather copy.

A worker's pool is exported once as a handle; a peer opens it once and afterwards copies blocks
by id. Kinds: `cuda_ipc` (GPU pools, one host: tandem/kv/cuda_ipc.py), `shm` (CPU pools, one
host: named shared memory, below), `nixl` (between hosts: one NIXL READ per request,
tandem/kv/nixl_pool.py) and `inline` (block bytes streamed over gRPC, the portable fallback).
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

from tandem.kernels.kv_gather import gather_blocks
from tandem.kv.cache import LAYOUT_VERSION, KVCache
from tandem.quant.kv import is_quantized_kv

DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    # Quantized pools: codes plus per-(block, kv head) float32 scales (tandem.quant.kv).
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
    return f"{os.environ.get('TANDEM_HOST_ID') or socket.gethostname()}/{boot}"


TRANSPORTS = ("auto", "cuda_ipc", "shm", "nixl", "inline")


def accept_kinds(requested: str, device_type: str, nixl_usable: bool) -> list[str]:
    """The pool-handle kinds a decode worker asks for at registration, preferred first.

    `auto`: CUDA IPC (GPU pool) or shared memory when the prefill worker turns out to share this
    host, NIXL otherwise, and inline only when NIXL cannot be used here. Any other value asks
    for exactly that kind (registration fails, saying why, when the prefill cannot serve it).
    """
    if requested not in TRANSPORTS:
        raise ValueError(
            f"unknown KV transport {requested!r} (choose from {', '.join(TRANSPORTS)})"
        )
    if requested != "auto":
        return [requested]
    kinds = (["cuda_ipc"] if device_type == "cuda" else []) + ["shm"]
    return kinds + (["nixl"] if nixl_usable else []) + ["inline"]


def pick_kind(
    accept: list[str],
    *,
    same_host: bool,
    pool_device_type: str,
    has_shared_pool: bool,
    nixl_missing: Callable[[], str | None],
) -> tuple[str | None, list[str]]:
    """The first kind of `accept` a prefill worker can serve: (kind, []) or (None, reasons).

    `nixl_missing` says why NIXL cannot be used here (None: it can); it is only asked when NIXL
    is the best remaining choice, so a host that never needs NIXL never loads it.
    """
    reasons = []
    for kind in accept:
        if kind == "cuda_ipc":
            if not same_host:
                reasons.append("cuda_ipc: prefill and decode are on different hosts")
            elif pool_device_type != "cuda":
                reasons.append("cuda_ipc: the prefill KV pool is not on a GPU")
            else:
                return kind, []
        elif kind == "shm":
            if not same_host:
                reasons.append("shm: prefill and decode are on different hosts")
            elif not has_shared_pool:
                reasons.append("shm: the prefill KV pool is not in shared memory (it is on a GPU)")
            else:
                return kind, []
        elif kind == "nixl":
            missing = nixl_missing()
            if missing is not None:
                reasons.append(f"nixl: not usable on the prefill worker: {missing}")
            else:
                return kind, []
        elif kind == "inline":
            return kind, []
        else:
            reasons.append(f"{kind}: unknown transport")
    return None, reasons


_CREATED_HERE: set[str] = set()


class SharedPool:
    """A KV pool living in a named shared-memory segment (created by its owner, opened by peers)."""

    def __init__(self, shm: shared_memory.SharedMemory, layout: PoolLayout, owner: bool) -> None:
        self.shm = shm
        self.layout = layout
        self.owner = owner
        # The codes, then (quantized pools) the float32 scales, in one segment.
        data_bytes = (
            _numel(layout.shape) * torch.empty((), dtype=DTYPES[layout.dtype]).element_size()
        )
        raw = torch.frombuffer(shm.buf, dtype=torch.uint8, count=data_bytes)
        scales = None
        if layout.quantized:
            n = _numel(layout.scales_shape)
            scales = torch.frombuffer(
                shm.buf, dtype=torch.float32, count=n, offset=data_bytes
            ).view(layout.scales_shape)
        self.kv = KVCache(raw.view(DTYPES[layout.dtype]).view(layout.shape), scales)

    @property
    def name(self) -> str:
        return self.shm.name

    @classmethod
    def create(cls, layout: PoolLayout) -> SharedPool:
        nbytes = layout.block_bytes * layout.num_blocks
        shm = shared_memory.SharedMemory(
            name=f"tandem-kv-{uuid.uuid4().hex[:12]}", create=True, size=nbytes
        )
        _CREATED_HERE.add(shm.name)
        pool = cls(shm, layout, owner=True)
        pool.kv.data.view(torch.uint8).zero_()
        if pool.kv.scales is not None:
            pool.kv.scales.zero_()
        return pool

    @classmethod
    def open(cls, name: str, layout: PoolLayout) -> SharedPool:
        try:
            shm = shared_memory.SharedMemory(name=name)
        except FileNotFoundError as e:
            raise LayoutMismatch(
                f"shared-memory KV pool {name!r} does not exist on this host "
                "(is the peer on another machine? use the inline transport)"
            ) from e
        # The creator owns the segment's lifetime; stop this process's tracker from unlinking it.
        if name not in _CREATED_HERE:
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        if shm.size < layout.block_bytes * layout.num_blocks:
            raise LayoutMismatch(f"shared-memory KV pool {name!r} is smaller than its layout says")
        return cls(shm, layout, owner=False)

    def close(self) -> None:
        # Unlink first: the name goes away even while a tensor view keeps the mapping alive
        # (mappings, here and in peers, stay valid until they are closed).
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
        del self.kv
        try:
            self.shm.close()
        except BufferError:
            pass  # a tensor view is still alive; the OS reclaims the mapping at exit


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def block_runs(src: list[int], dst: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Copying block src[i] into dst[i] for every i, as runs: (src starts, dst starts, lengths),
    each run a stretch of blocks adjacent in both pools, ordered by source block."""
    s = np.asarray(src, dtype=np.int64)
    d = np.asarray(dst, dtype=np.int64)
    if s.size == 0:
        return s, d, s
    order = np.argsort(s, kind="stable")
    s, d = s[order], d[order]
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [s.size])))
    return s[starts], d[starts], lengths


def gather_copy(dst: KVCache, dst_blocks: list[int], src: KVCache, src_blocks: list[int]) -> None:
    """Copy blocks of every layer, k and v, from one pool to another (enqueued on the current
    stream on CUDA, without waiting for it).

    On a GPU this is one kernel launch for all layers and blocks (`tandem.kernels.kv_gather`),
    plus one for a quantized pool's scales. Elsewhere, blocks adjacent in both pools (a
    sequence's blocks usually are) go as one strided slice copy per run, straight from pool to
    pool; scattered blocks as one indexed gather into a temporary and one indexed scatter."""
    if len(dst_blocks) != len(src_blocks):
        raise ValueError(f"copying {len(src_blocks)} blocks into {len(dst_blocks)}")
    if (src.scales is None) != (dst.scales is None):
        raise LayoutMismatch("copying blocks between a quantized and an unquantized KV pool")
    pairs = [(src.data, dst.data)]
    if src.scales is not None and dst.scales is not None:
        pairs.append((src.scales, dst.scales))
    if dst.data.is_cuda and src.data.device == dst.data.device:
        # From pageable memory: the driver stages it at once, without waiting for the stream.
        ids = torch.from_numpy(np.array([src_blocks, dst_blocks], dtype=np.int32))
        ids = ids.to(dst.data.device, non_blocking=True)
        for a, b in pairs:
            gather_blocks(b, ids[1], a, ids[0])
        return
    if is_quantized_kv(dst.data.dtype):
        # Byte views: index_copy_ is not implemented for float8 on every device.
        pairs[0] = (src.data.view(torch.uint8), dst.data.view(torch.uint8))
    s0, d0, lengths = block_runs(src_blocks, dst_blocks)
    if len(lengths) <= max(4, len(src_blocks) // 8):
        for s, d, n in zip(s0.tolist(), d0.tolist(), lengths.tolist(), strict=True):
            for a, b in pairs:
                b[:, :, d : d + n].copy_(a[:, :, s : s + n], non_blocking=True)
        return
    si = torch.tensor(src_blocks, dtype=torch.long, device=src.data.device)
    di = torch.tensor(dst_blocks, dtype=torch.long, device=dst.data.device)
    for a, b in pairs:
        b.index_copy_(2, di, a.index_select(2, si).to(b.device, non_blocking=True))


def block_to_bytes(kv: KVCache, block: int) -> bytes:
    """One block of every layer as bytes ([layers, 2, block_size, kv_heads, head_dim]), followed
    for a quantized pool by its float32 scales ([layers, 2, kv_heads])."""
    out = kv.data[:, :, block].contiguous().view(torch.uint8).cpu().numpy().tobytes()
    if kv.scales is not None:
        out += kv.scales[:, :, block].contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return out


def bytes_to_block(kv: KVCache, block: int, data: bytes) -> None:
    """The inverse of `block_to_bytes`."""
    shape = kv.data[:, :, block].shape
    n = _numel(tuple(shape)) * kv.data.element_size()
    expected = n + (0 if kv.scales is None else _numel(tuple(kv.scales[:, :, block].shape)) * 4)
    if len(data) != expected:
        raise LayoutMismatch(f"a KV block of this pool has {expected} bytes, got {len(data)}")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    kv.data[:, :, block] = raw[:n].view(kv.data.dtype).view(shape).to(kv.data.device)
    if kv.scales is not None:
        s = raw[n:].view(torch.float32).view(kv.scales[:, :, block].shape)
        kv.scales[:, :, block] = s.to(kv.scales.device)
