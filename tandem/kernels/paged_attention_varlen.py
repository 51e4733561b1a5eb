"""Causal attention of packed multi-token queries over the paged KV cache in one Triton launch:
prefill, a prompt chunk after a cached prefix, speculative verification. The torch reference is
`paged_attention_ref.paged_attention_varlen_ref`.

The cache layout and FP8 / INT8 scales are those of `tandem.kernels.paged_attention`; the
kernel dequantizes as it reads.
"""

from __future__ import annotations

import torch

from tandem.host_copy import device_tensor
from tandem.kernels._triton import tl, triton
from tandem.kernels.attention_parts import LOG2E, kv_dot_operands


@triton.jit
def _varlen_kernel(
    q_ptr,  # [T, Hq, D] packed query tokens
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,
    out_ptr,  # [T, Hq, D]
    block_tables_ptr,  # [B, max_blocks]
    q_start_ptr,  # [B + 1] int32: offsets of each sequence's queries in q
    context_lens_ptr,  # [B] int32: cached tokens per sequence, its queries included (last)
    ks_ptr,  # [num_blocks, Hkv] f32 block scales of k: read only when KV_SCALED
    vs_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_btb,
    stride_sb,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of 2
    BLOCK_M: tl.constexpr,  # query tokens per program; BLOCK_M * GROUP_P rows enter tl.dot
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # cached tokens per inner iteration
    DOT_FP32: tl.constexpr,
    KV_SCALED: tl.constexpr,
):
    """One program per (sequence, tile of BLOCK_M queries, kv head): the tile's queries of every
    head of the GQA group are one [BLOCK_M * GROUP, D] matrix, so each K/V tile is read once per
    group; online softmax over the cached tokens up to the tile's last causal position."""
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q0 = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q0
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)

    ROWS: tl.constexpr = BLOCK_M * GROUP_P
    r = tl.arange(0, ROWS)
    qi = tile * BLOCK_M + r // GROUP_P  # query index within the sequence
    hg = r % GROUP_P
    head = kv_head * GROUP + hg
    row_ok = (qi < q_len) & (hg < GROUP)
    qpos = ctx - q_len + qi  # the query's position: it sees cache positions 0 ..= qpos
    tok = (q0 + qi).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    last = tl.minimum(ctx - q_len + tl.minimum((tile + 1) * BLOCK_M, q_len), ctx)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_btb
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(0, last, BLOCK_N):
        n = n0 + offs_n
        n_ok = n < last
        blocks = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slots = n % BLOCK_SIZE
        k = tl.load(
            k_ptr
            + blocks[:, None] * stride_kb
            + slots[:, None] * stride_kt
            + kv_head * stride_kh
            + offs_d[None, :],
            mask=n_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            v_ptr
            + blocks[:, None] * stride_vb
            + slots[:, None] * stride_vt
            + kv_head * stride_vh
            + offs_d[None, :],
            mask=n_ok[:, None],
            other=0.0,
        )
        k, v = kv_dot_operands(k, v, ks_ptr, vs_ptr, blocks * stride_sb + kv_head, n_ok, q.dtype,
                               KV_SCALED, DOT_FP32)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [ROWS, BLOCK_N]
        visible = (n[None, :] <= qpos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        p = tl.where(visible, p, 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def paged_attention_varlen_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    query_start_loc: list[int],  # B + 1 offsets into q
    context_lens: list[int],  # tokens in cache per sequence, its queries included (last)
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    device_offsets: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`paged_attention_varlen_ref` in one launch: causal attention of packed multi-token queries
    over the paged cache (a whole prompt, a prompt chunk after a cached prefix, or the k + 1
    positions of a speculative verification).

    `device_offsets`: `query_start_loc` and `context_lens` already on q's device as int32
    tensors (the engine sends them once per step with its other inputs); without them they
    are copied here, queued behind the work in flight (`tandem.host_copy`)."""
    t, hq, d = q.shape
    _, block_size, hkv, d_k = k_cache.shape
    b = len(context_lens)
    if d_k != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"q head_dim {d} does not match the cache {tuple(k_cache.shape)}")
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of 2 >= 16, got {d}")
    if len(query_start_loc) != b + 1 or query_start_loc[-1] != t:
        raise ValueError("query_start_loc needs B + 1 offsets ending at the number of queries")
    if block_tables.shape[0] < b:
        raise ValueError("block_tables needs one row per sequence")
    for i, ctx in enumerate(context_lens):
        if query_start_loc[i + 1] - query_start_loc[i] > ctx:
            raise ValueError(f"sequence {i}: more queries than cached tokens ({ctx})")
    scaled = k_scale is not None
    if scaled and (v_scale is None or k_scale.stride(1) != 1 or k_scale.dtype != torch.float32):
        raise ValueError("k/v scales must both be float32 [num_blocks, kv_heads], unit head stride")
    out = torch.empty_like(q)
    if t == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the cache needs a unit head_dim stride")
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    group = hq // hkv
    group_p = triton.next_power_of_2(group)
    if block_m is None:
        # BLOCK_M * GROUP_P rows per program: 64 fills a tensor-core tile without spilling.
        block_m = max(64 // group_p, 1) if q.is_cuda else max(16 // group_p, 1)
    block_m = triton.next_power_of_2(block_m)
    if block_m * group_p < 16:  # tl.dot's smallest M
        block_m = 16 // group_p
    if block_n is None:
        block_n = 64 if q.is_cuda else 16
    max_q = max(query_start_loc[i + 1] - query_start_loc[i] for i in range(b))
    dev = q.device
    if device_offsets is None:
        both = device_tensor([*query_start_loc, *context_lens], torch.int32, dev)
        device_offsets = both[: b + 1], both[b + 1 :]
    qs, cl = device_offsets
    dot_fp32 = q.dtype == torch.float32 or not q.is_cuda
    ks = k_scale if scaled else cl
    vs = v_scale if scaled else cl
    _varlen_kernel[(b, triton.cdiv(max_q, block_m), hkv)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        qs,
        cl,
        ks,
        vs,
        scale * LOG2E,
        *q.stride()[:2],
        *k_cache.stride()[:3],  # block, slot, head (the head dim is contiguous)
        *v_cache.stride()[:3],
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_scale.stride(0) if scaled else 0,
        GROUP=group,
        GROUP_P=group_p,
        BLOCK_M=block_m,
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        DOT_FP32=dot_fp32,
        KV_SCALED=scaled,
        num_warps=4,
    )
    return out
