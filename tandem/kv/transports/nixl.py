"""The `nixl` KV transport, between hosts: one NIXL READ per request, straight into the pool.

Each worker process has one NIXL agent (UCX backend) with its KV pool registered once (DRAM on a
CPU host, VRAM on a GPU host). At peer registration the agents' metadata travel over the gRPC
`Prefill.Register`; afterwards the decode worker reads any set of prefill blocks into its own
blocks with a single NIXL READ (UCX picks RDMA, shared memory or TCP) and waits for it with a
timeout. NIXL is an optional dependency (`pip install 'tandem[nixl]'`).

In a pool `[layers, 2, num_blocks, block_size, kv_heads, head_dim]` a block of one (layer, k|v)
row is `block_size * kv_heads * head_dim` contiguous elements, and blocks b and b + 1 of a row are
adjacent. A READ is described per request as one descriptor per (row, run): a run is a stretch of
blocks adjacent in both pools (the pairs are sorted by peer block first, so the order of the
block lists does not matter), copied in one piece; a quantized pool adds the same runs of its
float32 scales. Per-block descriptors would cost UCX one operation per block and row (16 KiB in
bench/transfer.py's model), which on one host is 2-3x slower than reading the same bytes in
long runs (bench/nixl_read.py, bench/results/nixl_read_cpu.json).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from tandem.kv.block_copy import block_runs
from tandem.kv.cache import KVCache
from tandem.kv.layout import DTYPES, PoolLayout
from tandem.kv.transports.base import (
    PeerLink,
    PeerRequest,
    TransferError,
    TransportKind,
    handle_kind,
)

log = logging.getLogger("tandem.kv.nixl")

# The wheels install their Python API under these names (CUDA 13, CUDA 12, then the meta package).
_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")
_lock = threading.Lock()
_module: ModuleType | None = None
_missing: str | None = None


class NixlUnavailable(RuntimeError):
    """The NIXL Python package is not installed (or does not load)."""


class NixlTransferError(TransferError):
    """A NIXL READ failed, timed out, or the peer is gone."""


def _plugin_dir(name: str) -> Path | None:
    """Where the wheel `name` keeps its backend plugins (the UCX one among them).

    The wheels put the plugins beside the libnixl their bindings load
    (`site-packages/.<name>.mesonpy.libs/plugins`); found from the package's location without
    importing it, since NIXL reads NIXL_PLUGIN_DIR when it loads.
    """
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return None
    site = Path(spec.origin).resolve().parent.parent
    for d in (site / f".{name}.mesonpy.libs" / "plugins", site / f"{name}.libs" / "nixl"):
        if (d / "libplugin_UCX.so").exists():
            return d
    return None


def load_nixl() -> ModuleType:
    """The NIXL module, with NIXL_PLUGIN_DIR pointing into the installed package.

    Raises `NixlUnavailable` (with the reason) when it is not installed.
    """
    global _module, _missing
    with _lock:
        if _module is not None:
            return _module
        if _missing is not None:
            raise NixlUnavailable(_missing)
        errors = []
        for name in _MODULES:
            try:
                if importlib.util.find_spec(name) is None:
                    continue
            except (ImportError, ValueError):
                continue
            plugins = _plugin_dir(name)
            if plugins is not None:
                # The plugins must be the ones built with the libnixl this wheel loads: a
                # NIXL_PLUGIN_DIR left over from another NIXL install would not fit it.
                if os.environ.get("NIXL_PLUGIN_DIR") not in (None, str(plugins)):
                    log.info("NIXL_PLUGIN_DIR set to the installed %s plugins at %s", name, plugins)
                os.environ["NIXL_PLUGIN_DIR"] = str(plugins)
            try:
                mod = importlib.import_module(name)
                mod.nixl_agent  # noqa: B018 - the API we use
            except Exception as e:  # noqa: BLE001 - a broken install is reported, not raised
                errors.append(f"{name}: {type(e).__name__}: {e}")
                continue
            _module = mod
            return mod
        _missing = "NIXL is not installed (pip install 'tandem[nixl]')" + (
            f"; {'; '.join(errors)}" if errors else ""
        )
        raise NixlUnavailable(_missing)


def nixl_installed() -> bool:
    """Whether a NIXL package is installed (without loading it)."""
    for name in _MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def nixl_missing_reason() -> str | None:
    """None when NIXL can be used here, else why not."""
    try:
        load_nixl()
    except NixlUnavailable as e:
        return str(e)
    return None


@dataclass(frozen=True)
class NixlPoolInfo:
    """What a peer needs to READ from a pool: the owner's agent and where the pool lives."""

    agent_metadata: bytes
    mem_type: str  # DRAM | VRAM
    device_id: int
    data_addr: int
    scales_addr: int = 0


