"""Decode attention over the paged KV cache: the Triton kernel on CUDA, the torch reference
(`paged_attention_ref`) elsewhere.

Cache layout per layer: k_cache, v_cache are [num_blocks, block_size, kv_heads, head_dim].
A sequence's logical block i lives in pool block block_tables[seq, i]. An FP8 / INT8 cache comes
with k_scale, v_scale [num_blocks, kv_heads] float32: a value is code * scale of its block and
head (`tandem.formats.kv`); every path here dequantizes as it reads.

The Triton decode kernel (split-K / "flash decoding" over the paged cache) runs in two stages:
1. one program per (sequence, kv head, partition of the context) reads the block table itself,
   computes all the query heads of its GQA group at once (so each K/V tile is loaded once per
   group) and writes a partial softmax state (running max, sum of exponentials, unnormalised
   output) for its partition;
2. the partitions are merged with a log-sum-exp reduction: by the program of stage 1 that
   finishes a (sequence, kv head) last (an acq_rel arrival counter, `tandem.kernels.arrival`),
   which saves a launch and its wait on the critical path of a decode step; or by a second
   kernel, one program per (sequence, query head) (`merge_last=False`, which the
   model asks for in one-row steps of INT4 weights: measured faster there).
When the whole context fits one partition, stage 1 writes the output directly and stage 2 is
skipped. With PDL (`pdl.prewait`), stage 1
reads the context length and asks L2 for the K/V of its positions before the newest token's
cache block before its PDL wait, while the previous kernel (which writes the newest token)
finishes. Nothing here reads a device value on the host, so the call can be captured in a CUDA
graph.
"""

from __future__ import annotations

import torch

from tandem.kernels import pdl
from tandem.kernels._triton import tl, triton
from tandem.kernels.arrival import arrival_counters
from tandem.kernels.attention_parts import (
    LOG2E,
    kv_dot_operands,
    out_offsets,
    prefetch_l2,
    prefetch_partition,
)
from tandem.kernels.paged_attention_ref import paged_attention_decode_ref


