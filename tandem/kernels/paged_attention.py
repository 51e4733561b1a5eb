"""Attention over the paged KV cache: torch references (used on CPU) and the call sites the runner uses.

Cache layout per layer: k_cache, v_cache are [num_blocks, block_size, kv_heads, head_dim].
A sequence's logical block i lives in pool block block_tables[seq, i].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    # [B, nb] -> [B, kv_heads, nb * block_size, head_dim]
    b, nb = block_tables.shape
    x = cache[block_tables]  # [B, nb, bs, Hkv, D]
    return x.reshape(b, nb * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def paged_attention_decode_ref(
    q: torch.Tensor,  # [B, Hq, D]: one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    context_lens: torch.Tensor,  # [B] int: tokens in cache, the query's own included
    scale: float,
) -> torch.Tensor:
    """One decode token per sequence attends to its whole cached context (grouped-query)."""
    k = _gather(k_cache, block_tables)
    v = _gather(v_cache, block_tables)
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
) -> torch.Tensor:
    """Causal attention for packed multi-token queries (prefill, chunked prefill, verification).

    Query token i of a sequence with q_len queries and context length L sits at position
    L - q_len + i and sees cache positions 0 ..= that position.
    """
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    for i, ctx in enumerate(context_lens):
        s, e = query_start_loc[i], query_start_loc[i + 1]
        q_len = e - s
        if q_len == 0:
            continue
        nb = (ctx + bs - 1) // bs
        table = block_tables[i : i + 1, :nb]
        k = _gather(k_cache, table)[:, :, :ctx]  # [1, Hkv, ctx, D]
        v = _gather(v_cache, table)[:, :, :ctx]
        qi = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        if q_len == ctx:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            qpos = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]  # [q_len, ctx]
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1)
    return out


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Decode attention: the Triton kernel on CUDA, the torch reference elsewhere."""
    return paged_attention_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale)
