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

from tandem.config import kernel_config
from tandem.formats import kv as kv_format
from tandem.kernels import pdl
from tandem.kernels._triton import tl, triton
from tandem.model.rotary import apply_rotary


@triton.jit
def _token_rope(positions_ptr, slot_ptr, cos_sin_ptr, tok, DT: tl.constexpr, HALF: tl.constexpr,
                BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """A token's slot (raw, block, offset) and its cos/sin rows rounded to the activation dtype."""
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    slot_raw = tl.load(slot_ptr + tok).to(tl.int64)
    slot = tl.maximum(slot_raw, 0)
    offs = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + offs).to(DT).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + offs).to(DT).to(tl.float32)[None, :]
    return slot_raw, slot // BLOCK_SIZE, slot % BLOCK_SIZE, cos, sin


@triton.jit
def _token_rope_waited(positions_ptr, slot_ptr, cos_sin_ptr, tok, DT: tl.constexpr,
                       HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr,
                       PREWAIT: tl.constexpr):  # fmt: skip
    """`_token_rope` and the PDL wait: with PREWAIT the loads come first (positions and slots
    come from the host before the step, the table is constant), else after the wait."""
    if PREWAIT:
        slot_raw, blk, off, cos, sin = _token_rope(
            positions_ptr, slot_ptr, cos_sin_ptr, tok, DT, HALF, BLOCK_SIZE
        )
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    if not PREWAIT:
        slot_raw, blk, off, cos, sin = _token_rope(
            positions_ptr, slot_ptr, cos_sin_ptr, tok, DT, HALF, BLOCK_SIZE
        )
    return slot_raw, blk, off, cos, sin