def _run_descs(
    addr: int,
    row_stride: int,
    rows: int,
    starts: np.ndarray,
    lengths: np.ndarray,
    unit: int,
    device_id: int,
) -> np.ndarray:
    """Descriptors (address, length, device) of the runs `starts`/`lengths` (in units of
    `unit` bytes) in each of `rows` rows `row_stride` bytes apart, row by row."""
    r = np.arange(rows, dtype=np.uint64)[:, None] * np.uint64(row_stride)
    out = np.empty((rows * starts.size, 3), dtype=np.uint64)
    out[:, 0] = (np.uint64(addr) + r + starts.astype(np.uint64)[None, :] * np.uint64(unit)).ravel()
    out[:, 1] = np.broadcast_to(
        lengths.astype(np.uint64) * np.uint64(unit), (rows, starts.size)
    ).ravel()
    out[:, 2] = device_id
    return out


def _elt(layout: PoolLayout) -> int:
    return torch.empty((), dtype=DTYPES[layout.dtype]).element_size()


def read_descs(
    layout: PoolLayout,
    data_addr: int,
    scales_addr: int,
    device_id: int,
    starts: np.ndarray,
    lengths: np.ndarray,
) -> np.ndarray:
    """One side's descriptors of a READ: runs of blocks in every (layer, k|v) row of a pool,
    then (quantized) the same runs of its scales. Both sides list them in the same order."""
    rows = layout.num_layers * 2
    block = layout.block_size * layout.kv_heads * layout.head_dim * _elt(layout)
    parts = [
        _run_descs(data_addr, layout.num_blocks * block, rows, starts, lengths, block, device_id)
    ]
    if layout.quantized:
        scale = layout.kv_heads * 4
        parts.append(
            _run_descs(
                scales_addr, layout.num_blocks * scale, rows, starts, lengths, scale, device_id
            )
        )
    return np.concatenate(parts)


