"""The Llama-family transformer (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Plain tensors in, tensors out. Activations are packed: T tokens of many sequences in one
[T, hidden] tensor; `AttentionMetadata` says which tokens belong to which sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.config import KernelConfig, kernel_config
from tandem.kernels.activation import silu_and_mul, silu_and_mul_gemv_x
from tandem.kernels.embedding import embed_dequant_triton
from tandem.kernels.gemv import linear_rows
from tandem.kernels.paged_attention import paged_attention_decode, paged_attention_decode_triton
from tandem.kernels.paged_attention_ref import paged_attention_varlen_ref
from tandem.kernels.paged_attention_varlen import paged_attention_varlen_triton
from tandem.kernels.rmsnorm import rmsnorm, rmsnorm_gemv_x
from tandem.kernels.rotary import rope_cache_write, rope_cache_write_scaled
from tandem.kernels.w4a16 import (
    GemvX,
    gemv_atomic_enabled,
    gemv_x_group,
    h2_weight,
    n_major,
    w4a16_matmul,
)
from tandem.kv.cache import KVCache
from tandem.layers.cpu_linear import cpu_linear, cpu_logits, pack_cpu_weight
from tandem.model.config import ModelConfig
from tandem.model.rotary import apply_rotary, cos_sin_table
from tandem.quant.format import QuantizedWeight, cat_rows, permute_rows
from tandem.quant.linear import linear

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


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    # Linear weights are float tensors or per-group integer QuantizedWeights (tandem.quant).
    qkv: torch.Tensor | QuantizedWeight  # [(Hq + 2 Hkv) * D, H]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor | QuantizedWeight  # [H, Hq * D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor | QuantizedWeight  # [2 I, H]
    down: torch.Tensor | QuantizedWeight  # [H, I]
    # Act-order checkpoints (`tandem.quant.external`): a layer whose weight columns are stored
    # grouped reads its input gathered by this permutation [K]. down_proj's is folded into the
    # rows of gate/up at load, so it has none.
    qkv_perm: torch.Tensor | None = None
    o_perm: torch.Tensor | None = None
    gate_up_perm: torch.Tensor | None = None


def _gather(x: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] with its last dimension read in `perm` order (an act-order layer's input)."""
    return x if perm is None else x.index_select(-1, perm)


def _input_perm(weights: dict, names: list[str], device: torch.device) -> torch.Tensor | None:
    """The input permutation shared by the layers `names` fused into one (None: no act-order)."""
    perms = [weights.get(n + ".input_perm") for n in names]
    if all(p is None for p in perms):
        return None
    if any(p is None or not torch.equal(p, perms[0]) for p in perms):
        raise ValueError(
            f"{', '.join(names)} share their input but not their act-order input permutation "
            "(g_idx); Tandem fuses them into one layer and needs one order"
        )
    return perms[0].to(device=device, dtype=torch.long)


