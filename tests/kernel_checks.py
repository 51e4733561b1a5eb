"""What the CPU (Triton interpreter) and GPU (compiled) kernel tests share: float64 references
written from the definitions (a per-token gather, no code shared with tandem), random paged
caches, and the import of a kernel module for the GPU tests.

Imports torch only: importing this module never imports triton, so a GPU test module that uses
it can be collected on a CPU host before tests/test_kernels.py selects the interpreter.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch


def compiled_kernel(name: str) -> ModuleType:
    """`tandem.kernels.<name>` for a GPU test, which needs compiled kernels: skip when
    TRITON_INTERPRET is set (the interpreter is chosen when triton is imported)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: run `pytest tests/gpu` without it")
    return importlib.import_module(f"tandem.kernels.{name}")


def attention_decode_f64(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Softmax(q k^T * scale) v per sequence in float64, for one query token at the end of its
    context, gathering the cache token by token."""
    b, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    kv_of_head = torch.arange(hq, device=q.device) // (hq // hkv)  # query head -> its kv head
    out = torch.zeros(b, hq, d, dtype=torch.float64, device=q.device)
    for i in range(b):
        n = context_lens[i]
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        phys = block_tables[i, pos // block_size].long()
        k = k_cache[phys, pos % block_size].double()[:, kv_of_head]  # [n, Hq, D]
        v = v_cache[phys, pos % block_size].double()[:, kv_of_head]
        s = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)
    return out


def attention_varlen_f64(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    context_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed queries (the last q_len positions of each context), float64."""
    t, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    kv_of_head = torch.arange(hq, device=q.device) // (hq // hkv)
    out = torch.zeros(t, hq, d, dtype=torch.float64, device=q.device)
    for i, n in enumerate(context_lens):
        s0, e0 = query_start_loc[i], query_start_loc[i + 1]
        if e0 == s0:
            continue
        pos = torch.arange(n, device=q.device)
        phys = block_tables[i, pos // block_size].long()
        k = k_cache[phys, pos % block_size].double()[:, kv_of_head]  # [n, Hq, D]
        v = v_cache[phys, pos % block_size].double()[:, kv_of_head]
        s = torch.einsum("qhd,nhd->hqn", q[s0:e0].double(), k) * scale
        qpos = torch.arange(n - (e0 - s0), n, device=q.device)
        s = s.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
        out[s0:e0] = torch.einsum("hqn,nhd->qhd", torch.softmax(s, dim=-1), v)
    return out


def make_paged(
    context_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    extra_table_cols: int = 0,
    seed: int = 0,
    spare_blocks: int = 5,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, a shuffled cache pool and block tables; padding entries point at stale blocks.

    Returns (q [B, Hq, D], k_cache, v_cache, block_tables [B, max_blocks] int32, context lens
    int32). The caches are a slice of a [layers, 2, ...] pool, as the workers lay it out, with
    `spare_blocks` blocks nobody owns; q is a strided view (one slice of a fused qkv output).
    """
    g = torch.Generator(device=device).manual_seed(seed)
    b = len(context_lens)
    need = [(n + block_size - 1) // block_size for n in context_lens]
    max_blocks = max(max(need), 1) + extra_table_cols
    num_blocks = sum(need) + spare_blocks
    shape = (2, 2, num_blocks, block_size, num_kv_heads, head_dim)
    pool = torch.randn(shape, generator=g, device=device).to(dtype)
    perm = torch.randperm(num_blocks, generator=g, device=device)
    table = torch.randint(
        0, num_blocks, (b, max_blocks), generator=g, device=device, dtype=torch.int32
    )
    used = 0
    for i, nb in enumerate(need):
        table[i, :nb] = perm[used : used + nb].int()
        used += nb
    qkv = torch.randn(b, 2 * num_q_heads, head_dim, generator=g, device=device).to(dtype)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return qkv[:, :num_q_heads], pool[1, 0], pool[1, 1], table, ctx
