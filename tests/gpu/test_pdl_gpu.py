"""Programmatic dependent launch on the decode path, and a quantized LM head and embedding, on CUDA.

A decode step captured in a CUDA graph with PDL (each kernel may start while its predecessor
finishes) must give the same logits, bit for bit, as the same steps launched eagerly without it:
every kernel of the step is deterministic, so any ordering race shows up as a difference.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from tandem import config, config_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"


def _cfg():
    from tandem.model.config import ModelConfig

    return ModelConfig(
        model_type="llama",
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=3,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_ids=[1],
    )


def _weights(cfg, dtype, dev) -> dict[str, torch.Tensor]:
    from tandem.model.synthetic import random_llama_weights

    # A large embedding and uneven norms, so the step's values are far from trivial.
    return random_llama_weights(cfg, dev, dtype, std=0.05, embed_std=1.0, norm_std=0.05)


def _quantized(weights, cfg):
    from tandem.formats.weight import LayerSpec, quantize_weights
    from tandem.model.layer_names import linear_layer_names

    specs = {n: LayerSpec(4, 128, True) for n in linear_layer_names(cfg.num_layers)}
    specs["lm_head"] = LayerSpec(4, 128, True)
    specs["model.embed_tokens"] = LayerSpec(8, 128, True)
    return quantize_weights(weights, specs)


def _kv_cache(cfg, nb: int, bs: int, kv_dtype):
    """A zeroed paged cache of nb blocks of bs tokens (and zeroed scales for 8-bit ones)."""
    from tandem.kv.cache import KVCache

    kv = KVCache.allocate(cfg.num_layers, nb, bs, cfg.num_kv_heads, cfg.head_dim, kv_dtype, DEV)
    kv.data.zero_()
    if kv.scales is not None:
        kv.scales.zero_()
    return kv


def _decode_meta(slot, ctx, tables):
    """One decode token's attention metadata (slot and context length as device tensors)."""
    from tandem.model.llama import AttentionMetadata

    return AttentionMetadata(slot_mapping=slot, block_tables=tables, context_lens=ctx,
                             context_lens_list=None, query_start_loc=[0, 1],
                             decode_only=True)  # fmt: skip


def _captured_step(model, kv, scratch, tables):
    """A decode step captured in a CUDA graph, after a warm-up step (it compiles) on the scratch
    cache on a side stream: (graph, its logits, and its static ids, position, slot, context).
    The caller keeps `kv` alive while it replays the graph (the graph holds its address only)."""
    s_ids = torch.zeros(1, dtype=torch.long, device=DEV)
    s_pos, s_slot, s_ctx = (torch.zeros(1, dtype=torch.long, device=DEV) for _ in range(3))
    m = _decode_meta(s_slot, s_ctx, tables)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode():
        s_ctx.fill_(1)
        with torch.cuda.stream(side):
            model.logits(model.forward(s_ids, s_pos, scratch, m))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model.logits(model.forward(s_ids, s_pos, kv, m))
    return graph, out, s_ids, s_pos, s_slot, s_ctx


@pytest.fixture(scope="module")
def pdl():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: run `pytest tests/gpu` without it")
    from tandem.kernels import pdl

    if not pdl.use_pdl(torch.zeros(1, device=DEV)):
        pytest.skip("PDL needs compute capability 9.0 and a Triton with the gdc intrinsics")
    return pdl


