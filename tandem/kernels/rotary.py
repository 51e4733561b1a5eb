"""Rotary embedding of q and k fused with the KV-cache write: one Triton pass over a qkv row.

The unfused path costs about sixteen small launches per layer (slices, four products, a
difference, a sum and a concatenation for q and again for k, then two `index_copy_`), which at
decode batch sizes is pure launch latency. The kernel reads each token's qkv projection once,
writes the rotated q to a new [T, Hq, D] tensor and the rotated k and the untouched v straight
into their cache slots.

Numerics are transformers' (and `tandem.model.rotary.apply_rotary`'s) in the activation dtype:
cos and sin are rounded to that dtype, every product and the final sum or difference is rounded
to it, exactly as the eager ops do. A negative slot writes nothing: the padding rows of a
captured decode batch use slot -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.model.rotary import apply_rotary


@triton.jit
def _rope_cache_kernel(
    qkv_ptr,  # [T, (Hq + 2 Hkv) * D]
    positions_ptr,  # [T]
    cos_sin_ptr,  # [P, D] f32: cos in [:D/2], sin in [D/2:]
    slot_ptr,  # [T]: flat cache slot (block * block_size + offset); < 0 writes nothing
    q_out_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    stride_qkv,
    stride_qo_t,
    stride_qo_h,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_HEADS: tl.constexpr,  # Hq + Hkv padded to a power of 2
    BLOCK_KV: tl.constexpr,  # Hkv padded to a power of 2
):
    tok = tl.program_id(0).to(tl.int64)
    dt = q_out_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    slot_raw = tl.load(slot_ptr + tok).to(tl.int64)
    slot = tl.maximum(slot_raw, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE

    offs = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + offs).to(dt).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + offs).to(dt).to(tl.float32)[None, :]

    # q heads then k heads: they sit next to each other in the qkv row.
    heads = tl.arange(0, BLOCK_HEADS)
    valid = heads < NUM_Q_HEADS + NUM_KV_HEADS
    row = qkv_ptr + tok * stride_qkv
    src = row + heads[:, None] * (2 * HALF) + offs[None, :]
    x1 = tl.load(src, mask=valid[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=valid[:, None], other=0.0).to(tl.float32)
    a = (x1 * cos).to(dt).to(tl.float32)
    b = (x2 * sin).to(dt).to(tl.float32)
    c = (x2 * cos).to(dt).to(tl.float32)
    d = (x1 * sin).to(dt).to(tl.float32)
    lo = (a - b).to(dt)
    hi = (c + d).to(dt)

    is_q = heads < NUM_Q_HEADS
    q_dst = q_out_ptr + tok * stride_qo_t + heads[:, None] * stride_qo_h + offs[None, :]
    tl.store(q_dst, lo, mask=is_q[:, None])
    tl.store(q_dst + HALF, hi, mask=is_q[:, None])

    kh = tl.maximum(heads - NUM_Q_HEADS, 0)
    # Masks are built as vectors: the interpreter rejects a scalar-and-vector boolean mask.
    is_k = valid & (heads >= NUM_Q_HEADS) & ((heads * 0 + slot_raw) >= 0)
    k_dst = (
        k_cache_ptr + blk * stride_kb + off * stride_kt + kh[:, None] * stride_kh + offs[None, :]
    )
    kdt = k_cache_ptr.dtype.element_ty
    tl.store(k_dst, lo.to(kdt), mask=is_k[:, None])
    tl.store(k_dst + HALF, hi.to(kdt), mask=is_k[:, None])

    vh = tl.arange(0, BLOCK_KV)
    is_v = (vh < NUM_KV_HEADS) & ((vh * 0 + slot_raw) >= 0)
    offs_d = tl.arange(0, 2 * HALF)
    v_src = row + (NUM_Q_HEADS + NUM_KV_HEADS) * (2 * HALF) + vh[:, None] * (2 * HALF)
    v = tl.load(v_src + offs_d[None, :], mask=is_v[:, None], other=0.0)
    v_dst = v_cache_ptr + blk * stride_vb + off * stride_vt + vh[:, None] * stride_vh
    tl.store(v_dst + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=is_v[:, None])


def _check(
    qkv: torch.Tensor, k_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int
) -> tuple[int, int]:
    t, width = qkv.shape
    d = k_cache.shape[-1]
    if width != (num_q_heads + 2 * num_kv_heads) * d:
        raise ValueError(
            f"qkv width {width} is not (Hq + 2 Hkv) * D = ({num_q_heads} + 2 * {num_kv_heads}) * {d}"
        )
    if k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"cache has {k_cache.shape[2]} kv heads, expected {num_kv_heads}")
    return t, d


def rope_cache_write_ref(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]
    positions: torch.Tensor,  # [T] long
    cos_sin: torch.Tensor,  # [P, D] float32
    slot_mapping: torch.Tensor,  # [T] long; < 0 writes nothing
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """The eager ops the kernel replaces; returns the rotated q [T, Hq, D]."""
    t, d = _check(qkv, k_cache, num_q_heads, num_kv_heads)
    half = d // 2
    q, k, v = qkv.split([num_q_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    cs = cos_sin.index_select(0, positions)
    cos = cs[:, None, :half].to(qkv.dtype)
    sin = cs[:, None, half:].to(qkv.dtype)
    q = apply_rotary(q.reshape(t, num_q_heads, d), cos, sin)
    k = apply_rotary(k.reshape(t, num_kv_heads, d), cos, sin)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, d).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, d).index_copy_(
        0, slots, v.reshape(t, num_kv_heads, d)[keep].to(v_cache.dtype)
    )
    return q


def rope_cache_write_triton(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Rotate q and k, write k and v into their cache slots in one pass; returns q [T, Hq, D]."""
    t, d = _check(qkv, k_cache, num_q_heads, num_kv_heads)
    if d < 2 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of 2, got {d}")
    if qkv.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("qkv and the caches need a contiguous last dimension")
    if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous() or cos_sin.shape[1] != d:
        raise ValueError(f"cos_sin must be a contiguous float32 [P, {d}] table")
    q = torch.empty((t, num_q_heads, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    _rope_cache_kernel[(t,)](
        qkv,
        positions,
        cos_sin,
        slot_mapping,
        q,
        k_cache,
        v_cache,
        qkv.stride(0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=d // 2,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_HEADS=triton.next_power_of_2(num_q_heads + num_kv_heads),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        num_warps=4,
        # No fused multiply-add: each product is rounded on its own, as the eager ops do
        # (with contraction the compiler merges a product into the sum, one rounding fewer).
        enable_fp_fusion=False,
    )
    return q


def rope_cache_write(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Rotary q/k plus the KV-cache write: the Triton kernel on CUDA, the eager ops elsewhere."""
    fn = rope_cache_write_triton if qkv.is_cuda else rope_cache_write_ref
    return fn(qkv, positions, cos_sin, slot_mapping, k_cache, v_cache, num_q_heads, num_kv_heads)