class NixlEndpoint:
    """This process's NIXL agent, with its KV pool registered once."""

    def __init__(self, name: str, kv: KVCache) -> None:
        nixl = load_nixl()
        conf = nixl.nixl_agent_config(
            backends=["UCX"],
            # Registration (event loop) and transfers (worker threads) may overlap.
            sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.name = name
        self.agent = nixl.nixl_agent(name, conf)
        if "UCX" not in self.agent.backends:
            raise NixlUnavailable(
                f"the NIXL UCX backend did not load (plugins: {self.agent.get_plugin_list()}; "
                f"NIXL_PLUGIN_DIR={os.environ.get('NIXL_PLUGIN_DIR')})"
            )
        self.kv = kv
        self.layout = PoolLayout.of(kv)
        data = kv.data
        if not data.is_contiguous() or (kv.scales is not None and not kv.scales.is_contiguous()):
            raise ValueError("a KV pool registered with NIXL must be contiguous")
        self.mem_type = "DRAM" if data.device.type == "cpu" else "VRAM"
        self.device_id = max(data.get_device(), 0)
        tensors = [data] + ([kv.scales] if kv.scales is not None else [])
        self._registered = self.agent.register_memory(tensors)
        self.info = NixlPoolInfo(
            agent_metadata=self.agent.get_agent_metadata(),
            mem_type=self.mem_type,
            device_id=self.device_id,
            data_addr=data.data_ptr(),
            scales_addr=kv.scales.data_ptr() if kv.scales is not None else 0,
        )
        self.peers: dict[str, str] = {}  # peer id -> NIXL agent name

    def add_peer(self, peer_id: str, metadata: bytes) -> str:
        """Load a peer agent's metadata (a peer that re-registers replaces its old entry)."""
        old = self.peers.pop(peer_id, None)
        if old is not None:
            self._forget(old)
        name = self.agent.add_remote_agent(metadata)
        if isinstance(name, bytes):
            name = name.decode()
        self.peers[peer_id] = name
        return name

    def _forget(self, agent_name: str) -> None:
        try:
            self.agent.remove_remote_agent(agent_name)
        except Exception as e:  # noqa: BLE001 - the peer is gone either way
            log.debug("removing NIXL agent %s: %s", agent_name, e)

    def open_peer(self, peer_id: str, info: NixlPoolInfo, layout: PoolLayout) -> NixlPeerPool:
        """A peer's pool opened for READs into this endpoint's pool."""
        self.layout.check_compatible(layout)
        name = self.add_peer(peer_id, info.agent_metadata)
        return NixlPeerPool(self, peer_id, name, layout, info)

    def close(self) -> None:
        for name in list(self.peers.values()):
            self._forget(name)
        self.peers.clear()
        try:
            self.agent.deregister_memory(self._registered)
        except Exception as e:  # noqa: BLE001 - process exit frees it anyway
            log.debug("NIXL endpoint close: %s", e)


class NixlRead:
    """One posted READ: `wait` for it, `cancel` it (False while NIXL cannot yet)."""

    def __init__(self, endpoint: NixlEndpoint, handle, peer: str, nbytes: int) -> None:
        self.endpoint = endpoint
        self.handle = handle
        self.peer = peer
        self.nbytes = nbytes
        self.released = False

    def wait(self, timeout_s: float) -> None:
        """Block until the READ is done; raises `NixlTransferError` on failure or timeout."""
        agent = self.endpoint.agent
        deadline = time.monotonic() + timeout_s
        pause = 0.00005
        while True:
            try:
                state = agent.check_xfer_state(self.handle)
            except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
                raise NixlTransferError(f"NIXL READ from {self.peer} failed: {e}") from e
            if state == "DONE":
                self.cancel()
                return
            if state == "ERR":
                raise NixlTransferError(f"NIXL READ from {self.peer} failed")
            if time.monotonic() > deadline:
                raise NixlTransferError(
                    f"NIXL READ of {self.nbytes} bytes from {self.peer} timed out after "
                    f"{timeout_s:.1f} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.002)

    def cancel(self) -> bool:
        """Release the request (NIXL cancels it if still active). False: still in flight, the
        destination blocks must not be reused yet."""
        if self.released:
            return True
        try:
            self.endpoint.agent.release_xfer_handle(self.handle)
        except Exception as e:  # noqa: BLE001
            log.debug("NIXL READ from %s not released yet: %s", self.peer, e)
            return False
        self.released = True
        return True

    def settle(self, timeout_s: float) -> bool:
        """After a failure: wait until the request is released, so its blocks can be reused."""
        deadline = time.monotonic() + timeout_s
        while not self.cancel():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True


class NixlPeerPool:
    """A peer's KV pool; `read` copies blocks of it into ours with one READ. As a `PeerPool`,
    it reads into blocks the engine reserved, off the engine thread."""

    kind = TransportKind.NIXL
    reads_into_reserved_blocks = True
    timeout_s = 10.0  # how long `read_blocks` waits for a READ

    def __init__(
        self,
        endpoint: NixlEndpoint,
        peer_id: str,
        agent_name: str,
        layout: PoolLayout,
        info: NixlPoolInfo,
    ) -> None:
        self.endpoint = endpoint
        self.peer_id = peer_id
        self.agent_name = agent_name
        self.layout = layout
        self.info = info

    def start_read(self, src_blocks: list[int], dst_blocks: list[int]) -> NixlRead:
        """Post one READ of `src_blocks` (peer) into `dst_blocks` (ours), every layer, k and v:
        one descriptor per (layer, k|v) and run of blocks adjacent in both pools."""
        if len(src_blocks) != len(dst_blocks):
            raise ValueError(f"reading {len(src_blocks)} blocks into {len(dst_blocks)}")
        for b in src_blocks:
            if not 0 <= b < self.layout.num_blocks:
                raise ValueError(
                    f"block {b} is outside the peer pool ({self.layout.num_blocks} blocks)"
                )
        ep = self.endpoint
        for b in dst_blocks:
            if not 0 <= b < ep.layout.num_blocks:
                raise ValueError(f"block {b} is outside this pool ({ep.layout.num_blocks} blocks)")
        agent = ep.agent
        src_starts, dst_starts, lengths = block_runs(src_blocks, dst_blocks)
        log.debug(
            "NIXL READ of %d blocks from %s in %d runs", len(src_blocks), self.peer_id, lengths.size
        )
        info, mine = self.info, ep.info
        remote = read_descs(
            self.layout, info.data_addr, info.scales_addr, info.device_id, src_starts, lengths
        )
        local = read_descs(
            ep.layout, mine.data_addr, mine.scales_addr, mine.device_id, dst_starts, lengths
        )
        try:
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local, ep.mem_type),
                agent.get_xfer_descs(remote, info.mem_type),
                self.agent_name,
            )
        except Exception as e:  # noqa: BLE001
            raise NixlTransferError(f"NIXL READ from {self.peer_id} failed: {e}") from e
        read = NixlRead(ep, handle, self.peer_id, len(src_blocks) * self.layout.block_bytes)
        try:
            state = agent.transfer(handle)
        except Exception as e:  # noqa: BLE001
            read.cancel()
            raise NixlTransferError(f"NIXL READ from {self.peer_id} failed: {e}") from e
        if state == "ERR":
            read.cancel()
            raise NixlTransferError(f"NIXL READ from {self.peer_id} failed to start")
        return read

    def read(self, src_blocks: list[int], dst_blocks: list[int], timeout_s: float) -> None:
        """`start_read` and wait for it. On failure the exception's `blocks_safe` says whether
        NIXL released the request (the destination blocks may be reused) within `timeout_s`."""
        if not src_blocks and not dst_blocks:
            return  # every block was already here (prefix cache)
        r = self.start_read(src_blocks, dst_blocks)
        try:
            r.wait(timeout_s)
        except NixlTransferError as e:
            e.blocks_safe = r.settle(timeout_s)  # type: ignore[attr-defined]
            raise

    async def fetch(self, kv_ref: Any) -> _NixlSource:
        return _NixlSource(self)

    def close(self) -> None:
        name = self.endpoint.peers.pop(self.peer_id, None)
        if name is not None:
            self.endpoint._forget(name)