@triton.jit
def _decode_partition_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks]
    context_lens_ptr,  # [B]
    out_ptr,  # [B, Hq, D]: written only when DIRECT_OUT
    m_ptr,  # [B, Hq, P] f32: running max of the scores (base 2) per partition
    l_ptr,  # [B, Hq, P] f32: sum of exp2(score - max) per partition
    acc_ptr,  # [B, Hq, P, D] f32: unnormalised sum of exp2(score - max) * v per partition
    ks_ptr,  # [num_blocks, Hkv] f32 block scales of k: read only when KV_SCALED
    vs_ptr,  # [num_blocks, Hkv] f32 block scales of v
    cnt_ptr,  # int32 [B * Hkv] arrival counters, zero between calls (MERGE)
    oidx_ptr,  # int32 [Hq * D] where each output element goes (SCATTER)
    qk_scale,  # softmax scale * log2(e): scores are kept in base 2 so exp2 can be used
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_btb,
    stride_btn,
    stride_ob,
    stride_oh,
    stride_od,
    stride_sb,  # block stride of the scale tensors (their head stride is 1)
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of 2 >= 16 (tl.dot's minimum M)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # tokens per inner iteration (may span several cache blocks)
    PARTITION_SIZE: tl.constexpr,  # tokens per program, a multiple of BLOCK_N
    DIRECT_OUT: tl.constexpr,  # a single partition: write the normalised output, skip stage 2
    MERGE: tl.constexpr,  # the last partition of a (sequence, kv head) to finish merges them all
    GROUP_P2: tl.constexpr,  # GROUP padded to a power of 2 (the merge's head axis)
    BLOCK_P: tl.constexpr,  # partitions merged per iteration
    DOT_FP32: tl.constexpr,  # upcast K/V/Q before tl.dot instead of feeding the native dtype
    KV_SCALED: tl.constexpr,  # FP8 / INT8 codes times per-(block, head) scales
    PDL: tl.constexpr,
    PREWAIT: tl.constexpr = False,  # context length and an L2 prefetch of stable K/V first
    PREFETCH_LINES: tl.constexpr = 1,  # 128-byte lines per K/V row (a power of 2), for PREWAIT
    SCATTER: tl.constexpr = False,  # output elements placed by oidx_ptr
    PREFETCH: tl.constexpr = True,  # PREWAIT: the L2 prefetch of K/V too
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    num_parts = tl.num_programs(2)
    num_q_heads = tl.num_programs(1) * GROUP
    start = part * PARTITION_SIZE
    # Partitions past the context have nothing to do and stage 2 never reads them, so they write
    # nothing (a captured step's grid is sized for max_model_len). Partition 0 always runs, so an
    # empty context (a padding slot of a captured batch) still produces a defined output (zeros),
    # and the grid as a whole still waits for the kernel before it.
    if PREWAIT:
        # Before the wait, what no kernel of this decode step writes: the context length (copied
        # from the host before the step), and into L2 the K/V lines of the partition's positions
        # before the newest token's cache block (the step writes only the newest token, and an
        # FP8 / INT8 write may re-code the rest of its block). An empty partition (whose prefetch
        # asks for nothing) leaves here, giving its slot back while the kernel before still runs.
        context_len = tl.load(context_lens_ptr + seq)
        if PREFETCH:
            prefetch_partition(
                k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh,
                block_tables_ptr + seq * stride_btb, stride_btn, start, context_len, stride_kb,
                stride_kt, stride_vb, stride_vt, BLOCK_SIZE, PARTITION_SIZE, PREFETCH_LINES,
            )  # fmt: skip
        if start >= tl.maximum(context_len, 1):
            return
        if SCATTER:  # the group's output places (a weight), one address per 128-byte line
            lines = kv_head * GROUP * HEAD_DIM + tl.arange(0, (GROUP_P2 * HEAD_DIM + 31) // 32) * 32
            prefetch_l2((oidx_ptr + lines).to(tl.int64),
                         (lines < (kv_head + 1) * GROUP * HEAD_DIM).to(tl.int32))  # fmt: skip
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    if not PREWAIT:
        context_len = tl.load(context_lens_ptr + seq)
        if start >= tl.maximum(context_len, 1):
            return
    end = tl.minimum(start + PARTITION_SIZE, context_len)

    offs_h = tl.arange(0, BLOCK_H)
    head_mask = offs_h < GROUP
    heads = kv_head * GROUP + offs_h  # [BLOCK_H]
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=head_mask[:, None],
        other=0.0,
    )  # [BLOCK_H, D]
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)

    bt_row = block_tables_ptr + seq * stride_btb
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    for tok0 in range(start, end, BLOCK_N):
        offs_t = tok0 + offs_n  # [BLOCK_N] logical token positions
        tok_mask = offs_t < end
        # The block table is read per token so one iteration may span several cache blocks;
        # int64 because block * stride overflows int32 on large pools.
        blocks = tl.load(bt_row + (offs_t // BLOCK_SIZE) * stride_btn, mask=tok_mask, other=0)
        blocks = blocks.to(tl.int64)
        slots = offs_t % BLOCK_SIZE
        k = tl.load(
            k_head
            + blocks[:, None] * stride_kb
            + slots[:, None] * stride_kt
            + offs_d[None, :] * stride_kd,
            mask=tok_mask[:, None],
            other=0.0,
        )  # [BLOCK_N, D]
        v = tl.load(
            v_head
            + blocks[:, None] * stride_vb
            + slots[:, None] * stride_vt
            + offs_d[None, :] * stride_vd,
            mask=tok_mask[:, None],
            other=0.0,
        )  # [BLOCK_N, D]
        k, v = kv_dot_operands(k, v, ks_ptr, vs_ptr, blocks * stride_sb + kv_head, tok_mask,
                               q.dtype, KV_SCALED, DOT_FP32)  # fmt: skip

        # "ieee" only matters for fp32 operands (no TF32 rounding); 16-bit operands use the
        # tensor cores with an fp32 accumulator either way.
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every iteration has a valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    if DIRECT_OUT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i == 0 only for an empty context
        o_off = out_offsets(heads[:, None], offs_d[None, :], stride_oh, stride_od, oidx_ptr,
                             head_mask[:, None], HEAD_DIM, SCATTER)  # fmt: skip
        tl.store(
            out_ptr + seq * stride_ob + o_off,
            out.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None],
        )
    else:
        row = (seq * num_q_heads + heads) * num_parts + part  # [BLOCK_H] index into [B, Hq, P]
        tl.store(m_ptr + row, m_i, mask=head_mask)
        tl.store(l_ptr + row, l_i, mask=head_mask)
        tl.store(acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=head_mask[:, None])
        if MERGE:
            tl.debug_barrier()  # every thread's partials are written before the counter moves
            cnt = cnt_ptr + seq * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            # The partitions that run (the rest returned above): at least one, within the grid.
            num_used = tl.minimum(tl.maximum(tl.cdiv(context_len, PARTITION_SIZE), 1), num_parts)
            if arrived == num_used - 1:
                _merge_partitions(
                    out_ptr + seq * stride_ob,
                    m_ptr,
                    l_ptr,
                    acc_ptr,
                    (seq * num_q_heads + kv_head * GROUP) * num_parts,
                    kv_head * GROUP,
                    num_used,
                    num_parts,
                    stride_oh,
                    stride_od,
                    oidx_ptr,
                    GROUP,
                    GROUP_P2,
                    HEAD_DIM,
                    BLOCK_P,
                    SCATTER,
                )
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next call


@triton.jit
def _merge_partitions(
    out_row,  # the sequence's output row [Hq, D]
    m_ptr,
    l_ptr,
    acc_ptr,
    row0,  # index of (first head of the group, partition 0) in [B, Hq, P]
    head0,  # the group's first query head
    num_used,  # partitions written
    num_parts,  # P, the partition axis of the workspace
    stride_oh,
    stride_od,
    oidx_ptr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr,
    SCATTER: tl.constexpr,
):
    """Normalised output of GROUP query heads from their partitions' (max, sum, acc): the
    log-sum-exp merge of `_decode_reduce_kernel`, for one kv head's group, by the program that
    wrote the last partition. Loads bypass L1 (.cg): other programs wrote the partials."""
    offs_g = tl.arange(0, GROUP_P2)
    g_mask = offs_g < GROUP
    rows = row0 + offs_g * num_parts  # [G]
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, HEAD_DIM)
    m_run = tl.full([GROUP_P2], float("-inf"), dtype=tl.float32)
    for p0 in range(0, num_used, BLOCK_P):
        mask = g_mask[:, None] & (p0 + offs_p < num_used)[None, :]
        m = tl.load(
            m_ptr + rows[:, None] + p0 + offs_p[None, :],
            mask=mask,
            other=float("-inf"),
            cache_modifier=".cg",
        )
        m_run = tl.maximum(m_run, tl.max(m, axis=1))
    # -inf only for an empty context (or a padding head); 0 keeps exp2(m - m_max) at 0, not NaN.
    m_max = tl.where(m_run > float("-inf"), m_run, 0.0)
    l_sum = tl.zeros([GROUP_P2], dtype=tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], dtype=tl.float32)
    for p0 in range(0, num_used, BLOCK_P):
        mask = g_mask[:, None] & (p0 + offs_p < num_used)[None, :]
        idx = rows[:, None] + p0 + offs_p[None, :]  # [G, BLOCK_P]
        m = tl.load(m_ptr + idx, mask=mask, other=float("-inf"), cache_modifier=".cg")
        w = tl.exp2(m - m_max[:, None])  # 0 where masked
        l_sum += tl.sum(w * tl.load(l_ptr + idx, mask=mask, other=0.0, cache_modifier=".cg"), 1)
        a = tl.load(
            acc_ptr + idx[:, :, None] * HEAD_DIM + offs_d[None, None, :],
            mask=mask[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )  # [G, BLOCK_P, D]
        acc += tl.sum(w[:, :, None] * a, axis=1)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    heads = head0 + offs_g
    o_off = out_offsets(heads[:, None], offs_d[None, :], stride_oh, stride_od, oidx_ptr,
                         g_mask[:, None], HEAD_DIM, SCATTER)  # fmt: skip
    tl.store(out_row + o_off, out.to(out_row.dtype.element_ty), mask=g_mask[:, None])


@triton.jit
def _decode_reduce_kernel(
    out_ptr,  # [B, Hq, D]
    m_ptr,  # [B, Hq, P] f32
    l_ptr,  # [B, Hq, P] f32
    acc_ptr,  # [B, Hq, P, D] f32
    context_lens_ptr,  # [B]
    oidx_ptr,  # int32 [Hq * D] where each output element goes (SCATTER)
    stride_ob,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    NUM_PARTITIONS: tl.constexpr,  # P, the partition axis of the workspace
    BLOCK_P: tl.constexpr,  # partitions merged per iteration
    PDL: tl.constexpr,
    PREWAIT: tl.constexpr = False,  # the context length (copied in before the step) first
    SCATTER: tl.constexpr = False,  # output elements placed by oidx_ptr
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_q_heads = tl.num_programs(1)
    offs_d = tl.arange(0, HEAD_DIM)
    # Where the output goes: out_index is a weight, so it loads before the wait.
    o_off = out_offsets(head, offs_d, stride_oh, stride_od, oidx_ptr, offs_d < HEAD_DIM,
                         HEAD_DIM, SCATTER)  # fmt: skip
    if PREWAIT:
        context_len = tl.load(context_lens_ptr + seq)
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    if not PREWAIT:
        context_len = tl.load(context_lens_ptr + seq)
    # Only the partitions stage 1 wrote: at least one, so an empty context reads zeros, and never
    # past the workspace row, even if a caller's max_context_len was too small.
    num_used = tl.minimum(tl.maximum(tl.cdiv(context_len, PARTITION_SIZE), 1), NUM_PARTITIONS)
    row0 = (seq * num_q_heads + head) * NUM_PARTITIONS
    offs_p = tl.arange(0, BLOCK_P)

    if NUM_PARTITIONS <= BLOCK_P:
        # One tile: max, sums and output loaded together, so the merge waits on one round trip
        # to L2 after the PDL wait rather than two (the same sums as the loops below).
        p_mask = offs_p < num_used
        m = tl.load(m_ptr + row0 + offs_p, mask=p_mask, other=float("-inf"))
        l_p = tl.load(l_ptr + row0 + offs_p, mask=p_mask, other=0.0)
        a = tl.load(
            acc_ptr + (row0 + offs_p)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=p_mask[:, None],
            other=0.0,
        )  # [BLOCK_P, D]
        m_max = tl.max(m, axis=0)
        # -inf only for an empty context; 0 then keeps exp2(m - m_max) at 0 instead of NaN.
        m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
        w = tl.exp2(m - m_max)  # 0 for masked partitions (m = -inf)
        l_sum = tl.sum(w * l_p, axis=0)
        acc = tl.sum(w[:, None] * a, axis=0)
    else:
        m_run = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
        for p0 in range(0, num_used, BLOCK_P):
            p_mask = p0 + offs_p < num_used
            m = tl.load(m_ptr + row0 + p0 + offs_p, mask=p_mask, other=float("-inf"))
            m_run = tl.maximum(m_run, m)
        m_max = tl.max(m_run, axis=0)
        m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # as above

        l_run = tl.zeros([BLOCK_P], dtype=tl.float32)
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for p0 in range(0, num_used, BLOCK_P):
            p_mask = p0 + offs_p < num_used
            m = tl.load(m_ptr + row0 + p0 + offs_p, mask=p_mask, other=float("-inf"))
            w = tl.exp2(m - m_max)  # [BLOCK_P], 0 for masked partitions (m = -inf)
            l_run += w * tl.load(l_ptr + row0 + p0 + offs_p, mask=p_mask, other=0.0)
            a = tl.load(
                acc_ptr + (row0 + p0 + offs_p)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=p_mask[:, None],
                other=0.0,
            )  # [BLOCK_P, D]
            acc += tl.sum(w[:, None] * a, axis=0)
        l_sum = tl.sum(l_run, axis=0)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(out_ptr + seq * stride_ob + o_off, out.to(out_ptr.dtype.element_ty))


def paged_attention_decode_triton(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    context_lens: torch.Tensor,  # [B] int32/int64, the query's own token included
    scale: float,
    partition_size: int = 512,
    max_context_len: int | None = None,
    k_scale: torch.Tensor | None = None,  # [num_blocks, Hkv] float32 for an FP8 / INT8 cache
    v_scale: torch.Tensor | None = None,
    merge_last: bool = True,
    out_index: torch.Tensor | None = None,  # int32 [Hq * D]
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int | None = None,
    prefetch: bool = True,
) -> torch.Tensor:
    """Decode attention over the paged cache with the two-stage Triton kernel; returns [B, Hq, D].

    block_n (context tokens per inner iteration, capped at partition_size), num_warps and
    num_stages (Triton's; None: its default) tile stage 1; prefetch=False skips the L2 prefetch
    of K/V before the PDL wait (`tandem.layers.attention.decode_prefetch` chooses).

    out_index: each sequence's output row (viewed as [Hq * D]) is written permuted, element i
    going to position out_index[i], in the same stores (the input order of an act-order output
    projection: out_index is the inverse of its input permutation).

    max_context_len (a host-side bound, e.g. from the scheduler) sizes the grid and the partial
    workspace; without it the bound is block_tables.shape[1] * block_size, which needs no sync
    and keeps the launch shape fixed for CUDA graphs. It must be >= every context length: tokens
    past it are not attended. A context of length 0 yields zeros.
    """
    b, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, k_dim = k_cache.shape
    if k_cache.shape != v_cache.shape or k_dim != head_dim:
        raise ValueError(f"cache shapes {k_cache.shape}, {v_cache.shape} do not fit q {q.shape}")
    scaled = k_scale is not None
    if scaled != (v_scale is not None):
        raise ValueError("k_scale and v_scale come together")
    if v_cache.dtype != k_cache.dtype or (not scaled and q.dtype != k_cache.dtype):
        raise ValueError(f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if scaled:
        want = (k_cache.shape[0], k_cache.shape[2])
        if k_scale.shape != want or v_scale.shape != want or k_scale.stride() != v_scale.stride():
            raise ValueError(f"k/v scales must be [num_blocks, kv_heads] = {want}, alike")
        if k_scale.stride(1) != 1 or k_scale.dtype != torch.float32:
            raise ValueError("k/v scales must be float32 with a unit head stride")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of 2 >= 16, got {head_dim}")
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of 2 >= 16, got {partition_size}")
    if block_tables.shape[0] != b or context_lens.shape != (b,):
        raise ValueError("block_tables and context_lens need one row per query")
    scatter = out_index is not None
    if scatter and (out_index.shape != (num_q_heads * head_dim,) or out_index.dtype != torch.int32):
        raise ValueError(
            f"out_index must be int32 [{num_q_heads * head_dim}], got {out_index.dtype} "
            f"{tuple(out_index.shape)}"
        )

    out = torch.empty((b, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    group = num_q_heads // num_kv_heads
    max_len = block_tables.shape[1] * block_size if max_context_len is None else max_context_len
    num_parts = max(1, triton.cdiv(max_len, partition_size))
    block_n = min(block_n, partition_size)
    # The Triton interpreter (CPU tensors) stores bf16 as raw uint16 and its tl.dot multiplies
    # the bit patterns (triton-lang/triton#11584), so bf16 is upcast there; on CUDA the native
    # 16-bit dot runs on the tensor cores. fp32 inputs always take the fp32 dot.
    dot_fp32 = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and not q.is_cuda)
    direct = num_parts == 1
    # The last partition to finish merges (one launch), or the second kernel.
    merge = not direct and merge_last
    counters = arrival_counters(q.device, b * num_kv_heads) if merge else out
    if direct:
        m = l_ = acc = out  # unused by the kernel when DIRECT_OUT
    else:
        m = torch.empty((b, num_q_heads, num_parts), dtype=torch.float32, device=q.device)
        l_ = torch.empty_like(m)
        acc = torch.empty(
            (b, num_q_heads, num_parts, head_dim), dtype=torch.float32, device=q.device
        )

    _decode_partition_kernel[(b, num_kv_heads, num_parts)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        m,
        l_,
        acc,
        k_scale if scaled else out,
        v_scale if scaled else out,
        counters,
        out_index if scatter else out,
        scale * LOG2E,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        k_scale.stride(0) if scaled else 0,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        PARTITION_SIZE=partition_size,
        DIRECT_OUT=direct,
        MERGE=merge,
        GROUP_P2=triton.next_power_of_2(group),
        BLOCK_P=min(16, triton.next_power_of_2(num_parts)),
        DOT_FP32=dot_fp32,
        KV_SCALED=scaled,
        PREWAIT=pdl.prewait(q),
        # A row shorter than a line (FP8 at head dim 64: 64 bytes) is still one line to fetch.
        PREFETCH_LINES=triton.next_power_of_2(-(-head_dim * k_cache.element_size() // 128)),
        SCATTER=scatter,
        PREFETCH=prefetch,
        num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
        **pdl.launch_options(q),
    )
    if not direct and not merge:
        _decode_reduce_kernel[(b, num_q_heads)](
            out,
            m,
            l_,
            acc,
            context_lens,
            out_index if scatter else out,
            *out.stride(),
            HEAD_DIM=head_dim,
            PARTITION_SIZE=partition_size,
            NUM_PARTITIONS=num_parts,
            # Up to 32 partitions in one tile (one round trip to L2 after the wait): 2048 tokens
            # of 64 at batch 1, where graphs size the workspace by the longest context.
            BLOCK_P=min(32, triton.next_power_of_2(num_parts)),
            PREWAIT=pdl.prewait(q),
            SCATTER=scatter,
            num_warps=4,
            **pdl.launch_options(q),
        )
    return out


def paged_attention_decode(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    context_lens: torch.Tensor,  # [B] int
    scale: float,
    max_context_len: int | None = None,
    k_scale: torch.Tensor | None = None,  # [num_blocks, Hkv] float32 for an FP8 / INT8 cache
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention: the Triton kernel on CUDA, the torch reference elsewhere.

    On CPU the Triton interpreter would be far too slow for the engine, so the reference runs.
    """
    if q.is_cuda:
        return paged_attention_decode_triton(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            scale,
            max_context_len=max_context_len,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    return paged_attention_decode_ref(
        q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale
    )


# ---- packed multi-token queries: prefill, chunked prefill, speculative verification -----------