@triton.jit
def _rotate(x1, x2, cos, sin, DT: tl.constexpr):
    """(x1 cos - x2 sin, x2 cos + x1 sin) with every product and the result rounded to DT."""
    a = (x1 * cos).to(DT).to(tl.float32)
    b = (x2 * sin).to(DT).to(tl.float32)
    c = (x2 * cos).to(DT).to(tl.float32)
    d = (x1 * sin).to(DT).to(tl.float32)
    return (a - b).to(DT), (c + d).to(DT)


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
    PDL: tl.constexpr,
    PREWAIT: tl.constexpr = False,  # the token's position, slot and cos/sin before the wait
    ACC_IN: tl.constexpr = False,  # qkv: a GEMV's float32 accumulator, rounded here, then zeroed
):
    tok = tl.program_id(0).to(tl.int64)
    dt = q_out_ptr.dtype.element_ty
    slot_raw, blk, off, cos, sin = _token_rope_waited(
        positions_ptr, slot_ptr, cos_sin_ptr, tok, dt, HALF, BLOCK_SIZE, PDL, PREWAIT
    )
    offs = tl.arange(0, HALF)

    # q heads then k heads: they sit next to each other in the qkv row.
    heads = tl.arange(0, BLOCK_HEADS)
    valid = heads < NUM_Q_HEADS + NUM_KV_HEADS
    row = qkv_ptr + tok * stride_qkv
    src = row + heads[:, None] * (2 * HALF) + offs[None, :]
    x1 = tl.load(src, mask=valid[:, None], other=0.0).to(dt).to(tl.float32)
    x2 = tl.load(src + HALF, mask=valid[:, None], other=0.0).to(dt).to(tl.float32)
    vh = tl.arange(0, BLOCK_KV)
    offs_d = tl.arange(0, 2 * HALF)
    v_src = row + (NUM_Q_HEADS + NUM_KV_HEADS) * (2 * HALF) + vh[:, None] * (2 * HALF)
    if ACC_IN:  # every value read (v in full, whatever the slot), then the row zeroed
        v = tl.load(v_src + offs_d[None, :], mask=(vh < NUM_KV_HEADS)[:, None], other=0.0)
        v = v.to(dt)
        tl.debug_barrier()
        zero = tl.zeros([BLOCK_HEADS, HALF], tl.float32)
        tl.store(src, zero, mask=valid[:, None])
        tl.store(src + HALF, zero, mask=valid[:, None])
        tl.store(v_src + offs_d[None, :], tl.zeros([BLOCK_KV, 2 * HALF], tl.float32),
                 mask=(vh < NUM_KV_HEADS)[:, None])  # fmt: skip
    lo, hi = _rotate(x1, x2, cos, sin, dt)

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

    is_v = (vh < NUM_KV_HEADS) & ((vh * 0 + slot_raw) >= 0)
    if not ACC_IN:
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
    acc_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rotate q and k, write k and v into their cache slots in one pass; returns q [T, Hq, D].
    `acc_dtype`: qkv is an INT4 GEMV's float32 accumulator (`w4a16.gemv_accumulates`), rounded
    to this dtype as the GEMV would have stored it (q's dtype too), and left zeroed."""
    t, d = _check(qkv, k_cache, num_q_heads, num_kv_heads)
    if acc_dtype is not None and (qkv.dtype != torch.float32 or not qkv.is_contiguous()):
        raise ValueError(f"acc_dtype needs a contiguous float32 accumulator, got {qkv.dtype}")
    if d < 2 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of 2, got {d}")
    if qkv.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("qkv and the caches need a contiguous last dimension")
    if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous() or cos_sin.shape[1] != d:
        raise ValueError(f"cos_sin must be a contiguous float32 [P, {d}] table")
    q = torch.empty((t, num_q_heads, d), dtype=acc_dtype or qkv.dtype, device=qkv.device)
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
        *q.stride()[:2],
        *k_cache.stride()[:3],  # block, slot, head (the head dim is contiguous)
        *v_cache.stride()[:3],
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
        PREWAIT=pdl.prewait(qkv),
        ACC_IN=acc_dtype is not None,
        **pdl.launch_options(qkv),
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
    acc_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rotary q/k plus the KV-cache write: the Triton kernel on CUDA, the eager ops elsewhere
    (`acc_dtype`: see `rope_cache_write_triton`; CUDA only)."""
    if qkv.is_cuda:
        return rope_cache_write_triton(qkv, positions, cos_sin, slot_mapping, k_cache, v_cache,
                                       num_q_heads, num_kv_heads, acc_dtype)  # fmt: skip
    if acc_dtype is not None:
        raise ValueError("acc_dtype is for CUDA tensors")
    return rope_cache_write_ref(
        qkv, positions, cos_sin, slot_mapping, k_cache, v_cache, num_q_heads, num_kv_heads
    )


# ---- FP8 / INT8 caches: rotary + quantize-on-write, for decode steps ---------------------------


@triton.jit
def _to_codes(x, QMAX: tl.constexpr, IS_INT8: tl.constexpr, RINT: tl.constexpr):
    """Values already divided by their scale -> codes saturated at +-QMAX (`quantize_codes`)."""
    if IS_INT8:
        if RINT:  # round half to even, as torch.round
            r = tl.extra.cuda.libdevice.rint(x)
        else:  # the interpreter has no libdevice; ties (x.5 exactly) round away from zero
            r = tl.where(x >= 0, tl.floor(x + 0.5), -tl.floor(-x + 0.5))
        codes = tl.minimum(tl.maximum(r, -QMAX), QMAX).to(tl.int8)
    else:
        codes = tl.minimum(tl.maximum(x, -QMAX), QMAX).to(tl.float8e4nv)
    return codes


@triton.jit
def _write_row_scaled(
    cache_ptr,  # [num_blocks, block_size, Hkv, D] fp8/int8
    scale_ptr,  # [num_blocks, Hkv] float32
    blk,
    off,
    ok,  # [BLOCK_KV] heads to write (real heads of a real slot)
    lo,  # [BLOCK_KV, HALF] float32: dims [0, HALF) of the new row
    hi,  # [BLOCK_KV, HALF]: dims [HALF, D)
    stride_b,
    stride_t,
    stride_h,
    stride_sb,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    INV_TARGET: tl.constexpr,  # 1 / SCALE_TARGET
    QMAX: tl.constexpr,  # the largest code
    IS_INT8: tl.constexpr,
    RINT: tl.constexpr,
):
    """One token's row into its block with `write_kv_block_scaled`'s arithmetic: the block's
    scale grows to cover the row (a block whose first slot this is starts from 0), the codes it
    already holds are re-quantized by old / new when it grew, then the row is quantized."""
    hk = tl.arange(0, BLOCK_KV)
    amax = tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))
    sp = scale_ptr + blk * stride_sb + hk
    s_old = tl.load(sp, mask=ok, other=0.0)
    s_old = tl.where(hk * 0 + off == 0, 0.0, s_old)
    # IEEE divisions (div_rn), as torch divides tensors: Triton's `/` on float32 is approximate.
    s_new = tl.maximum(s_old, amax * INV_TARGET)
    pos = s_new > 0
    s_div = tl.where(pos, s_new, 1.0)  # no division by zero in the lanes that are not used
    ratio = tl.where(pos, tl.div_rn(s_old, s_div), 1.0)
    grow = tl.max(tl.where(ok & (ratio != 1.0), 1, 0), axis=0)
    if (off == 0) | (grow > 0):
        rows = tl.arange(0, BLOCK_SIZE)
        dims = tl.arange(0, 2 * HALF)
        ptr = (
            cache_ptr
            + blk * stride_b
            + rows[:, None, None] * stride_t
            + hk[None, :, None] * stride_h
            + dims[None, None, :]
        )
        m = (rows != off)[:, None, None] & ok[None, :, None] & (dims < 2 * HALF)[None, None, :]
        held = tl.load(ptr, mask=m, other=0.0).to(tl.float32) * ratio[None, :, None]
        tl.store(ptr, _to_codes(held, QMAX, IS_INT8, RINT), mask=m)
    inv = tl.where(pos, tl.div_rn(tl.full(s_new.shape, 1.0, tl.float32), s_div), 0.0)[:, None]
    offs = tl.arange(0, HALF)
    dst = cache_ptr + blk * stride_b + off * stride_t + hk[:, None] * stride_h + offs[None, :]
    tl.store(dst, _to_codes(lo * inv, QMAX, IS_INT8, RINT), mask=ok[:, None])
    tl.store(dst + HALF, _to_codes(hi * inv, QMAX, IS_INT8, RINT), mask=ok[:, None])
    tl.store(sp, s_new, mask=ok)


@triton.jit
def _rope_cache_scaled_kernel(
    qkv_ptr,  # [T, (Hq + 2 Hkv) * D]
    positions_ptr,  # [T]
    cos_sin_ptr,  # [P, D] f32
    slot_ptr,  # [T]; every real token in a different block; < 0 writes nothing
    q_out_ptr,  # [T, Hq, D]
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, Hkv] float32
    v_scale_ptr,
    stride_qkv,
    stride_qo_t,
    stride_qo_h,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ksb,
    stride_vsb,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # Hq padded to a power of 2
    BLOCK_KV: tl.constexpr,  # Hkv padded to a power of 2
    INV_TARGET: tl.constexpr,  # 1 / SCALE_TARGET
    QMAX: tl.constexpr,  # the largest code
    IS_INT8: tl.constexpr,
    RINT: tl.constexpr,
    PDL: tl.constexpr,
    PREWAIT: tl.constexpr = False,  # the token's position, slot and cos/sin before the wait
):
    tok = tl.program_id(0).to(tl.int64)
    dt = q_out_ptr.dtype.element_ty
    slot_raw, blk, off, cos, sin = _token_rope_waited(
        positions_ptr, slot_ptr, cos_sin_ptr, tok, dt, HALF, BLOCK_SIZE, PDL, PREWAIT
    )
    offs = tl.arange(0, HALF)
    row = qkv_ptr + tok * stride_qkv

    # q: rotate and store.
    qh = tl.arange(0, BLOCK_Q)
    is_q = qh < NUM_Q_HEADS
    src = row + qh[:, None] * (2 * HALF) + offs[None, :]
    x1 = tl.load(src, mask=is_q[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=is_q[:, None], other=0.0).to(tl.float32)
    lo, hi = _rotate(x1, x2, cos, sin, dt)
    q_dst = q_out_ptr + tok * stride_qo_t + qh[:, None] * stride_qo_h + offs[None, :]
    tl.store(q_dst, lo, mask=is_q[:, None])
    tl.store(q_dst + HALF, hi, mask=is_q[:, None])

    # k: rotate in the activation dtype, then quantize into the cache.
    hk = tl.arange(0, BLOCK_KV)
    ok = (hk < NUM_KV_HEADS) & ((hk * 0 + slot_raw) >= 0)
    src = row + (NUM_Q_HEADS + hk[:, None]) * (2 * HALF) + offs[None, :]
    x1 = tl.load(src, mask=ok[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
    k_lo, k_hi = _rotate(x1, x2, cos, sin, dt)
    _write_row_scaled(
        k_cache_ptr, k_scale_ptr, blk, off, ok, k_lo.to(tl.float32), k_hi.to(tl.float32),
        stride_kb, stride_kt, stride_kh, stride_ksb,
        HALF, BLOCK_SIZE, BLOCK_KV, INV_TARGET, QMAX, IS_INT8, RINT,
    )  # fmt: skip

    # v: as it is.
    src = row + (NUM_Q_HEADS + NUM_KV_HEADS + hk[:, None]) * (2 * HALF) + offs[None, :]
    v_lo = tl.load(src, mask=ok[:, None], other=0.0).to(tl.float32)
    v_hi = tl.load(src + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
    _write_row_scaled(
        v_cache_ptr, v_scale_ptr, blk, off, ok, v_lo, v_hi,
        stride_vb, stride_vt, stride_vh, stride_vsb,
        HALF, BLOCK_SIZE, BLOCK_KV, INV_TARGET, QMAX, IS_INT8, RINT,
    )  # fmt: skip


def rope_cache_write_scaled_ref(
    qkv, positions, cos_sin, slot_mapping, k_cache, v_cache, k_scale, v_scale, hq, hkv
) -> torch.Tensor:
    """The eager path the kernel replaces (decode: every token in its own block)."""
    t, d = _check(qkv, k_cache, hq, hkv)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    cs = cos_sin.index_select(0, positions).to(qkv.dtype)
    cos, sin = cs[:, None, : d // 2], cs[:, None, d // 2 :]
    q = apply_rotary(q.reshape(t, hq, d), cos, sin)
    k = apply_rotary(k.reshape(t, hkv, d), cos, sin)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kv_format.write_kv_block_scaled(k_cache, k_scale, slots, k[keep], unique_blocks=True)
    kv_format.write_kv_block_scaled(
        v_cache, v_scale, slots, v.reshape(t, hkv, d)[keep], unique_blocks=True
    )
    return q


def rope_cache_write_scaled(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]: each real token in a different block (a decode step)
    k_cache: torch.Tensor,  # fp8 / int8 [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,  # [num_blocks, Hkv] float32
    v_scale: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Rotary q/k and the quantized KV write of a decode step in one Triton launch; returns q.

    Replaces apply_rotary twice plus `write_kv_block_scaled` twice (about 80 small launches per
    layer). Codes and scales equal the eager path's (`rope_cache_write_scaled_ref`)."""
    t, d = _check(qkv, k_cache, num_q_heads, num_kv_heads)
    if d < 2 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of 2, got {d}")
    if k_cache.dtype not in (torch.float8_e4m3fn, torch.int8) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"rope_cache_write_scaled needs fp8/int8 caches, got {k_cache.dtype}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(-1) != 1 or c.stride(2) != d:
            raise ValueError(f"{name} needs contiguous [.., Hkv, D] rows")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s.dtype != torch.float32 or s.stride(-1) != 1:
            raise ValueError(f"{name} must be float32 with contiguous heads")
    q = torch.empty((t, num_q_heads, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    compiled = qkv.is_cuda and not kernel_config().interpreted
    _rope_cache_scaled_kernel[(t,)](
        qkv, positions, cos_sin, slot_mapping, q, k_cache, v_cache, k_scale, v_scale,
        qkv.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0), v_scale.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=d // 2,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_Q=triton.next_power_of_2(num_q_heads),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        INV_TARGET=1.0 / kv_format.SCALE_TARGET[k_cache.dtype],
        QMAX=kv_format.QMAX[k_cache.dtype],
        IS_INT8=k_cache.dtype == torch.int8,
        RINT=compiled,
        num_warps=4,
        enable_fp_fusion=False,  # products rounded one by one, as the eager ops do
        PREWAIT=pdl.prewait(qkv),
        **pdl.launch_options(qkv),
    )  # fmt: skip
    return q