def _rows(w: torch.Tensor | QuantizedWeight, index: torch.Tensor):
    """`w` with its output rows reordered (`index[i]` is the source of row i)."""
    return permute_rows(w, index) if isinstance(w, QuantizedWeight) else w[index]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with transformers' cast order (normalize in float32, cast, then scale)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class _CpuDecodeAttention:
    """Decode attention on CPU, the same maths as `paged_attention_decode_ref` but with what
    every layer shares (flat block ids, the padding mask) built once per step, K and V gathered
    by one `index_select`, and no mask at all when every sequence has the same length (batch 1):
    the keys are then sliced to the context instead (transformers' unpadded call, too).
    """

    def __init__(self, meta: AttentionMetadata, block_size: int) -> None:
        b, nb = meta.block_tables.shape
        self.batch = b
        self.flat_blocks = meta.block_tables.reshape(-1)
        lens = meta.context_lens_list
        self.mask: torch.Tensor | None = None
        if all(n == lens[0] for n in lens):
            self.length = lens[0]
        else:
            self.length = nb * block_size
            pos = torch.arange(self.length, device=meta.context_lens.device)
            self.mask = (pos[None, :] < meta.context_lens[:, None])[:, None, None, :]

    def __call__(self, q: torch.Tensor, layer_kv: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hq, D], layer_kv [2, num_blocks, block_size, Hkv, D] -> [B, Hq, D]."""
        hkv, d = layer_kv.shape[-2], layer_kv.shape[-1]
        kv = layer_kv.index_select(1, self.flat_blocks).view(2, self.batch, -1, hkv, d)
        kv = kv[:, :, : self.length].transpose(2, 3)  # [2, B, Hkv, L, D]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), kv[0], kv[1], attn_mask=self.mask, scale=scale, enable_gqa=True
        )
        return out.squeeze(2)


def decode_partition_size(batch: int, kv_heads: int) -> int:
    """Context tokens per program of the split-K decode kernel for a batch of `batch` sequences.

    Small batches split the context finely so that enough programs run to keep the memory system
    busy (batch 1 with 8 KV heads would otherwise use 8 multiprocessors of 132); large batches
    already fill the GPU, and longer partitions cost less in the merge.
    """
    pairs = batch * kv_heads
    if pairs <= 64:
        return 64
    if pairs <= 256:
        return 128
    return 512


def _cuda_linear(
    x: torch.Tensor,
    w: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None = None,
    xq: GemvX | None = None,
    accumulate: torch.Tensor | None = None,
) -> torch.Tensor:
    """`linear` on CUDA: a single row times a float weight goes through the Triton GEMV."""
    if isinstance(w, torch.Tensor):
        return linear_rows(x, w, bias)
    return linear(x, w, bias, xq, accumulate)


def _norm(h, weight, eps, residual, consumer, one_row: bool, acc_input: bool = False):
    """Residual add + RMSNorm, also writing the GemvX form its consumer's INT4 GEMV reads
    when there is one (a single row): (out, new_residual, GemvX or None). `acc_input`: h is a
    GEMV's float32 accumulator, rounded and zeroed by the norm."""
    group = gemv_x_group(consumer, residual.dtype if acc_input else h.dtype) if one_row else None
    if group is None:
        return (*rmsnorm(h, weight, eps, residual, acc_input), None)
    return rmsnorm_gemv_x(h, weight, eps, residual, group, acc_input)


def _silu_mul(gu, consumer, one_row: bool, acc_dtype: torch.dtype | None = None):
    """silu(gate) * up, with the GemvX form for its consumer as `_norm` (`acc_dtype`: gu is a
    GEMV's float32 accumulator, rounded to it and zeroed; only with the GemvX form)."""
    group = gemv_x_group(consumer, acc_dtype or gu.dtype) if one_row else None
    if group is None:
        return silu_and_mul(gu), None
    return silu_and_mul_gemv_x(gu, group, acc_dtype)


