"""Perplexity of a LlamaModel over real text, through the paged KV cache (so a quantized KV
cache is part of what is measured)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tandem.kv.cache import KVCache
from tandem.model.llama import AttentionMetadata, LlamaModel


def _meta(slots: list[int], table: list[int], ctx: int, q_len: int, dev) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
        block_tables=torch.tensor([table], dtype=torch.long, device=dev),
        context_lens=torch.tensor([ctx], dtype=torch.long, device=dev),
        context_lens_list=[ctx],
        query_start_loc=[0, q_len],
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
) -> dict[str, float]:
    """Mean next-token NLL over non-overlapping windows of `token_ids`, and its exp; also each
    window's mean NLL ("window_nll", in order), for paired comparisons between models.

    Each window is a fresh sequence. Its first `window - decode_tokens` tokens run as one
    prefill; the last `decode_tokens` are fed one at a time (decode steps, so an FP8/INT8 cache
    is written token by token and its per-block scales grow as they do in serving).
    """
    cfg = model.cfg
    dev = model.device
    nb = (window + block_size - 1) // block_size
    kv = KVCache.allocate(
        cfg.num_layers, nb, block_size, cfg.num_kv_heads, cfg.head_dim,
        kv_dtype or model.dtype, dev,
    )  # fmt: skip
    table = list(range(nb))
    nll = 0.0
    count = 0
    window_nll = []
    for start in range(0, len(token_ids) - window + 1, window):
        ids = token_ids[start : start + window]
        n_pre = window - decode_tokens
        chunks = [(0, n_pre)] + [(p, p + 1) for p in range(n_pre, window)]
        logits = []
        for a, b in chunks:
            meta = _meta(
                list(range(a, b)), table[: (b + block_size - 1) // block_size], b, b - a, dev
            )
            inp = torch.tensor(ids[a:b], dtype=torch.long, device=dev)
            pos = torch.arange(a, b, dtype=torch.long, device=dev)
            logits.append(model.logits(model.forward(inp, pos, kv, meta)))
        lg = torch.cat(logits)[:-1]
        target = torch.tensor(ids[1:], dtype=torch.long, device=dev)
        w_nll = F.cross_entropy(lg.float(), target, reduction="sum").item()
        window_nll.append(w_nll / (len(ids) - 1))
        nll += w_nll
        count += len(ids) - 1
    if count == 0:
        raise ValueError(f"need at least {window} tokens, got {len(token_ids)}")
    return {
        "nll": nll / count,
        "ppl": math.exp(nll / count),
        "tokens": count,
        "window_nll": window_nll,
    }
