"""Paged attention over the KV cache: prompts (varlen) and decode steps, on CUDA and on a CPU.

`AttentionMetadata` says which packed tokens belong to which sequence and where their KV lives;
`Attention` is one decoder layer's attention, choosing its kernel per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.config import KernelConfig
from tandem.kernels.paged_attention import paged_attention_decode, paged_attention_decode_triton
from tandem.kernels.paged_attention_ref import paged_attention_varlen_ref, varlen_one_ref
from tandem.kernels.paged_attention_varlen import paged_attention_varlen_triton
from tandem.layers.linear import InOrder, Linear
from tandem.layers.step import Step

SDPA_MIN_PROMPT = 1024  # "auto": whole prompts at least this long go to SDPA


def varlen_attention_kind(
    query_start_loc: list[int], context_lens: list[int], backend: str = "auto"
) -> str:
    """ "sdpa" or "triton" for one multi-token attention call on CUDA (`backend`: the
    `prefill_attention` kernel setting). "auto" picks by the H200 measurement in
    bench/results/h200_prefill_attention.json: Triton for batches of prompts (16 x 512: 7.7x
    faster), chunks after a cached prefix (2.9x) and verification (64 x 5 positions: 70x); SDPA's
    flash kernel for long whole prompts alone (1 x 2048: Triton 0.83x, 1 x 8192: 0.48x)."""
    if backend != "auto":
        return backend
    for i, ctx in enumerate(context_lens):
        q_len = query_start_loc[i + 1] - query_start_loc[i]
        if q_len != ctx or q_len < SDPA_MIN_PROMPT:
            return "triton"
    return "sdpa"


@dataclass
class AttentionMetadata:
    """Where each packed token's KV goes and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] long: flat cache slot of every token
    block_tables: torch.Tensor  # [B, max_blocks] long
    context_lens: torch.Tensor  # [B] long: tokens in cache after this step
    context_lens_list: list[int]
    query_start_loc: list[int]  # B + 1 offsets into the packed tokens
    decode_only: bool  # every sequence has exactly one query token
    # query_start_loc and context lens as int32 tensors on the device, for the varlen kernel
    # (None: it copies them itself, queued, once per layer).
    varlen_offsets: tuple[torch.Tensor, torch.Tensor] | None = None


# A decode step on CPU splits its sequences where padding the shorter ones to the longer would at
# least double their work and cost at least this many padded tokens (a group's fixed cost is an
# index_select and an SDPA call per layer).
SPLIT_MIN_TOKENS = 4096


@dataclass
class _DecodeGroup:
    """Sequences of a CPU decode step attended together, padded to the longest of them."""

    rows: torch.Tensor | None  # their rows of the step (None: every row, in order)
    batch: int
    flat_blocks: torch.Tensor  # their block tables, as wide as the longest needs, flattened
    length: int  # the longest context
    mask: torch.Tensor | None  # [batch, 1, 1, length]: None when every context is that long