@pytest.mark.parametrize("weights", ["bf16", "int4"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16kv", "fp8kv"])
def test_graph_with_pdl_equals_eager_without(pdl, weights, kv_dtype, monkeypatch) -> None:
    """With PDL (`pdl.prewait`) the decode attention reads its context length and prefetches
    stable K/V into L2, and the rotary kernel reads its position, slot and cos/sin, before their
    waits. The INT4 GEMVs sum their K split through the arrival counter (the `deterministic`
    kernel setting), so the steps are deterministic; the float atomics are tested below."""
    base = replace(config.kernel_config(), deterministic=True)
    monkeypatch.setattr(config_kernels, "_KERNELS", base)
    from tandem.model.llama import LlamaModel

    cfg = _cfg()
    w = _weights(cfg, torch.bfloat16, DEV)
    if weights == "int4":
        w = _quantized(w, cfg)
    model = LlamaModel(cfg, w, torch.bfloat16, DEV, max_positions=512)
    bs, nb, steps = 16, 8, 90  # 90 tokens over 6 blocks: partitions, block edges

    def kv_cache():
        return _kv_cache(cfg, nb, bs, kv_dtype)

    ids = torch.randint(0, cfg.vocab_size, (steps,), generator=torch.Generator().manual_seed(1))
    tables = torch.randperm(nb, device=DEV)[None]  # blocks out of order

    def meta(slot, ctx):
        return _decode_meta(slot, ctx, tables)

    def slot_of(p: int) -> int:
        return int(tables[0, p // bs]) * bs + p % bs

    # Eager, no PDL.
    config.set_kernel_config(replace(base, pdl=False))
    try:
        kv = kv_cache()
        want = []
        with torch.inference_mode():
            for p in range(steps):
                m = meta(torch.tensor([slot_of(p)], device=DEV), torch.tensor([p + 1], device=DEV))
                t_ids, t_pos = ids[p : p + 1].to(DEV), torch.tensor([p], device=DEV)
                want.append(model.logits(model.forward(t_ids, t_pos, kv, m)).clone())
    finally:
        config.set_kernel_config(base)

    # One captured step with PDL, replayed with new inputs.
    kv = kv_cache()  # held here: the graph writes into it on every replay
    graph, out, s_ids, s_pos, s_slot, s_ctx = _captured_step(model, kv, kv_cache(), tables)
    with torch.inference_mode():
        for p in range(steps):
            s_ids.fill_(int(ids[p]))
            s_pos.fill_(p)
            s_slot.fill_(slot_of(p))
            s_ctx.fill_(p + 1)
            graph.replay()
            assert torch.equal(out, want[p]), f"step {p}: PDL graph differs from eager"
    assert isinstance(model.lm_head.weight, torch.Tensor) == (weights == "bf16")


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16kv", "fp8kv"])
def test_int4_gemvs_adding_into_float32_rows(pdl, kv_dtype, monkeypatch) -> None:
    """One-row INT4 steps whose GEMVs add into float32 rows that their readers round and zero
    (the default, `w4a16.gemv_accumulates`), in a PDL graph, against eager steps that sum the K
    split through the arrival counter (`deterministic`): logits equal up to the order of
    the float32 adds, and every row zero again after each step."""
    from tandem.model.llama import LlamaModel

    cfg = _cfg()
    model = LlamaModel(cfg, _quantized(_weights(cfg, torch.bfloat16, DEV), cfg), torch.bfloat16,
                       DEV, max_positions=512)  # fmt: skip
    rows = [getattr(lw, f).acc_row for lw in model.layers for f in ("qkv", "o", "gate_up", "down")]
    assert all(r is not None for r in rows)
    bs, nb, steps = 16, 8, 40
    tables = torch.arange(nb, device=DEV)[None]
    ids = torch.randint(0, cfg.vocab_size, (steps,), generator=torch.Generator().manual_seed(2))

    def kv_cache():
        return _kv_cache(cfg, nb, bs, kv_dtype)

    def meta(slot, ctx):
        return _decode_meta(slot, ctx, tables)

    monkeypatch.setattr(
        config_kernels, "_KERNELS", replace(config.kernel_config(), deterministic=True)
    )
    kv = kv_cache()
    want = []
    with torch.inference_mode():
        for p in range(steps):
            m = meta(torch.tensor([p], device=DEV), torch.tensor([p + 1], device=DEV))
            t_ids, t_pos = ids[p : p + 1].to(DEV), torch.tensor([p], device=DEV)
            want.append(model.logits(model.forward(t_ids, t_pos, kv, m)).clone())
    config.set_kernel_config(replace(config.kernel_config(), deterministic=False))
    kv = kv_cache()  # held here: the graph writes into it on every replay
    graph, out, s_ids, s_pos, s_slot, s_ctx = _captured_step(model, kv, kv_cache(), tables)
    assert all(torch.count_nonzero(r) == 0 for r in rows), "the warm-up step left a row unzeroed"
    with torch.inference_mode():
        for p in range(steps):
            s_ids.fill_(int(ids[p]))
            s_pos.fill_(p)
            s_slot.fill_(p)
            s_ctx.fill_(p + 1)
            graph.replay()
            err = ((out.double() - want[p].double()).norm() / want[p].double().norm()).item()
            assert err < 2e-2, f"step {p}: {err}"
            assert all(torch.count_nonzero(r) == 0 for r in rows), f"step {p}: a row not zeroed"


def test_quantized_head_and_embedding_match_cpu_float() -> None:
    """INT4 LM head (N-major GEMV) and INT8 embedding on CUDA against a float32 CPU model holding
    the dequantized weights: the bf16 model's logits within bf16 error."""
    from tandem.formats.weight import QuantizedWeight, dequantize_weights
    from tandem.kv.cache import KVCache
    from tandem.model.llama import AttentionMetadata, LlamaModel

    cfg = _cfg()
    q = _quantized(_weights(cfg, torch.float32, "cpu"), cfg)
    gpu = LlamaModel(cfg, q, torch.bfloat16, DEV, max_positions=64)
    cpu = LlamaModel(cfg, dequantize_weights(q, torch.float32), torch.float32, "cpu", 64)
    assert isinstance(gpu.lm_head.weight, QuantizedWeight)
    assert isinstance(gpu.embed.weight, QuantizedWeight)
    logits = {}
    for name, model, dev, dtype in (("gpu", gpu, DEV, torch.bfloat16), ("cpu", cpu, "cpu", None)):
        kv = KVCache.allocate(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim,
                              dtype or torch.float32, dev)  # fmt: skip
        tok = torch.tensor([3, 999, 17, 256, 5], device=dev)
        m = AttentionMetadata(
            slot_mapping=torch.arange(5, device=dev),
            block_tables=torch.arange(4, device=dev)[None],
            context_lens=torch.tensor([5], device=dev),
            context_lens_list=[5],
            query_start_loc=[0, 5],
            decode_only=False,
        )
        with torch.inference_mode():
            logits[name] = model.logits(model.forward(tok, torch.arange(5, device=dev), kv, m))
    got, ref = logits["gpu"].cpu().double(), logits["cpu"].double()
    assert ((got - ref).norm() / ref.norm()).item() < 2e-2
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8
