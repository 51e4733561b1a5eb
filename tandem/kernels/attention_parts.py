"""Pieces the paged-attention kernels share: L2 prefetch of what a decode step does not write,
K/V tiles dequantized for the dots, and where a decode output element is stored."""

from __future__ import annotations

from tandem.kernels._triton import tl, triton

LOG2E = 1.4426950408889634


@triton.jit
def prefetch_l2(addr, mask):
    """Ask L2 for the 128-byte line holding each address (int64 tensor) where mask (int32, the
    same shape) is not 0; nothing is returned and no register is held for the data. Compiled
    CUDA only."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; } mov.u32 $0, 0;",
        "=r,l,r",
        [addr, mask],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch_partition(
    k_head, v_head, bt_row, stride_btn, start, context_len, stride_kb, stride_kt, stride_vb,
    stride_vt, BLOCK_SIZE: tl.constexpr, PARTITION_SIZE: tl.constexpr, LINES: tl.constexpr,
):  # fmt: skip
    """L2 prefetch of the K and V rows (LINES 128-byte lines each) of positions [start, start +
    PARTITION_SIZE) that lie before the newest token's cache block; the block table read here
    is the host's. Positions outside that range ask for nothing: a partition past the context
    returns at once, and the rest are predicated off (once they asked for the line of pool
    block 0 instead, every one of them, which at batch 256 queued hundreds of thousands of
    requests on one L2 line each layer)."""
    stable = tl.maximum(context_len - 1, 0) // BLOCK_SIZE * BLOCK_SIZE
    stop = tl.minimum(start + PARTITION_SIZE, stable)
    if start < stop:
        offs_t = start + tl.arange(0, PARTITION_SIZE)
        ok = offs_t < stop
        blocks = tl.load(bt_row + (offs_t // BLOCK_SIZE) * stride_btn, mask=ok, other=0)
        blocks = blocks.to(tl.int64)
        slots = offs_t % BLOCK_SIZE
        line = tl.arange(0, LINES) * 128  # bytes
        k_row = (k_head + blocks * stride_kb + slots * stride_kt).to(tl.pointer_type(tl.int8))
        v_row = (v_head + blocks * stride_vb + slots * stride_vt).to(tl.pointer_type(tl.int8))
        want = (ok[:, None] & (line[None, :] >= 0)).to(tl.int32)  # [PARTITION_SIZE, LINES]
        prefetch_l2((k_row[:, None] + line[None, :]).to(tl.int64), want)
        prefetch_l2((v_row[:, None] + line[None, :]).to(tl.int64), want)


@triton.jit
def kv_dot_operands(
    k,
    v,
    ks_ptr,
    vs_ptr,
    scale_idx,
    mask,
    q_dtype: tl.constexpr,
    KV_SCALED: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """K and V tiles [N, D] as the attention dots take them: FP8 / INT8 codes times their
    per-(block, head) scales at `scale_idx` (KV_SCALED), then in q's dtype or float32."""
    if KV_SCALED:
        ks = tl.load(ks_ptr + scale_idx, mask=mask, other=0.0)
        vs = tl.load(vs_ptr + scale_idx, mask=mask, other=0.0)
        k = k.to(tl.float32) * ks[:, None]
        v = v.to(tl.float32) * vs[:, None]
        if not DOT_FP32:
            k = k.to(q_dtype)
            v = v.to(q_dtype)
    elif DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def out_offsets(heads, offs_d, stride_oh, stride_od, oidx_ptr, mask, HEAD_DIM, SCATTER):
    """Offsets in a sequence's output row of (heads [H, 1], dims [1, D]): in place, or where
    `out_index` sends them (SCATTER: the row is contiguous, element h * D + d goes to
    oidx_ptr[h * D + d])."""
    if SCATTER:
        return tl.load(oidx_ptr + heads * HEAD_DIM + offs_d, mask=mask, other=0)
    return heads * stride_oh + offs_d * stride_od