class CpuDecodeAttention:
    """Decode attention on CPU, the same maths as `paged_attention_decode_ref` but with what
    every layer shares (flat block ids, the padding mask) built once per step, K and V gathered
    by one `index_select`, and no mask at all when every sequence has the same length (batch 1):
    the keys are then sliced to the context instead (transformers' unpadded call, too).

    Sequences are padded to the longest of their group, not of the step: sorted by length, a new
    group starts where the rest are at most half as long as the group's longest and padding them
    would cost at least SPLIT_MIN_TOKENS. One 7,000-token conversation beside 63 short chats so
    costs its own context, instead of making every one of them gather 7,000 tokens a layer.
    """

    def __init__(self, meta: AttentionMetadata, block_size: int) -> None:
        lens = meta.context_lens_list
        order = sorted(range(len(lens)), key=lambda i: -lens[i])
        groups: list[list[int]] = [[]]
        top = lens[order[0]] if order else 0
        for k, i in enumerate(order):
            n = lens[i]
            if groups[-1] and top >= 2 * n and (len(order) - k) * (top - n) >= SPLIT_MIN_TOKENS:
                groups.append([])
                top = n
            groups[-1].append(i)
        split = len(groups) > 1
        self.groups = [self._group(meta, block_size, g if split else None) for g in groups]

    @staticmethod
    def _group(meta: AttentionMetadata, block_size: int, rows: list[int] | None) -> _DecodeGroup:
        lens = meta.context_lens_list if rows is None else [meta.context_lens_list[i] for i in rows]
        length = max(lens)
        width = (length + block_size - 1) // block_size
        tables, ctx, idx = meta.block_tables, meta.context_lens, None
        if rows is not None:
            idx = torch.tensor(rows, dtype=torch.long, device=tables.device)
            tables, ctx = tables.index_select(0, idx), ctx.index_select(0, idx)
        mask = None
        if any(n != length for n in lens):
            pos = torch.arange(length, device=ctx.device)
            mask = (pos[None, :] < ctx[:, None])[:, None, None, :]
        return _DecodeGroup(idx, len(lens), tables[:, :width].reshape(-1), length, mask)

    def __call__(self, q: torch.Tensor, layer_kv: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hq, D], layer_kv [2, num_blocks, block_size, Hkv, D] -> [B, Hq, D]."""
        if len(self.groups) == 1:
            return self._attend(self.groups[0], q, layer_kv, scale)
        out = torch.empty_like(q)
        for g in self.groups:
            out.index_copy_(0, g.rows, self._attend(g, q.index_select(0, g.rows), layer_kv, scale))
        return out

    @staticmethod
    def _attend(g: _DecodeGroup, q: torch.Tensor, layer_kv: torch.Tensor, scale: float):
        hkv, d = layer_kv.shape[-2], layer_kv.shape[-1]
        kv = layer_kv.index_select(1, g.flat_blocks).view(2, g.batch, -1, hkv, d)
        kv = kv[:, :, : g.length].transpose(2, 3)  # [2, B, Hkv, L, D]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), kv[0], kv[1], attn_mask=g.mask, scale=scale, enable_gqa=True
        )
        return out.squeeze(2)


class CpuVarlenAttention:
    """Attention of a step with multi-token queries on CPU (prompt chunks, verification, beside
    decodes): the sequences with one query token, a mixed step's decodes, go together through
    `CpuDecodeAttention`; the others one by one (`varlen_one_ref`). The reference takes every
    sequence one by one, which made a step that joined one prompt to 64 decodes several times
    slower than the decode step beside it."""

    def __init__(self, meta: AttentionMetadata, block_size: int) -> None:
        qsl, lens = meta.query_start_loc, meta.context_lens_list
        ones = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
        self.decode: CpuDecodeAttention | None = None
        if len(ones) > 1:
            idx = torch.tensor(ones, dtype=torch.long, device=meta.block_tables.device)
            longest = max(lens[i] for i in ones)
            sub = AttentionMetadata(
                slot_mapping=meta.slot_mapping,  # not read
                block_tables=meta.block_tables.index_select(0, idx)[
                    :, : (longest + block_size - 1) // block_size
                ],
                context_lens=meta.context_lens.index_select(0, idx),
                context_lens_list=[lens[i] for i in ones],
                query_start_loc=list(range(len(ones) + 1)),
                decode_only=True,
            )
            self.decode = CpuDecodeAttention(sub, block_size)
            self.rows = torch.tensor([qsl[i] for i in ones], dtype=torch.long, device=idx.device)
        batched = set(ones) if self.decode is not None else set()
        self.rest = [i for i in range(len(lens)) if qsl[i + 1] > qsl[i] and i not in batched]
        self.meta = meta

    def __call__(self, q: torch.Tensor, layer_kv: torch.Tensor, scale: float) -> torch.Tensor:
        """q [T, Hq, D], layer_kv [2, num_blocks, block_size, Hkv, D] -> [T, Hq, D]."""
        meta = self.meta
        out = torch.empty_like(q)
        if self.decode is not None:
            out.index_copy_(
                0, self.rows, self.decode(q.index_select(0, self.rows), layer_kv, scale)
            )
        qsl = meta.query_start_loc
        for i in self.rest:
            s, e = qsl[i], qsl[i + 1]
            out[s:e] = varlen_one_ref(
                q[s:e], layer_kv[0], layer_kv[1], meta.block_tables[i],
                meta.context_lens_list[i], scale,
            )  # fmt: skip
        return out


def decode_tiling(batch: int, kv_heads: int, cache_dtype: torch.dtype) -> tuple[int, int]:
    """(context tokens per program, tokens per inner iteration) of the split-K decode kernel for
    a batch of `batch` sequences over a cache of `cache_dtype` (16-bit, FP8 or INT8 codes).

    Small batches split the context finely so that enough programs run to keep the memory system
    busy (batch 1 with 8 KV heads would otherwise use 8 multiprocessors of 132); large batches
    already fill the GPU, and longer partitions cost less in the merge. A 16-bit cache loads 64
    tokens an iteration (16 KiB of K and of V at head dim 128).

    A one-byte cache reads half the bytes a token, so the merge weighs twice as much. FP8 takes
    partition 1024 with 128 tokens an iteration past the smallest batches (H100, 512-token
    contexts: batch 32 1.9x, 64 1.2x, 256 1.3x faster than the 16-bit tiling;
    `bench/results/h100_decode_tiling_fp8.json`). INT8, whose codes are converted and scaled in
    the loop, takes partition 512 with 128 tokens up to 256 batch x kv-head pairs (batch 32
    1.7x) and 32 tokens beyond (batch 64 1.19x, 256 1.24x, 1024 1.32x;
    `bench/results/h100_decode_tiling_int8.json`).
    """
    pairs = batch * kv_heads
    if pairs <= 64:
        return 64, 64
    if cache_dtype == torch.float8_e4m3fn:
        return 1024, 128
    if cache_dtype == torch.int8:
        return 512, 128 if pairs <= 256 else 32
    return (128 if pairs <= 256 else 512), 64


def decode_prefetch(batch: int, kv_heads: int) -> bool:
    """Whether the decode kernel asks L2 for its K/V before its PDL wait (which overlaps the
    kernel before it). Only small batches gain: their K/V fits L2. From batch x kv heads = 64 on,
    the prefetched lines are evicted before they are read, and the kernel alone ran 1.08x
    (batch 8, 1000 tokens) to 1.49x (batch 512, 512 tokens) faster without it on an H100
    (bench/decode_attention.py --sweep)."""
    return batch * kv_heads < 64


class Attention:
    """Layer `layer`'s attention of q [T, Hq, D] over its KV cache -> [T, Hq * D]. `consumer`
    (o_proj) takes part in the choice of the decode kernel's merge."""

    def __init__(
        self, layer: int, scale: float, kv_heads: int, consumer: Linear, kernels: KernelConfig
    ) -> None:
        self.layer = layer
        self.scale = scale
        self.kv_heads = kv_heads
        self.consumer = consumer
        self.kernels = kernels

    def __call__(self, q: torch.Tensor, step: Step) -> torch.Tensor | InOrder:
        """On CUDA a decode step stores its output in an act-order o_proj's input order."""
        kv, meta = step.kv, step.meta
        t = q.shape[0]
        k_cache, v_cache = kv.layer(self.layer)
        k_scale, v_scale = kv.layer_scales(self.layer)
        if step.cuda:
            attn = self._cuda(q, k_cache, v_cache, k_scale, v_scale, step)
            if meta.decode_only and self.consumer.input_places is not None:
                return InOrder(attn.reshape(t, -1))  # stored so by the decode kernel
        elif meta.decode_only and k_scale is None:
            if step.cpu_decode is None:
                step.cpu_decode = CpuDecodeAttention(meta, kv.block_size)
            attn = step.cpu_decode(q, kv.data[self.layer], self.scale)
        elif meta.decode_only:
            attn = paged_attention_decode(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale,
                k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        elif k_scale is None:
            if step.cpu_varlen is None:
                step.cpu_varlen = CpuVarlenAttention(meta, kv.block_size)
            attn = step.cpu_varlen(q, kv.data[self.layer], self.scale)
        else:
            attn = paged_attention_varlen_ref(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                meta.context_lens_list, self.scale, k_scale, v_scale,
            )  # fmt: skip
        return attn.reshape(t, -1)

    def _cuda(self, q, k_cache, v_cache, k_scale, v_scale, step: Step) -> torch.Tensor:
        meta = step.meta
        if meta.decode_only:
            partition, block_n = decode_tiling(q.shape[0], self.kv_heads, k_cache.dtype)
            return paged_attention_decode_triton(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                self.scale,
                partition_size=partition,
                block_n=block_n,
                prefetch=decode_prefetch(q.shape[0], self.kv_heads),
                k_scale=k_scale,
                v_scale=v_scale,
                # One row of INT4 weights: the partitions merge faster in a kernel of their
                # own (H200, Llama-3-8B shape: 2.03 against 2.14 ms a step); of bf16 weights
                # by the last partition (4.54 against 4.59).
                merge_last=not (step.one_row and self.consumer.quantized),
                out_index=self.consumer.input_places,
            )
        kind = varlen_attention_kind(
            meta.query_start_loc, meta.context_lens_list, self.kernels.prefill_attention
        )
        if kind == "triton":
            return paged_attention_varlen_triton(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                meta.context_lens_list, self.scale, k_scale, v_scale,
                device_offsets=meta.varlen_offsets,
            )  # fmt: skip
        return paged_attention_varlen_ref(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
            meta.context_lens_list, self.scale, k_scale, v_scale,
        )  # fmt: skip
