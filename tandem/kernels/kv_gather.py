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
    src_ids,
    dst_ids,
    src_plane_stride,
    dst_plane_stride,
    BLOCK_WORDS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    j = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    s = tl.load(src_ids + j).to(tl.int64)
    d = tl.load(dst_ids + j).to(tl.int64)
    src_base = src + plane * src_plane_stride + s * BLOCK_WORDS
    dst_base = dst + plane * dst_plane_stride + d * BLOCK_WORDS
    for off in tl.static_range(0, BLOCK_WORDS, CHUNK):
        o = off + tl.arange(0, CHUNK)
        mask = o < BLOCK_WORDS
        tl.store(dst_base + o, tl.load(src_base + o, mask=mask), mask=mask)


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """`t` ([layers, 2, blocks, ...], contiguous) as 32-bit words, or None when its blocks are
    not whole words."""
    if not t.is_contiguous():
        return None
    block_bytes = t[0, 0, 0].numel() * t.element_size()
    if block_bytes % 4 or (t.shape[-1] * t.element_size()) % 4:
        return None
    return t.view(torch.uint8).view(torch.int32)


def gather_blocks_ref(
    dst: torch.Tensor, dst_ids: torch.Tensor, src: torch.Tensor, src_ids: torch.Tensor
) -> None:
    """dst[:, :, dst_ids[j]] = src[:, :, src_ids[j]] for every j (torch; two passes)."""
    if dst.dtype.itemsize == 1 and dst.dtype.is_floating_point:
        # float8: index_copy_ is not implemented for it on every device; bytes are the same.
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    dst.index_copy_(2, dst_ids.to(dst.device), src.index_select(2, src_ids.to(src.device)))


def gather_blocks(
    dst: torch.Tensor, dst_ids: torch.Tensor, src: torch.Tensor, src_ids: torch.Tensor
) -> None:
    """dst[:, :, dst_ids[j]] = src[:, :, src_ids[j]] for every j.

    `dst_ids` and `src_ids` are int32 or int64 tensors on `dst`'s device. On CUDA, with both
    pools on one device, it is one kernel launch and no host synchronisation."""
    if src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:]:
        raise ValueError(f"copying blocks of a {tuple(src.shape)} pool into {tuple(dst.shape)}")
    if src.dtype != dst.dtype:
        raise ValueError(f"copying blocks of a {src.dtype} pool into a {dst.dtype} pool")
    if src_ids.numel() != dst_ids.numel():
        raise ValueError(f"copying {src_ids.numel()} blocks into {dst_ids.numel()}")
    n = src_ids.numel()
    if n == 0:
        return
    sw, dw = _words(src), _words(dst)
    if not (dst.is_cuda and src.device == dst.device and sw is not None and dw is not None):
        gather_blocks_ref(dst, dst_ids, src, src_ids)
        return
    planes = src.shape[0] * src.shape[1]
    block_words = sw[0, 0, 0].numel()
    chunk = min(_CHUNK_WORDS, triton.next_power_of_2(block_words))
    _gather_blocks_kernel[(n, planes)](
        sw,
        dw,
        src_ids,
        dst_ids,
        sw[0, 0].numel(),
        dw[0, 0].numel(),
        BLOCK_WORDS=block_words,
        CHUNK=chunk,
        num_warps=4,
    )
