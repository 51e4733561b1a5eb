"""Attention over the paged KV cache in torch: the references the Triton kernels are checked
against, and what runs on a CPU.

The cache layout and FP8 / INT8 scales are those of `tandem.kernels.paged_attention`; every
path here dequantizes as it reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather(
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    # [B, nb] -> [B, kv_heads, nb * block_size, head_dim]
    b, nb = block_tables.shape
    # index_select rather than cache[block_tables]: the same copy, but advanced indexing is far
    # slower on CPU (milliseconds per call when the cores are shared with other processes).
    x = cache.index_select(0, block_tables.reshape(-1)).view(b, nb, *cache.shape[1:])
    if scale is not None:
        x = (x.float() * scale[block_tables][:, :, None, :, None]).to(dtype)
    return x.reshape(b, nb * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def paged_attention_decode_ref(
    q: torch.Tensor,  # [B, Hq, D]: one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    context_lens: torch.Tensor,  # [B] int: tokens in cache, the query's own included
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, Hkv] float32 for an FP8 / INT8 cache
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per sequence attends to its whole cached context (grouped-query)."""
    k = _gather(k_cache, block_tables, k_scale, q.dtype)
    v = _gather(v_cache, block_tables, v_scale, q.dtype)
    length = k.shape[2]
    mask = torch.arange(length, device=q.device)[None, :] < context_lens[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def paged_attention_varlen_ref(
    q: torch.Tensor,  # [T, Hq, D]: packed query tokens of all sequences
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    query_start_loc: list[int],  # B + 1 offsets into q
    context_lens: list[int],  # tokens in cache per sequence, the queries included (they are last)
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, Hkv] float32 for an FP8 / INT8 cache
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for packed multi-token queries (prefill, chunked prefill, verification).

    Query token i of a sequence with q_len queries and context length L sits at position
    L - q_len + i and sees cache positions 0 ..= that position.
    """
    out = torch.empty_like(q)
    for i, ctx in enumerate(context_lens):
        s, e = query_start_loc[i], query_start_loc[i + 1]
        if e > s:
            out[s:e] = varlen_one_ref(
                q[s:e], k_cache, v_cache, block_tables[i], ctx, scale, k_scale, v_scale
            )
    return out


def varlen_one_ref(
    q: torch.Tensor,  # [q_len, Hq, D]: the sequence's query tokens, the last of its context
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,  # [max_blocks]: the sequence's block table
    ctx: int,  # tokens in cache, the queries included
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention_varlen_ref` for one sequence -> [q_len, Hq, D]."""
    q_len = q.shape[0]
    nb = (ctx + k_cache.shape[1] - 1) // k_cache.shape[1]
    table = table[None, :nb]
    k = _gather(k_cache, table, k_scale, q.dtype)[:, :, :ctx]  # [1, Hkv, ctx, D]
    v = _gather(v_cache, table, v_scale, q.dtype)[:, :, :ctx]
    qi = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
    if q_len == ctx:
        o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        qpos = torch.arange(ctx - q_len, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]  # [q_len, ctx]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
