"""The `cuda_ipc` KV transport: GPU pools of one host, mapped through CUDA IPC.

The prefill worker exports its pool tensors once (torch's storage sharing, i.e.
`cudaIpcGetMemHandle` of the allocation); a decode worker on the same host opens them once
(`cudaIpcOpenMemHandle`) and afterwards gathers blocks with `CudaIpcTransport.read_blocks`: one
indexed copy of the whole `[layers, 2, blocks, ...]` tensor, however many layers there are.

The handle is written as JSON (never pickled): it crosses a network boundary.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from tandem.kv.block_copy import DeviceCopy, copy_blocks
from tandem.kv.cache import KVCache
from tandem.kv.layout import DTYPE_NAMES, DTYPES, LayoutMismatch, PoolLayout
from tandem.kv.transports.base import MappedPeerPool, PeerLink, PeerRequest, TransportKind

FORMAT = 1


class CudaIpcUnavailable(LayoutMismatch):
    """The peer's GPU memory cannot be mapped here (another host, or its GPU is not visible)."""


def device_uuid(device: torch.device | int | None = None) -> str:
    """The UUID of a CUDA device ("" without CUDA): what identifies it across processes, whose
    device ordinals differ when CUDA_VISIBLE_DEVICES does."""
    if not torch.cuda.is_available():
        return ""
    idx = device.index if isinstance(device, torch.device) else device
    if idx is None:
        idx = torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(idx).uuid)


def _device_by_uuid(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise CudaIpcUnavailable(
        f"the prefill pool is on GPU {uuid}, which this process cannot see "
        f"({torch.cuda.device_count()} visible GPUs); use --kv-transport nixl or inline"
    )


def _export_tensor(t: torch.Tensor) -> dict:
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    (
        _cls,
        size,
        stride,
        tensor_offset,
        _storage_cls,
        dtype,
        _device,
        handle,
        storage_size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    return {
        "size": list(size),
        "stride": list(stride),
        "tensor_offset": tensor_offset,
        "dtype": DTYPE_NAMES[dtype],
        "handle": handle.hex(),
        "storage_size_bytes": storage_size_bytes,
        "storage_offset_bytes": storage_offset_bytes,
        "ref_counter_handle": ref_counter_handle.hex(),
        "ref_counter_offset": ref_counter_offset,
        "event_handle": event_handle.hex() if event_handle else "",
        "event_sync_required": bool(event_sync_required),
    }


def _open_tensor(d: dict, device: int) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(d["size"]),
        tuple(d["stride"]),
        d["tensor_offset"],
        torch.storage.TypedStorage,
        DTYPES[d["dtype"]],
        device,
        bytes.fromhex(d["handle"]),
        d["storage_size_bytes"],
        d["storage_offset_bytes"],
        False,
        bytes.fromhex(d["ref_counter_handle"]),
        d["ref_counter_offset"],
        bytes.fromhex(d["event_handle"]),  # torch wants bytes here, even when unused
        d["event_sync_required"],
    )


def export_pool(kv: KVCache) -> bytes:
    """The CUDA IPC handle of a GPU pool (its data and, quantized, its scales), as bytes."""
    if kv.data.device.type != "cuda":
        raise ValueError("only a KV pool on a GPU can be exported through CUDA IPC")
    out = {"format": FORMAT, "data": _export_tensor(kv.data)}
    if kv.scales is not None:
        out["scales"] = _export_tensor(kv.scales)
    return json.dumps(out).encode()


def check_peer_access(local: int, peer: int) -> None:
    """Blocks of a pool on GPU `peer` are copied by a kernel of GPU `local`: that needs peer
    access (NVLink or PCIe P2P). Without it the copy would be staged through host memory."""
    if local != peer and not torch.cuda.can_device_access_peer(local, peer):
        raise CudaIpcUnavailable(
            f"GPU {local} cannot access GPU {peer} peer-to-peer (no NVLink/PCIe P2P between "
            "them), so CUDA IPC cannot hand KV over directly; put prefill and decode on GPUs "
            "with peer access, or use --kv-transport nixl"
        )


def open_pool(
    handle: bytes, layout: PoolLayout, uuid: str, local_device: torch.device | None = None
) -> KVCache:
    """Map a peer's pool exported by `export_pool` (once per peer); `uuid` names its GPU and
    `local_device` is where this process's own pool lives (checked for peer access)."""
    if not torch.cuda.is_available():
        raise CudaIpcUnavailable("CUDA IPC needs CUDA in this process; use --kv-transport shm")
    try:
        d = json.loads(handle)
    except ValueError as e:
        raise CudaIpcUnavailable(f"malformed CUDA IPC pool handle: {e}") from e
    if d.get("format") != FORMAT:
        raise CudaIpcUnavailable(f"CUDA IPC handle format {d.get('format')!r}, expected {FORMAT}")
    device = _device_by_uuid(uuid)
    if local_device is not None and local_device.type == "cuda":
        local = (
            local_device.index if local_device.index is not None else torch.cuda.current_device()
        )
        check_peer_access(local, device)
    try:
        data = _open_tensor(d["data"], device)
        scales = _open_tensor(d["scales"], device) if "scales" in d else None
    except RuntimeError as e:
        raise CudaIpcUnavailable(f"cannot open the peer's CUDA IPC pool handle: {e}") from e
    if tuple(data.shape) != layout.shape or DTYPE_NAMES.get(data.dtype) != layout.dtype:
        raise LayoutMismatch(
            f"CUDA IPC pool is {tuple(data.shape)} {data.dtype}, its layout says "
            f"{layout.shape} {layout.dtype}"
        )
    return KVCache(data, scales)


class CudaIpcTransport:
    """CUDA IPC: the owner exports its GPU pool once; a reader on the same host maps it."""

    kind = TransportKind.CUDA_IPC

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv  # this worker's pool
        self.pool_device_type = kv.data.device.type

    def unavailable(self, peer: PeerRequest) -> str | None:
        if not peer.same_host:
            return "prefill and decode are on different hosts"
        if self.pool_device_type != "cuda":
            return "the prefill KV pool is not on a GPU"
        return None

    async def export(self, handle: Any, peer: PeerRequest) -> None:
        handle.cuda_ipc = export_pool(self.kv)
        handle.device_uuid = device_uuid(self.kv.data.device)

    def offer(self, request: Any) -> None:
        request.device_uuid = device_uuid(self.kv.data.device)

    async def open(self, link: PeerLink) -> MappedPeerPool:
        h = link.handle
        src = open_pool(h.cuda_ipc, link.layout, h.device_uuid, self.kv.data.device)
        return MappedPeerPool(self.kind, self.kv, src, functools.partial(self.read_blocks, src))

    def read_blocks(
        self, peer: KVCache, src_block_ids: list[int], dst_block_ids: list[int]
    ) -> DeviceCopy | None:
        """Enqueue the copy of blocks of the peer's mapped pool into this worker's pool (one
        kernel, no wait): the decode steps after it on the stream see the blocks, and the lease
        is released once the returned copy has passed (the peer then reuses its blocks)."""
        return copy_blocks(self.kv, dst_block_ids, peer, src_block_ids)

    def describe(self) -> dict[str, str]:
        return {
            "tandem.kv.transport": self.kind.value,
            "tandem.kv.device": device_uuid(self.kv.data.device),
        }

    def close(self) -> None:
        pass
