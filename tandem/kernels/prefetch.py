"""L2 prefetch: asking L2 for memory a later kernel will read, while the DRAM is otherwise idle.

A batch-1 decode step reads ~4 GB of weights, but between the GEMVs (RMSNorm, rotary + KV write,
attention, the attention merge, silu * up) the DRAM is nearly idle: the attention of one layer
reads ~4 MB of K/V in ~8 us. Weights are never written by a kernel, so the next GEMVs' codes can
be fetched into L2 during that window; the GEMVs then find them there.

`L2Prefetch` holds a fixed list of byte ranges cut into chunks (device tensors, built once: a
CUDA graph captures the launch as it is); `launch()` runs `_l2_prefetch_kernel`, one lane per
chunk, each issuing one `cp.async.bulk.prefetch.L2` (Hopper and later; the data is not returned
and no register or shared memory holds it). With PDL the kernel lets its successor launch at
once and prefetches before its own wait: it delays no kernel, and it calls the wait
unconditionally, so the kernels after it still wait for the ones before it (`pdl`).

Where there is nothing to prefetch into (CPU, the interpreter, a GPU before sm_90) `launch()`
does nothing: a prefetch changes no value, only when bytes arrive.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tandem.kernels import pdl

CHUNK_BYTES = 16 << 10  # bytes per bulk prefetch (one lane's)


@triton.jit
def prefetch_l2_lines(addr):
    """Ask L2 for the 128-byte line holding each address (int64 tensor); nothing is returned
    and no register is held for the data. Compiled CUDA only."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
        "=r,l",
        [addr],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _l2_prefetch_kernel(
    addr_ptr,  # int64 [C] chunk start addresses (16-byte aligned)
    size_ptr,  # int32 [C] chunk sizes in bytes (multiples of 16)
    C,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # Its successor may launch now: this kernel writes nothing and reads only weights.
    pdl.launch_dependents(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < C
    addr = tl.load(addr_ptr + offs, mask=ok, other=0)
    size = tl.load(size_ptr + offs, mask=ok, other=0)
    addr = tl.where(ok, addr, tl.load(addr_ptr))  # lanes past the end repeat chunk 0's start
    size = tl.where(ok, size, 16)
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
        "=r,l,r",
        [addr, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    pdl.wait(PDL)  # unconditional: the kernels after this one rely on it (see `pdl`)


def chunks(ranges: list[tuple[int, int]], chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """Byte ranges (address, size) cut into (address, size) chunks of at most chunk_bytes, each
    start rounded down and each end up to 16 bytes (what the bulk prefetch takes); empty ranges
    are dropped."""
    if chunk_bytes <= 0 or chunk_bytes % 16:
        raise ValueError(f"chunk_bytes must be a positive multiple of 16, got {chunk_bytes}")
    out = []
    for addr, size in ranges:
        if size < 0:
            raise ValueError(f"negative range size {size} at address {addr:#x}")
        if size == 0:
            continue
        start = addr // 16 * 16
        end = -(-(addr + size) // 16) * 16
        for a in range(start, end, chunk_bytes):
            out.append((a, min(chunk_bytes, end - a)))
    return out


def available(device: torch.device) -> bool:
    """Whether a bulk L2 prefetch can run on `device` (compiled CUDA, sm_90 or later)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


class L2Prefetch:
    """A fixed set of byte ranges on one device, prefetched into L2 by `launch()`."""

    BLOCK = 32  # chunks per program: one warp, one chunk a lane

    def __init__(self, ranges: list[tuple[int, int]], device: torch.device | str,
                 chunk_bytes: int = CHUNK_BYTES) -> None:  # fmt: skip
        self.device = torch.device(device)
        self.chunks = chunks(ranges, chunk_bytes)
        self.nbytes = sum(s for _, s in self.chunks)
        self.enabled = bool(self.chunks) and available(self.device)
        if self.enabled:
            self._addr = torch.tensor([a for a, _ in self.chunks], dtype=torch.int64,
                                      device=self.device)  # fmt: skip
            self._size = torch.tensor([s for _, s in self.chunks], dtype=torch.int32,
                                      device=self.device)  # fmt: skip

    def launch(self) -> None:
        """Prefetch the ranges (nothing where `available` is False or there are none)."""
        if not self.enabled:
            return
        c = len(self.chunks)
        _l2_prefetch_kernel[(triton.cdiv(c, self.BLOCK),)](
            self._addr, self._size, c, BLOCK=self.BLOCK, num_warps=1,
            **pdl.launch_options(self._addr),
        )  # fmt: skip
