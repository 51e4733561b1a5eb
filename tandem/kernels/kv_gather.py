"""Copy listed KV blocks of every layer from one paged pool into another: one launch.

A pool is `[layers, 2, blocks, ...]` (k and v of every layer are "planes"); block `src[j]` of
every plane of the source goes to block `dst[j]` of the same plane of the destination. One
program copies one block of one plane, so a prompt of `n` blocks is `n * 2 * layers` programs
in a single launch however scattered its blocks are, reading and writing each byte once. The
source may be another process's pool mapped by CUDA IPC on this GPU.

`gather_blocks_ref` is the torch reference (and what runs off CUDA).
"""

from __future__ import annotations

import torch

from tandem.kernels._triton import tl, triton

# Bytes one program moves per loop iteration (as 32-bit words): 8 KiB.
_CHUNK_WORDS = 2048


@triton.jit
def _gather_blocks_kernel(
    src,
    dst,
    ids,
    n,
    src_plane_words,
    dst_plane_words,
    BLOCK_WORDS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # The pools as 32-bit words, whatever their dtype (bf16, fp8, fp32 scales...).
    src = src.to(tl.pointer_type(tl.int32), bitcast=True)
    dst = dst.to(tl.pointer_type(tl.int32), bitcast=True)
    j = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    s = tl.load(ids + j).to(tl.int64)
    d = tl.load(ids + n + j).to(tl.int64)
    src_base = src + plane * src_plane_words + s * BLOCK_WORDS
    dst_base = dst + plane * dst_plane_words + d * BLOCK_WORDS
    for off in tl.static_range(0, BLOCK_WORDS, CHUNK):
        o = off + tl.arange(0, CHUNK)
        mask = o < BLOCK_WORDS
        tl.store(dst_base + o, tl.load(src_base + o, mask=mask), mask=mask)


def _block_words(t: torch.Tensor) -> int | None:
    """Words (32 bits) in one block of one plane of `t` ([layers, 2, blocks, ...]), or None
    when `t` is not contiguous or its blocks are not whole words. Shape arithmetic only: this
    runs on every handover, before the copy is on the stream."""
    if not t.is_contiguous():
        return None
    block_bytes = t.element_size()
    for d in t.shape[3:]:
        block_bytes *= d
    if block_bytes % 4 or (t.shape[-1] * t.element_size()) % 4:
        return None
    return block_bytes // 4


def gather_blocks_ref(
    dst: torch.Tensor, dst_ids: torch.Tensor, src: torch.Tensor, src_ids: torch.Tensor
) -> None:
    """dst[:, :, dst_ids[j]] = src[:, :, src_ids[j]] for every j (torch; two passes)."""
    if dst.dtype.itemsize == 1 and dst.dtype.is_floating_point:
        # float8: index_copy_ is not implemented for it on every device; bytes are the same.
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    dst.index_copy_(2, dst_ids.to(dst.device), src.index_select(2, src_ids.to(src.device)))


def _launch(dst: torch.Tensor, src: torch.Tensor, ids: torch.Tensor, words: int) -> None:
    """The kernel over `ids` = [source ids..., destination ids...] (int32 or int64)."""
    n = ids.numel() // 2
    _gather_blocks_kernel[(n, src.shape[0] * src.shape[1])](
        src,
        dst,
        ids,
        n,
        src.shape[2] * words,
        dst.shape[2] * words,
        BLOCK_WORDS=words,
        CHUNK=min(_CHUNK_WORDS, triton.next_power_of_2(words)),
        num_warps=4,
    )


def gather_block_pairs(dst: torch.Tensor, src: torch.Tensor, ids: torch.Tensor) -> None:
    """dst[:, :, ids[n + j]] = src[:, :, ids[j]] for every j < n, `ids` holding 2n block ids
    (the sources, then the destinations) on `dst`'s device: one tensor, so one host-to-device
    copy brings both lists. On CUDA, with both pools on one device, one kernel launch and no
    host synchronisation."""
    if src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:]:
        raise ValueError(f"copying blocks of a {tuple(src.shape)} pool into {tuple(dst.shape)}")
    if src.dtype != dst.dtype:
        raise ValueError(f"copying blocks of a {src.dtype} pool into a {dst.dtype} pool")
    if ids.numel() % 2:
        raise ValueError(f"{ids.numel()} block ids: not source and destination pairs")
    if ids.numel() == 0:
        return
    words = _block_words(src)
    if dst.is_cuda and src.device == dst.device and words and _block_words(dst) == words:
        _launch(dst, src, ids, words)
        return
    n = ids.numel() // 2
    gather_blocks_ref(dst, ids[n:], src, ids[:n])