class LlamaModel:
    """Weights plus the forward pass; no KV allocation, no scheduling."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
        kernels: KernelConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.kernels = kernels or kernel_config()
        self.dtype = dtype
        self.device = torch.device(device)

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return weights[name].to(device=self.device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")
        if self.embed.shape != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"model.embed_tokens.weight has shape {tuple(self.embed.shape)}, "
                f"config says ({cfg.vocab_size}, {cfg.hidden_size})"
            )
        self.norm = w("model.norm.weight")
        if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed
        else:
            self.lm_head = w("lm_head.weight")
        perms = {k.removesuffix(".input_perm") for k in weights if k.endswith(".input_perm")}
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            bias = None
            if cfg.attention_bias and p + "self_attn.q_proj.bias" in weights:
                bias = torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            qkv = [p + f"self_attn.{n}_proj" for n in "qkv"]
            mlp = [p + "mlp.gate_proj", p + "mlp.up_proj"]
            gate, up = (w(n + ".weight") for n in mlp)
            down_perm = _input_perm(weights, [p + "mlp.down_proj"], self.device)
            if down_perm is not None:  # silu(gate) * up is elementwise: permute its producers
                gate, up = _rows(gate, down_perm), _rows(up, down_perm)
            perms -= {*qkv, p + "self_attn.o_proj", *mlp, p + "mlp.down_proj"}
            self.layers.append(
                LayerWeights(
                    input_norm=w(p + "input_layernorm.weight"),
                    qkv=cat_rows([w(n + ".weight") for n in qkv]),
                    qkv_bias=bias,
                    o=w(p + "self_attn.o_proj.weight"),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=cat_rows([gate, up]),
                    down=w(p + "mlp.down_proj.weight"),
                    qkv_perm=_input_perm(weights, qkv, self.device),
                    o_perm=_input_perm(weights, [p + "self_attn.o_proj"], self.device),
                    gate_up_perm=_input_perm(weights, mlp, self.device),
                )
            )
        if perms:
            raise ValueError(
                f"act-order (g_idx) is supported for the decoder layers' linear layers, not for "
                f"{', '.join(sorted(perms))}"
            )
        if self.device.type == "cuda":
            # INT4 weights stored N-major: the layout the single-row W4A16 kernel reads fastest.
            for lw in self.layers:
                for f in ("qkv", "o", "gate_up", "down"):
                    wq = getattr(lw, f)
                    if isinstance(wq, QuantizedWeight) and wq.bits == 4:
                        setattr(lw, f, n_major(wq))
            if isinstance(self.lm_head, QuantizedWeight) and self.lm_head.bits == 4:
                tied = self.lm_head is self.embed
                self.lm_head = n_major(self.lm_head)  # the lookup gathers rows of either layout
                if tied:
                    self.embed = self.lm_head
        # CPU: linear weights packed for oneDNN (`cpu_linear`), the LM head too (a tied one keeps
        # the plain embedding beside its packed copy, for the lookup).
        self.cpu_lm_head = self.lm_head
        if self.device.type == "cpu":
            for lw in self.layers:
                for f in ("qkv", "o", "gate_up", "down"):
                    setattr(lw, f, pack_cpu_weight(getattr(lw, f)))
            self.cpu_lm_head = pack_cpu_weight(self.lm_head)
        self.max_positions = max_positions or cfg.max_position_embeddings
        self.cos_sin = cos_sin_table(cfg, self.max_positions, self.device)
        self.scale = cfg.head_dim**-0.5
        # One-row decode steps: each INT4 GEMV adds into a float32 row of its own (see
        # `w4a16.gemv_accumulates`) that its reader rounds and zeroes again, so they are zero
        # between steps; allocated here, outside any CUDA graph capture.
        self._gemv_acc: dict[str, list[torch.Tensor | None]] = {}
        if self.device.type == "cuda" and dtype == torch.bfloat16:
            for f in ("qkv", "o", "gate_up", "down"):
                rows = [
                    torch.zeros(1, wq.out_features, dtype=torch.float32, device=self.device)
                    if isinstance(wq, QuantizedWeight) and h2_weight(wq, wq.in_features)
                    else None
                    for wq in (getattr(lw, f) for lw in self.layers)
                ]
                if any(r is not None for r in rows):
                    self._gemv_acc[f] = rows

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run every layer over the packed tokens, writing their KV; returns final hidden [T, H]."""
        if self.device.type == "cuda":
            try:
                return self._forward_cuda(input_ids, positions, kv, meta)
            except BaseException:
                # A step that stopped between a GEMV and its reader would leave a float32 row
                # non-zero, and every later step would add onto it: zero them all (a capture
                # that failed ran nothing).
                if self._gemv_acc and not torch.cuda.is_current_stream_capturing():
                    for rows in self._gemv_acc.values():
                        for r in rows:
                            if r is not None:
                                r.zero_()
                raise
        cfg = self.cfg
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        t = input_ids.shape[0]
        half = d // 2
        cs = self.cos_sin.index_select(0, positions)  # [T, D] (cheaper than cos_sin[positions])
        cos = cs[:, None, :half].to(self.dtype)
        sin = cs[:, None, half:].to(self.dtype)
        h = self.embed_tokens(input_ids)
        cpu_decode = (
            _CpuDecodeAttention(meta, kv.block_size)
            if meta.decode_only and self.device.type == "cpu"
            else None
        )
        for i, lw in enumerate(self.layers):
            x = rms_norm(h, lw.input_norm, cfg.rms_norm_eps)
            qkv = cpu_linear(_gather(x, lw.qkv_perm), lw.qkv, lw.qkv_bias)
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q = apply_rotary(q.view(t, hq, d), cos, sin)
            k = apply_rotary(k.view(t, hkv, d), cos, sin)
            v = v.view(t, hkv, d)
            k_cache, v_cache = kv.layer(i)
            k_scale, v_scale = kv.layer_scales(i)
            if k_scale is None:
                k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
                v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
            else:  # FP8 / INT8 cache: quantize on write, per-block scales
                kv.write_quantized(i, meta.slot_mapping, k, v, unique_blocks=meta.decode_only)
            if cpu_decode is not None and k_scale is None:
                attn = cpu_decode(q, kv.data[i], self.scale)
            elif meta.decode_only:
                attn = paged_attention_decode(
                    q,
                    k_cache,
                    v_cache,
                    meta.block_tables,
                    meta.context_lens,
                    self.scale,
                    k_scale=k_scale,
                    v_scale=v_scale,
                )
            else:
                attn = paged_attention_varlen_ref(
                    q,
                    k_cache,
                    v_cache,
                    meta.block_tables,
                    meta.query_start_loc,
                    meta.context_lens_list,
                    self.scale,
                    k_scale,
                    v_scale,
                )
            h = h + cpu_linear(_gather(attn.reshape(t, hq * d), lw.o_perm), lw.o)
            x = rms_norm(h, lw.post_norm, cfg.rms_norm_eps)
            gate, up = cpu_linear(_gather(x, lw.gate_up_perm), lw.gate_up).chunk(2, dim=-1)
            h = h + cpu_linear(F.silu(gate) * up, lw.down)
        return rms_norm(h, self.norm, cfg.rms_norm_eps)

    def _forward_cuda(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """`forward` with fused kernels: the same maths in about ten launches per layer, not ~40.

        At decode batch sizes every small op is launch latency, so: residual add + RMSNorm in one
        kernel, rotary + KV write in one, silu * up in one. Nothing here reads a device value on
        the host, so a decode batch can be captured in a CUDA graph (`tandem.engine.cuda_graphs`).
        """
        cfg = self.cfg
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        t = input_ids.shape[0]
        h = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None  # the residual stream; h is the pending branch output
        cos = sin = None
        # One row: RMSNorm and silu*up also write x in the form the INT4 GEMV reads (GemvX).
        one_row = t == 1 and h.is_cuda
        dt = h.dtype

        atomic = one_row and bool(self._gemv_acc) and gemv_atomic_enabled(dt)

        def acc(name: str, i: int) -> torch.Tensor | None:
            """The float32 row layer i's `name` GEMV adds into, if it does
            (`w4a16.gemv_accumulates`: the settings checked once a step, the weight at load)."""
            rows = self._gemv_acc.get(name) if atomic else None
            return rows[i] if rows is not None else None

        h_acc = False  # h is the previous layer's down accumulator
        for i, lw in enumerate(self.layers):
            k_cache, v_cache = kv.layer(i)
            k_scale, v_scale = kv.layer_scales(i)
            qkv_acc = acc("qkv", i) if k_scale is None and lw.qkv_bias is None else None
            o_acc = acc("o", i)
            # A permuted input is gathered after the norm: its GemvX form would be in the wrong
            # order, so the norm writes none (consumer None).
            qkv_in = lw.qkv if lw.qkv_perm is None else None
            x, residual, xq = _norm(h, lw.input_norm, eps, residual, qkv_in, one_row, h_acc)
            qkv = _cuda_linear(_gather(x, lw.qkv_perm), lw.qkv, lw.qkv_bias, xq, qkv_acc)
            if k_scale is None:
                q = rope_cache_write(
                    qkv, positions, self.cos_sin, meta.slot_mapping, k_cache, v_cache, hq, hkv,
                    dt if qkv_acc is not None else None,
                )  # fmt: skip
            elif meta.decode_only:  # FP8 / INT8 cache, one token per block: one fused launch
                q = rope_cache_write_scaled(
                    qkv,
                    positions,
                    self.cos_sin,
                    meta.slot_mapping,
                    k_cache,
                    v_cache,
                    k_scale,
                    v_scale,
                    hq,
                    hkv,
                )
            else:  # FP8 / INT8 cache: quantize on write, per-block scales
                if cos is None:
                    cs = self.cos_sin.index_select(0, positions).to(self.dtype)
                    cos, sin = cs[:, None, : d // 2], cs[:, None, d // 2 :]
                q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
                q = apply_rotary(q.view(t, hq, d), cos, sin)
                k = apply_rotary(k.view(t, hkv, d), cos, sin)
                kv.write_quantized(i, meta.slot_mapping, k, v.view(t, hkv, d), meta.decode_only)
            if meta.decode_only:
                attn = paged_attention_decode_triton(
                    q,
                    k_cache,
                    v_cache,
                    meta.block_tables,
                    meta.context_lens,
                    self.scale,
                    partition_size=decode_partition_size(t, hkv),
                    k_scale=k_scale,
                    v_scale=v_scale,
                    # One row of INT4 weights: the partitions merge faster in a kernel of their
                    # own (H200, Llama-3-8B shape: 2.03 against 2.14 ms a step); of bf16 weights
                    # by the last partition (4.54 against 4.59).
                    merge_last=not (one_row and isinstance(lw.o, QuantizedWeight)),
                )
            else:
                kind = varlen_attention_kind(
                    meta.query_start_loc, meta.context_lens_list, self.kernels.prefill_attention
                )
                varlen = (
                    paged_attention_varlen_triton
                    if kind == "triton"
                    else paged_attention_varlen_ref
                )
                attn = varlen(
                    q,
                    k_cache,
                    v_cache,
                    meta.block_tables,
                    meta.query_start_loc,
                    meta.context_lens_list,
                    self.scale,
                    k_scale,
                    v_scale,
                )
            o = _cuda_linear(_gather(attn.reshape(t, hq * d), lw.o_perm), lw.o, accumulate=o_acc)
            # gate/up's reader takes its accumulator only where it writes down's GemvX form.
            gu_acc = acc("gate_up", i) if gemv_x_group(lw.down, dt) is not None else None
            gu_in = lw.gate_up if lw.gate_up_perm is None else None
            x, residual, xq = _norm(
                o, lw.post_norm, eps, residual, gu_in, one_row, o_acc is not None
            )
            gu = _cuda_linear(_gather(x, lw.gate_up_perm), lw.gate_up, xq=xq, accumulate=gu_acc)
            act, aq = _silu_mul(gu, lw.down, one_row, dt if gu_acc is not None else None)
            down_acc = acc("down", i)
            h = _cuda_linear(act, lw.down, xq=aq, accumulate=down_acc)
            h_acc = down_acc is not None
        return rmsnorm(h, self.norm, eps, residual, h_acc)[0]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, H] in the model dtype; a quantized table (a recipe can quantize
        `model.embed_tokens`) is gathered row by row and only those rows are dequantized."""
        if isinstance(self.embed, QuantizedWeight):
            if input_ids.is_cuda:  # one launch (with PDL) instead of ~10 torch ops
                return embed_dequant_triton(self.embed, input_ids, self.dtype)
            return permute_rows(self.embed, input_ids).dequantize(self.dtype)
        return F.embedding(input_ids, self.embed)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, vocab] float32 (the model dtype's logits, widened)."""
        if hidden.is_cuda:
            if isinstance(self.lm_head, QuantizedWeight):  # the GEMV stores them so: no cast
                return w4a16_matmul(hidden, self.lm_head, out_dtype=torch.float32)
            return _cuda_linear(hidden, self.lm_head).float()
        return cpu_logits(hidden, self.cpu_lm_head, self.lm_head)
