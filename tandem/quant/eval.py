"""Perplexity of a LlamaModel over real text, through the paged KV cache (so a quantized KV
cache is part of what is measured)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tandem.kv.cache import KVCache
from tandem.model.llama import AttentionMetadata, LlamaModel


def _meta(
    slots: list[int], tables: list[list[int]], ctx: int, q_len: int, dev
) -> AttentionMetadata:
    """Sequences of equal length, each with q_len new tokens and ctx tokens cached after them."""
    b = len(tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
        block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
        context_lens=torch.full((b,), ctx, dtype=torch.long, device=dev),
        context_lens_list=[ctx] * b,
        query_start_loc=[i * q_len for i in range(b + 1)],
        decode_only=q_len == 1,
    )


@torch.inference_mode()
def perplexity(
    model: LlamaModel,
    token_ids: list[int],
    window: int = 512,
    kv_dtype: torch.dtype | None = None,
    block_size: int = 16,
    decode_tokens: int = 0,
    batch: int = 1,
) -> dict[str, float]:
    """Mean next-token NLL over non-overlapping windows of `token_ids`, and its exp; also each
    window's mean NLL ("window_nll", in order), for paired comparisons between models.

    Each window is a fresh sequence. Its first `window - decode_tokens` tokens run as one
    prefill; the last `decode_tokens` are fed one at a time (decode steps, so an FP8/INT8 cache
    is written token by token and its per-block scales grow as they do in serving). `batch`
    windows run together as a batch of sequences (one prefill forward, then one decode step for
    all of them), as the engine batches requests: the same sums but for the rounding of batched
    matrix products, and far fewer forwards where they are launch-bound (a GPU).
    """
    if batch < 1:
        raise ValueError(f"perplexity batch must be >= 1, got {batch!r}")
    cfg = model.cfg
    dev = model.device
    nb = (window + block_size - 1) // block_size
    starts = list(range(0, len(token_ids) - window + 1, window))
    if not starts:
        raise ValueError(f"need at least {window} tokens, got {len(token_ids)}")
    kv = KVCache.allocate(
        cfg.num_layers, nb * min(batch, len(starts)), block_size, cfg.num_kv_heads, cfg.head_dim,
        kv_dtype or model.dtype, dev,
    )  # fmt: skip
    n_pre = window - decode_tokens
    chunks = [(0, n_pre)] + [(p, p + 1) for p in range(n_pre, window)]
    window_nll = []
    for first in range(0, len(starts), batch):
        group = starts[first : first + batch]
        ids = torch.tensor([token_ids[s : s + window] for s in group], dtype=torch.long)
        tables = [list(range(i * nb, (i + 1) * nb)) for i in range(len(group))]
        sums = torch.zeros(len(group), dtype=torch.float64, device=dev)  # read once per batch
        for a, b in chunks:
            used = [t[: (b + block_size - 1) // block_size] for t in tables]
            slots = [t[p // block_size] * block_size + p % block_size for t in tables
                     for p in range(a, b)]  # fmt: skip
            meta = _meta(slots, used, b, b - a, dev)
            inp = ids[:, a:b].reshape(-1).to(dev)
            pos = torch.arange(a, b, dtype=torch.long, device=dev).repeat(len(group))
            lg = model.logits(model.forward(inp, pos, kv, meta)).view(len(group), b - a, -1)
            # Positions a .. b-1 predict tokens a+1 .. b (the window's last predicts nothing).
            e = min(b, window - 1)
            if e > a:
                target = ids[:, a + 1 : e + 1].to(dev)
                nll = F.cross_entropy(
                    lg[:, : e - a].float().flatten(0, 1), target.flatten(), reduction="none"
                )
                sums += nll.view_as(target).sum(1).double()
        window_nll += (sums / (window - 1)).tolist()
    nll = sum(window_nll) / len(window_nll)  # windows of equal length
    return {
        "nll": nll,
        "ppl": math.exp(nll),
        "tokens": len(window_nll) * (window - 1),
        "window_nll": window_nll,
    }