@dataclass
class _NixlSource:
    """One request's blocks at a NIXL peer: `read_blocks` posts the READ and waits for it."""

    pool: NixlPeerPool
    blocks_moved: int = 0
    pending: None = None  # the read is done when read_blocks returns

    def read_blocks(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        self.pool.read(src_block_ids, dst_block_ids, self.pool.timeout_s)
        self.blocks_moved += len(dst_block_ids)


class NixlTransport:
    """NIXL: each side's agent (created on first use) has its pool registered; the two agents
    learn each other's metadata at registration, and the reader READs blocks by address."""

    kind = TransportKind.NIXL

    def __init__(
        self,
        kv: KVCache,
        name: str,
        timeout_s: float = 10.0,
        missing: Callable[[], str | None] = nixl_missing_reason,
    ) -> None:
        self.kv = kv  # this worker's pool
        self.name = name  # this worker's NIXL agent name
        self.timeout_s = timeout_s
        self.missing = missing
        self.endpoint: NixlEndpoint | None = None
        self._lock = asyncio.Lock()

    async def _endpoint(self) -> NixlEndpoint:
        """This worker's NIXL agent with its pool registered (created once, on first use)."""
        async with self._lock:
            if self.endpoint is None:
                self.endpoint = await asyncio.to_thread(NixlEndpoint, self.name, self.kv)
                log.info(
                    "NIXL agent %s registered the KV pool (%s)", self.name, self.endpoint.mem_type
                )
            return self.endpoint

    # ---- the pool's owner ------------------------------------------------------------------
    def unavailable(self, peer: PeerRequest) -> str | None:
        # Asked only when NIXL is the best remaining choice: a host that never needs it never
        # loads it.
        missing = self.missing()
        return None if missing is None else f"not usable on the prefill worker: {missing}"

    async def export(self, handle: Any, peer: PeerRequest) -> None:
        """This worker's pool as a NIXL peer sees it, with the reader's agent metadata loaded
        so the two agents know each other."""
        ep = await self._endpoint()
        if peer.nixl_agent_metadata:
            await asyncio.to_thread(ep.add_peer, peer.peer_id, peer.nixl_agent_metadata)
        info = ep.info
        handle.nixl.agent_metadata = info.agent_metadata
        handle.nixl.mem_type = info.mem_type
        handle.nixl.device_id = info.device_id
        handle.nixl.data_addr = info.data_addr
        handle.nixl.scales_addr = info.scales_addr

    # ---- the reader ------------------------------------------------------------------------
    def offer(self, request: Any) -> None:
        if self.endpoint is not None:
            request.nixl_agent_metadata = self.endpoint.info.agent_metadata

    async def open(self, link: PeerLink) -> NixlPeerPool:
        if not link.request.nixl_agent_metadata:
            # Our agent exists from now on: register again so that the owner's agent loads its
            # metadata too (the two agents know each other, whichever side connects).
            await self._endpoint()
            h = await link.register_again()
            if handle_kind(h) is not self.kind:
                raise RuntimeError(
                    f"prefill {link.address} changed transport to {handle_kind(h).value!r}"
                )
            link.handle = h
        h = link.handle
        info = NixlPoolInfo(
            agent_metadata=h.nixl.agent_metadata,
            mem_type=h.nixl.mem_type,
            device_id=h.nixl.device_id,
            data_addr=h.nixl.data_addr,
            scales_addr=h.nixl.scales_addr,
        )
        assert self.endpoint is not None
        pool = await asyncio.to_thread(self.endpoint.open_peer, h.pool_id, info, link.layout)
        pool.timeout_s = self.timeout_s
        return pool

    def describe(self) -> dict[str, str]:
        return {"tandem.kv.transport": self.kind.value, "tandem.kv.nixl_agent": self.name}

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
