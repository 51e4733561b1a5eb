"""The host-memory tier of the prefix cache: cached blocks the KV pool evicts are copied here
instead of dropped, and copied back into fresh pool blocks when a prompt's prefix finds them.

Invariants:
- A slot holds the KV of one block hash (the prefix-cache name the pool used), complete and
  never written again while it holds that hash; `lookup` finds it by the hash.
- Eviction is LRU per account (the pool's accounts: one without tenants, one per tenant with
  quotas). A tenant holds at most its quota of slots: the same fraction of the tier as of the
  pool (each tier has its own quota; a host slot never counts against the pool's). Storing
  for a tenant at its quota drops its own least recent slot; storing into a full tier drops the
  least recent slot of the tenant furthest over its quota. A slot locked for a restore in
  progress is never dropped.
- Inclusive: a restored block stays here too, so evicting it again from the pool costs no copy.

Copies on CUDA: the host link is crossed on a copy stream of the tier's own, the pool's blocks
are touched on the compute stream, and events order the two; Python never waits. An offload
gathers the evicted blocks on the compute stream (after the step in flight, before the next
step overwrites them) and copies them to the host on the copy stream while the next step runs.
A restore copies the slots into a device staging buffer on the copy stream while the step in
flight runs, and the compute stream, waiting for that copy's event, scatters them into the
sequence's blocks before its next step. Slots are written and read only on the copy stream, so
a later offload into a slot runs after an earlier restore read it. The host memory is pinned
(asynchronous DMA), exactly the size asked for. On CPU the copies are plain and synchronous.

Nothing here outlives the process: a restarted worker starts with an empty tier.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections import OrderedDict, deque

import torch

from tandem.host_copy import device_tensor
from tandem.kv.block_pool import BlockPool
from tandem.kv.cache import KVCache


class HostTier:
    """`num_slots` block-sized slots of host memory behind `pool` (whose KV is `kv`)."""

    def __init__(
        self, kv: KVCache, pool: BlockPool, num_slots: int, quotas: list[int | None] | None = None
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.kv = kv
        self.pool = pool
        self.num_slots = num_slots
        device = kv.data.device
        cuda = device.type == "cuda"
        # [slots, layers, 2, block_size, kv_heads, head_dim]: one slot is contiguous, so runs of
        # adjacent slots move in one copy.
        shape = (num_slots, *kv.data.shape[:2], *kv.data.shape[3:])
        self.data = _host_buffer(shape, kv.data.dtype, pin=cuda)
        self.scales = None
        if kv.scales is not None:  # [slots, layers, 2, kv_heads]
            sshape = (num_slots, *kv.scales.shape[:2], kv.scales.shape[3])
            self.scales = _host_buffer(sshape, kv.scales.dtype, pin=cuda)
        self.block_bytes = self.data[0].numel() * self.data.element_size()
        if self.scales is not None:
            self.block_bytes += self.scales[0].numel() * self.scales.element_size()
        self.stream = torch.cuda.Stream(device) if cuda else None
        nt = len(pool.tenants)
        self.quota: list[int | None] = list(quotas) if quotas is not None else [None] * nt
        if len(self.quota) != nt:
            raise ValueError(f"{len(self.quota)} host-tier quotas for {nt} pool accounts")
        self._free: deque[int] = deque(range(num_slots))
        self._slot_of: dict[bytes, int] = {}
        self._lru: list[OrderedDict[bytes, int]] = [OrderedDict() for _ in range(nt)]
        self._account_of: dict[bytes, int] = {}
        self._locked: dict[int, int] = {}  # slot -> restores in progress reading it
        # Counters (plain ints and floats: read from another thread for metrics).
        self.blocks_to_host = 0
        self.blocks_to_device = 0
        self.dropped = 0  # slots given up for newer blocks
        self.copy_bytes = 0  # bytes of finished copies whose time is known
        self.copy_seconds = 0.0
        self._timings: deque[tuple[torch.cuda.Event, torch.cuda.Event, int]] = deque()
        pool.spill = self.offload

    @classmethod
    def sized(
        cls, kv: KVCache, pool: BlockPool, gib: float, fractions: dict[str, float] | None = None
    ) -> HostTier:
        """A tier of `gib` GiB; with tenant `fractions`, each tenant's quota is its fraction."""
        per = KVCache.bytes_per_block(
            kv.num_layers, kv.block_size, kv.data.shape[4], kv.data.shape[5], kv.data.dtype
        )
        slots = int(gib * 2**30) // per
        if slots < 1:
            raise ValueError(
                f"kv_host_cache_gb={gib} holds no KV block: one block takes {per} bytes "
                f"({per / 2**30:.6f} GiB); raise it or set it to 0"
            )
        want = slots * per
        ram = _physical_memory()
        if ram is not None and want > ram:
            raise ValueError(
                f"kv_host_cache_gb={gib} asks for {want / 2**30:.1f} GiB of host memory; this "
                f"machine has {ram / 2**30:.1f} GiB in all (lower it, leaving room for the rest)"
            )
        quotas = None
        if fractions:
            quotas = [int(fractions[t] * slots + 1e-9) for t in pool.tenants]
        try:
            return cls(kv, pool, slots, quotas)
        except (RuntimeError, MemoryError) as e:
            raise ValueError(
                f"kv_host_cache_gb={gib}: {want / 2**30:.1f} GiB of host memory could not be "
                f"allocated ({e}); lower it"
            ) from e

    # ---- counts ---------------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        """Slots holding a block."""
        return len(self._slot_of)

    @property
    def num_locked(self) -> int:
        """Slots a restore in progress reads."""
        return len(self._locked)

    @property
    def bandwidth(self) -> float:
        """Bytes per second of the copies timed so far (0 before the first)."""
        return self.copy_bytes / self.copy_seconds if self.copy_seconds > 0 else 0.0

    def charged(self, account: int) -> int:
        """Slots held for pool account `account`."""
        return len(self._lru[account])

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot holding `block_hash`, or None."""
        return self._slot_of.get(block_hash)

    def hashes(self) -> list[bytes]:
        """The hash of every block the tier holds."""
        return list(self._slot_of)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slot_of

    # ---- device -> host -------------------------------------------------------------------
    def offload(self, blocks: list[int], accounts: list[int], hashes: list[bytes]) -> None:
        """Save evicted pool blocks (complete, their hashes just dropped from the pool) before
        they are reused. One call per allocation; blocks already here only become recent."""
        dst_blocks: list[int] = []
        slots: list[int] = []
        stored: list[bytes] = []
        dropped: list[bytes] = []
        for b, t, h in zip(blocks, accounts, hashes, strict=True):
            slot = self._slot_of.get(h)
            if slot is not None:
                self._lru[self._account_of[h]].move_to_end(h)
                continue
            slot = self._take_slot(t, dropped)
            if slot is None:
                continue  # no room this tenant may use: the block is dropped as before
            self._slot_of[h] = slot
            self._account_of[h] = t
            self._lru[t][h] = slot
            dst_blocks.append(b)
            slots.append(slot)
            stored.append(h)
        if dropped:
            self.pool.emit("removed", "host", dropped)
        if not slots:
            return
        self._copy_to_host(dst_blocks, slots)
        self.blocks_to_host += len(slots)
        self.pool.emit("stored", "host", stored)

    def _take_slot(self, t: int, dropped: list[bytes]) -> int | None:
        """A slot for account `t`: its own least recent one at its quota, a free one, else the
        least recent of the account furthest over its quota; None when none may be taken."""
        quota = self.quota[t]
        if quota is not None and len(self._lru[t]) >= quota:
            return self._drop(t, dropped)
        if self._free:
            return self._free.popleft()
        best, excess = -1, None
        for a, lru in enumerate(self._lru):
            if not lru:
                continue
            q = self.quota[a]
            e = len(lru) - (q if q is not None else 0)
            if excess is None or e > excess:
                best, excess = a, e
        return self._drop(best, dropped) if best >= 0 else None

    def _drop(self, t: int, dropped: list[bytes]) -> int | None:
        """Free account `t`'s least recent slot that no restore reads; returns it (or None)."""
        h = next((h for h, slot in self._lru[t].items() if slot not in self._locked), None)
        if h is None:
            return None
        slot = self._lru[t][h]
        del self._lru[t][h]
        del self._slot_of[h]
        del self._account_of[h]
        self.dropped += 1
        dropped.append(h)
        return slot

    # ---- host -> device -------------------------------------------------------------------
    def lock(self, hashes: list[bytes]) -> list[int]:
        """The slots of `hashes` (all present: from `lookup`), kept until `restore` has read
        them (or `unlock`): an allocation in between may offload but never drops them."""
        slots = [self._slot_of[h] for h in hashes]
        for h, s in zip(hashes, slots, strict=True):
            self._locked[s] = self._locked.get(s, 0) + 1
            self._lru[self._account_of[h]].move_to_end(h)
        return slots

    def unlock(self, slots: list[int]) -> None:
        for s in slots:
            n = self._locked[s] - 1
            if n:
                self._locked[s] = n
            else:
                del self._locked[s]

    def restore(self, slots: list[int], blocks: list[int]) -> None:
        """Copy locked `slots` into pool `blocks` (fresh, held by the caller) and unlock them.
        On CUDA the step that follows waits for the copy on the device, not in Python."""
        try:
            self._copy_to_device(slots, blocks)
        finally:
            self.unlock(slots)
        self.blocks_to_device += len(blocks)

    # ---- copies ---------------------------------------------------------------------------
    def _copy_to_host(self, blocks: list[int], slots: list[int]) -> None:
        """Pool `blocks` into host `slots`. The gather runs on the compute stream (after the step
        in flight, before the next one writes the blocks); the copy to the host on the copy
        stream, overlapping the next step, which need not wait for it."""
        kv = self.kv
        idx = device_tensor(blocks, torch.long, kv.data.device)
        # [n, layers, 2, block_size, kv_heads, head_dim], contiguous on the pool's device.
        src = kv.data.index_select(2, idx).movedim(2, 0).contiguous()
        ssrc = None
        if self.scales is not None and kv.scales is not None:
            ssrc = kv.scales.index_select(2, idx).movedim(2, 0).contiguous()
        with self._on_copy_stream(after_compute=True, keep=(src, ssrc)) as timing:
            for j, s, k in _runs(slots):
                self.data[s : s + k].copy_(src[j : j + k], non_blocking=True)
                if ssrc is not None:
                    self.scales[s : s + k].copy_(ssrc[j : j + k], non_blocking=True)
            timing.append(len(slots) * self.block_bytes)

    def _copy_to_device(self, slots: list[int], blocks: list[int]) -> None:
        """Host `slots` into pool `blocks`. The copy from the host runs on the copy stream into a
        staging buffer, overlapping the step in flight; the scatter into the blocks on the compute
        stream, once that copy is done (the blocks' previous users have run by then)."""
        kv = self.kv
        dev = kv.data.device
        staged_scales = None
        with self._on_copy_stream(after_compute=False) as timing:
            staged = torch.empty(
                (len(slots), *self.data.shape[1:]), dtype=kv.data.dtype, device=dev
            )
            if self.scales is not None and kv.scales is not None:
                shape = (len(slots), *self.scales.shape[1:])
                staged_scales = torch.empty(shape, dtype=kv.scales.dtype, device=dev)
            for j, s, k in _runs(slots):
                staged[j : j + k].copy_(self.data[s : s + k], non_blocking=True)
                if staged_scales is not None:
                    staged_scales[j : j + k].copy_(self.scales[s : s + k], non_blocking=True)
            timing.append(len(slots) * self.block_bytes)
        if self.stream is not None:  # the staging buffers are read on the compute stream too
            compute = torch.cuda.current_stream(dev)
            compute.wait_event(self._timings[-1][1])
            staged.record_stream(compute)
            if staged_scales is not None:
                staged_scales.record_stream(compute)
        idx = device_tensor(blocks, torch.long, dev)
        kv.data.index_copy_(2, idx, staged.movedim(0, 2))
        if staged_scales is not None:
            kv.scales.index_copy_(2, idx, staged_scales.movedim(0, 2))

    @contextlib.contextmanager
    def _on_copy_stream(self, after_compute: bool, keep: tuple = ()):
        """Run a copy on the copy stream (after the compute stream's work so far when
        `after_compute`; `keep`: tensors of the compute stream it reads, kept until it ran);
        yields a list the copy appends its byte count to. On CPU: a timed plain copy."""
        sizes: list[int] = []
        if self.stream is None:
            t0 = time.perf_counter()
            yield sizes
            self.copy_seconds += time.perf_counter() - t0
            self.copy_bytes += sum(sizes)
            return
        if after_compute:
            self.stream.wait_stream(torch.cuda.current_stream(self.kv.data.device))
        for t in keep:
            if t is not None:
                t.record_stream(self.stream)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            yield sizes
            end.record(self.stream)
        self._timings.append((start, end, sum(sizes)))
        self._collect_timings()

    def _collect_timings(self) -> None:
        """Add the copies that have finished to the bandwidth figures (never waits); the
        latest copy's events stay (a restore's scatter waits for its end)."""
        while len(self._timings) > 1 and self._timings[0][1].query():
            start, end, n = self._timings.popleft()
            self.copy_seconds += start.elapsed_time(end) / 1e3
            self.copy_bytes += n

    def stats(self) -> dict[str, float | int]:
        """The tier's figures (plain reads; safe from another thread for metrics)."""
        return {
            "slots": self.num_slots,
            "blocks": self.num_used,
            "block_bytes": self.block_bytes,
            "blocks_to_host": self.blocks_to_host,
            "blocks_to_device": self.blocks_to_device,
            "dropped": self.dropped,
            "copy_bytes": self.copy_bytes,
            "copy_seconds": self.copy_seconds,
        }


def _host_buffer(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Zeroed host memory (every page touched now); `pin`: page-locked for the GPU. Pinned by
    registering it rather than with `pin_memory=True`, whose caching allocator rounds a
    request up to a power of two (a 40 GiB tier would lock 64 GiB)."""
    t = torch.zeros(shape, dtype=dtype)
    if pin:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size()} bytes: {err}")
        # Unregistered before its memory is freed (never at exit: the process frees it all).
        weakref.finalize(t, _unpin, t.data_ptr()).atexit = False
    return t


def _unpin(ptr: int) -> None:
    """Unregister pinned host memory once no copy in flight reads or writes it."""
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _physical_memory() -> int | None:
    """Bytes of physical memory of this machine, None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(index in `slots`, first slot, length) of each run of consecutive slots."""
    out: list[tuple[int, int, int]] = []
    j = 0
    while j < len(slots):
        k = 1
        while j + k < len(slots) and slots[j + k] == slots[j] + k:
            k += 1
        out.append((j, slots[j], k))
        j += k
    return out
