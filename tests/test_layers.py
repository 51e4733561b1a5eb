"""Each layer of `tandem.layers` on CPU against a float64 torch computation of its maths."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.formats.weight import quantize_rtn
from tandem.kv.cache import KVCache
from tandem.layers.activation import SiluAndMul
from tandem.layers.attention import Attention, AttentionMetadata
from tandem.layers.embedding import vocab_layers
from tandem.layers.linear import InOrder, Linear, QuantLinear, linear_layer
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryKVWrite
from tandem.layers.step import Step

H, HQ, HKV, D, BS = 64, 4, 2, 16, 4
GEN = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def prompt_step(lens: list[int], kv_dtype: torch.dtype = torch.float32) -> Step:
    """A CPU step prefilling prompts of `lens` tokens, block b of sequence s at s * 4 + b."""
    kv = KVCache.allocate(1, 4 * len(lens), BS, HKV, D, kv_dtype, "cpu")
    tables = torch.arange(4 * len(lens)).view(len(lens), 4)
    slots = torch.cat([s * 4 * BS + torch.arange(n) for s, n in enumerate(lens)])
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    meta = AttentionMetadata(slots, tables, torch.tensor(lens), lens, starts, False)
    positions = torch.cat([torch.arange(n) for n in lens])
    return Step.begin(positions, kv, meta, torch.zeros(sum(lens), H))


def test_cpu_step_runs_no_fused_kernel() -> None:
    step = prompt_step([1])
    assert not step.cuda and not step.one_row and not step.accumulate


def test_linear_reads_its_input_in_its_permutation_order() -> None:
    w, b, x = randn(48, H), randn(48), randn(3, H)
    perm = torch.randperm(H, generator=GEN)
    layer = linear_layer(w, b, perm)
    group, order = layer.gemv_x_form(torch.float32)
    assert type(layer) is Linear and group is None and torch.equal(order, perm.int())
    # Where each input element goes in that order: the inverse permutation.
    assert torch.equal(perm[layer.input_places.long()], torch.arange(H))
    want = F.linear(x.double()[:, perm], w.double(), b.double())
    close(layer(x, prompt_step([3])), want)
    # Written in its order by the layer before it: not gathered again.
    close(layer(InOrder(x[:, perm]), prompt_step([3])), want)


def test_quant_linear_matches_its_dequantized_weight() -> None:
    wq = quantize_rtn(randn(48, H), 4, 32, True)
    perm = torch.randperm(H, generator=GEN)
    layer = linear_layer(wq, None, perm)
    assert isinstance(layer, QuantLinear) and layer.acc_row is None  # only on CUDA
    # On CPU no GemvX form; the order its producer would write one in.
    group, order = layer.gemv_x_form(torch.bfloat16)
    assert group is None and torch.equal(order, perm.int())
    x = randn(2, H)
    want = F.linear(x.double()[:, perm], wq.dequantize(torch.float64))
    close(layer(x, prompt_step([2])), want, tol=2e-2)  # the CPU INT4 kernel computes in bf16


def test_rmsnorm_adds_the_residual_then_normalizes() -> None:
    w, h, res = randn(H), randn(3, H), randn(3, H)
    x, new_res = RMSNorm(w, 1e-5)(h, res, prompt_step([3]))
    s = h.double() + res.double()
    close(new_res, s)
    close(x, w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5))
    first, stream = RMSNorm(w, 1e-5)(h, None, prompt_step([3]))  # layer 0: no residual yet
    assert stream is h
    close(first, w.double() * h.double() * torch.rsqrt(h.double().pow(2).mean(-1, True) + 1e-5))


def test_silu_and_mul() -> None:
    gu = randn(3, 2 * H)
    out = SiluAndMul(linear_layer(randn(H, H)))(gu, prompt_step([3]))
    g, u = gu.double().chunk(2, -1)
    close(out, g * torch.sigmoid(g) * u)


def rotate(x: torch.Tensor, pos: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    cs = cos_sin.double()[pos][:, None]
    cos, sin = cs[..., : D // 2], cs[..., D // 2 :]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def test_rotary_rotates_q_and_k_and_writes_the_cache() -> None:
    angles = torch.arange(32)[:, None] * 0.1 * torch.arange(1, D // 2 + 1)
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1).float()
    step = prompt_step([5, 3])
    qkv = randn(8, (HQ + 2 * HKV) * D)
    q = RotaryKVWrite(cos_sin, 0, HQ, HKV, D)(qkv, step)
    wq, wk, wv = qkv.double().split([HQ * D, HKV * D, HKV * D], -1)
    close(q, rotate(wq.view(8, HQ, D), step.positions, cos_sin))
    k_cache, v_cache = step.kv.layer(0)
    slots = step.meta.slot_mapping
    close(k_cache.reshape(-1, HKV, D)[slots], rotate(wk.view(8, HKV, D), step.positions, cos_sin))
    close(v_cache.reshape(-1, HKV, D)[slots], wv.view(8, HKV, D))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T, HQ, D], k, v [T, HKV, D] of one sequence -> [T, HQ * D], float64."""
    k, v = (t.double().repeat_interleave(HQ // HKV, 1).transpose(0, 1) for t in (k, v))
    s = q.double().transpose(0, 1) @ k.transpose(1, 2) * D**-0.5
    s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1).reshape(q.shape[0], -1)


def test_attention_prefill_then_decode() -> None:
    lens = [5, 3]
    step = prompt_step(lens)
    k, v = randn(8, HKV, D), randn(8, HKV, D)
    k_cache, v_cache = step.kv.layer(0)
    k_cache.view(-1, HKV, D)[step.meta.slot_mapping] = k
    v_cache.view(-1, HKV, D)[step.meta.slot_mapping] = v
    attn = Attention(0, D**-0.5, HKV, linear_layer(randn(H, HQ * D)), None)  # type: ignore[arg-type]
    q = randn(8, HQ, D)
    out = attn(q, step)
    close(out[:5], causal_attention(q[:5], k[:5], v[:5]))
    close(out[5:], causal_attention(q[5:], k[5:], v[5:]))
    # Decode: the last token of each prompt again, as a one-token query of its sequence.
    meta = step.meta
    last = [4, 7]
    dmeta = AttentionMetadata(
        meta.slot_mapping[last], meta.block_tables, meta.context_lens, lens, [0, 1, 2], True
    )
    dstep = Step.begin(step.positions[last], step.kv, dmeta, torch.zeros(2, H))
    close(attn(q[last], dstep), out[last].double())


def test_quantized_embedding_and_tied_head() -> None:
    table = quantize_rtn(randn(40, H), 8, 32, True)
    embed, head = vocab_layers(table, None, torch.float32, torch.device("cpu"))
    assert head.weight is embed.weight  # tied: one table
    ids = torch.tensor([0, 7, 39])
    deq = table.dequantize(torch.float64)
    close(embed(ids), deq[ids])
    h = randn(2, H)
    close(head(h), h.double() @ deq.T, tol=5e-2)  # the best logits in float32, the rest bf16
