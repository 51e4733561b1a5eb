"""INT4/INT8 weights and FP8/INT8 KV on CPU: packing, GGUF Q4_1 direct load, recipes, the W4A16
reference and Triton kernel (interpreter), quantized-KV attention, and whole engines."""

from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import tandem  # noqa: E402
from tandem.formats.kv import write_kv_block_scaled  # noqa: E402
from tandem.formats.weight import (  # noqa: E402
    LayerSpec,  # noqa: E402
    pack,
    quantize_rtn,
    unpack,
)
from tandem.kernels import paged_attention as pa  # noqa: E402
from tandem.kernels import paged_attention_ref as pa_ref  # noqa: E402
from tandem.kernels import w4a16 as wk  # noqa: E402
from tandem.kernels.arrival import arrival_counters  # noqa: E402
from tandem.quant.recipe import Recipe, RecipeError, resolve_specs  # noqa: E402
from tests.engine_checks import (  # noqa: E402
    assert_equal_up_to_a_near_tie,
    run_to_completion,
)

# ---- format ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trip(bits: int) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 1 << bits, (7, 256), generator=g, dtype=torch.int32)
    q[0] = (1 << bits) - 1  # all-ones words are negative int32s
    words = pack(q, bits)
    assert words.dtype == torch.int32 and words.shape == (7, 256 * bits // 32)
    assert (words[0] == -1).all()
    assert torch.equal(unpack(words, bits), q)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("zero_point", [True, False])
def test_rtn_error_within_half_a_step(bits: int, group: int, zero_point: bool) -> None:
    g = torch.Generator().manual_seed(1)
    k = 200  # not a multiple of the group: the last group is partly padding
    w = torch.randn(9, k, generator=g) * 0.1
    w[3, :group] = 0.25  # a constant group
    qw = quantize_rtn(w, bits, group, zero_point)
    assert qw.shape == (9, k) and qw.padded_in_features % group == 0
    deq = qw.dequantize(torch.float64)
    step = qw.scales.double().repeat_interleave(group, 1)[:, :k]
    # Half a step, plus the fp16 rounding of the zero point (relative 2**-11).
    slack = 2**-10 * (qw.mins.double().abs().repeat_interleave(group, 1)[:, :k]) + 1e-7
    assert ((deq - w.double()).abs() <= step / 2 + slack).all()
    if not zero_point:
        assert torch.equal(qw.mins.float(), -(1 << (bits - 1)) * qw.scales.float())


# ---- GGUF Q4_1 -------------------------------------------------------------------------------


def test_q4_1_blocks_load_bit_exact() -> None:
    import gguf

    from tandem.formats.gguf import q4_1_to_quantized

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 320)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    expect = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)
    qw = q4_1_to_quantized(raw, 48, 320)
    assert qw.bits == 4 and qw.group_size == 32
    assert torch.equal(qw.dequantize(), torch.from_numpy(expect))


def test_default_gguf_q4_1_loads_bit_exact() -> None:
    """The embedded SmolLM2's Q4_1 tensors, q/k rows un-permuted as the float loader does."""
    import gguf

    from tandem.model import gguf_loader as gl
    from tandem.model.gguf_loader import q4_1_tensor
    from tandem.model.gguf_meta import Metadata, config_from_metadata, open_reader
    from tandem.model.info import default_model_path

    path = default_model_path()
    reader = open_reader(path)
    meta = Metadata(reader, path)
    cfg = config_from_metadata(meta, {t.name: t for t in reader.tensors}, path)
    checked = 0
    for t in reader.tensors:
        if t.name not in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.7.ffn_down.weight"):
            continue
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
        expect = torch.from_numpy(gl._dequantize(t, path))
        if ".attn_q." in t.name:
            expect = gl._unpermute(expect, cfg.num_heads)
        if ".attn_k." in t.name:
            expect = gl._unpermute(expect, cfg.num_kv_heads)
        name, qw = q4_1_tensor(t, cfg, permuted=True)
        assert name.startswith("model.layers.")
        assert torch.equal(qw.dequantize(), expect), t.name
        checked += 1
    assert checked == 3


# ---- recipes ---------------------------------------------------------------------------------


def test_recipe_yaml_first_match_and_inheritance(tmp_path) -> None:
    p = tmp_path / "r.yaml"
    p.write_text(
        "default: {bits: 4, group_size: 64}\n"
        "overrides:\n"
        "  'model.layers.0.*': {bits: 8}\n"
        "  '*.down_proj': {bits: 16}\n"
        "  '*.o_proj': {zero_point: false}\n"
    )
    r = Recipe.load(str(p))
    assert r.spec_for("model.layers.0.mlp.down_proj") == LayerSpec(8, 64, True)  # first wins
    assert r.spec_for("model.layers.3.mlp.down_proj") == LayerSpec(16, 64, True)
    assert r.spec_for("model.layers.3.self_attn.o_proj") == LayerSpec(4, 64, False)
    assert r.spec_for("model.layers.3.mlp.up_proj") == LayerSpec(4, 64, True)
    # Fused groups take their most precise member: v at 8 bits lifts q and k.
    r2 = Recipe.from_dict({"overrides": {"model.layers.1.self_attn.v_proj": {"bits": 8}}})
    specs = resolve_specs(r2, 2)
    assert specs["model.layers.1.self_attn.q_proj"].bits == 8
    assert specs["model.layers.0.self_attn.q_proj"].bits == 4
    j = tmp_path / "r.json"
    j.write_text(json.dumps(r.to_dict()))
    assert Recipe.load(str(j)).to_dict() == r.to_dict()


@pytest.mark.parametrize(
    "data, message",
    [
        ({"default": {"bits": 3}}, "default.bits must be 4, 8 or 16, got 3"),
        ({"default": {"group_size": 100}}, "default.group_size must be one of 32, 64, 128"),
        ({"default": {"zero_point": "yes"}}, "zero_point must be true or false"),
        ({"default": {"bits": 4, "groupsize": 64}}, "unknown key(s) 'groupsize'"),
        ({"defaults": {}}, "unknown top-level key(s) 'defaults'"),
        ({"overrides": [{"bits": 8}]}, "overrides must be a mapping"),
        ({"overrides": {"*.q_proj": 8}}, "overrides['*.q_proj'] must be a mapping"),
        ({"overrides": {"*.q_proj": {"bits": True}}}, "overrides['*.q_proj'].bits must be"),
        ([1, 2], "a recipe must be a mapping"),
    ],
)
def test_recipe_errors_name_the_key(data, message: str) -> None:
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict(data, "r.yaml")
    assert message in str(e.value) and str(e.value).startswith("r.yaml")


def test_recipe_file_errors(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("default: {bits: 4\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        Recipe.load(str(bad))
    with pytest.raises(RecipeError, match="does not exist"):
        Recipe.load(str(tmp_path / "missing.json"))
    typo = Recipe.from_dict({"overrides": {"*.qproj": {"bits": 8}}})
    with pytest.raises(RecipeError, match=r"'\*\.qproj' matches no quantizable layer"):
        resolve_specs(typo, 2)


# ---- W4A16 matmul ----------------------------------------------------------------------------


@pytest.mark.parametrize("bits, group", [(4, 32), (4, 128), (8, 64)])
def test_reference_matmul_matches_f64(bits: int, group: int) -> None:
    g = torch.Generator().manual_seed(2)
    qw = quantize_rtn(torch.randn(96, 300, generator=g), bits, group)
    x = torch.randn(5, 300, generator=g)
    ref = x.double() @ qw.dequantize(torch.float64).T
    torch.testing.assert_close(wk.w4a16_matmul_ref(x, qw).double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wk.w4a16_matmul(x, qw).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "m, bits, group, config",
    [
        (1, 4, 128, None),  # the GEMV kernel, K not a multiple of the group
        (1, 4, 32, wk.GemvConfig(block_n=4, block_w=16, split_k=3)),  # split-K atomics
        (1, 8, 64, None),
        (3, 4, 64, wk.GemmConfig(16, 32, 64, split_k=2)),  # the tl.dot kernel, split-K
        (17, 4, 128, None),
        (20, 8, 32, wk.GemmConfig(16, 16, 32)),
    ],
)
def test_triton_w4a16_matches_f64(m: int, bits: int, group: int, config) -> None:
    g = torch.Generator().manual_seed(m)
    qw = quantize_rtn(torch.randn(40, 200, generator=g), bits, group)
    x = torch.randn(m, 200, generator=g)
    ref = x.double() @ qw.dequantize(torch.float64).T
    out = wk.w4a16_matmul_triton(x, qw, config)
    assert out.shape == (m, 40) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


# ---- FP8 / INT8 KV ---------------------------------------------------------------------------


def _attention_f64(q, k_pool, v_pool, tables, lens, scale, q_lens=None):
    """float64 attention, token by token; the last q_len positions of each context are queries."""
    hq = q.shape[1]
    bs, hkv = k_pool.shape[1], k_pool.shape[2]
    kv_of_head = torch.arange(hq) // (hq // hkv)
    q_lens = q_lens or [1] * len(lens)
    out, row = [], 0
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        phys = tables[i, pos // bs].long()
        k = k_pool[phys, pos % bs].double()[:, kv_of_head]
        v = v_pool[phys, pos % bs].double()[:, kv_of_head]
        for j in range(q_lens[i]):
            p = n - q_lens[i] + j
            s = torch.einsum("hd,nhd->hn", q[row].double(), k[: p + 1]) * scale
            out.append(torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v[: p + 1]))
            row += 1
    return torch.stack(out)


def _quantized_pool(kv_dtype, lens, hkv=2, d=32, bs=4, seed=0):
    """Write random K/V (a prefill, then single-token decode writes) into a shuffled pool."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + bs - 1) // bs for n in lens]
    nb = sum(need) + 3
    perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(len(lens), max(need), dtype=torch.long)
    used = 0
    for i, m in enumerate(need):
        tables[i, :m] = perm[used : used + m]
        used += m
    kc = torch.zeros(nb, bs, hkv, d, dtype=kv_dtype)
    vc = torch.zeros_like(kc)
    ks = torch.full((nb, hkv), 7.0)  # stale scales of a previous owner must be forgotten
    vs = torch.full((nb, hkv), 7.0)
    k_true = torch.zeros(nb, bs, hkv, d)
    v_true = torch.zeros_like(k_true)
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[i, pos // bs] * bs + pos % bs
        kx = torch.randn(n, hkv, d, generator=g) * torch.linspace(0.5, 2, n)[:, None, None]
        vx = torch.randn(n, hkv, d, generator=g)
        k_true.view(-1, hkv, d)[slots] = kx
        v_true.view(-1, hkv, d)[slots] = vx
        split = max(1, n - 6)
        write_kv_block_scaled(kc, ks, slots[:split], kx[:split])
        write_kv_block_scaled(vc, vs, slots[:split], vx[:split])
        for t in range(split, n):
            write_kv_block_scaled(kc, ks, slots[t : t + 1], kx[t : t + 1], unique_blocks=True)
            write_kv_block_scaled(vc, vs, slots[t : t + 1], vx[t : t + 1], unique_blocks=True)
    return tables, kc, vc, ks, vs, k_true, v_true


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_quantized_kv_attention_matches_f64(kv_dtype) -> None:
    lens = [1, 9, 23, 40]
    hq, hkv, d = 4, 2, 32
    tables, kc, vc, ks, vs, k_true, v_true = _quantized_pool(kv_dtype, lens, hkv, d)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(len(lens), hq, d, generator=g)
    ctx = torch.tensor(lens)
    scale = d**-0.5
    k_deq = kc.double() * ks[:, None, :, None]
    v_deq = vc.double() * vs[:, None, :, None]
    expect = _attention_f64(q, k_deq, v_deq, tables, lens, scale)
    ref = pa_ref.paged_attention_decode_ref(q, kc, vc, tables, ctx, scale, ks, vs)
    torch.testing.assert_close(ref.double(), expect, rtol=1e-5, atol=1e-5)
    tri = pa.paged_attention_decode_triton(
        q, kc, vc, tables, ctx, scale, partition_size=16, k_scale=ks, v_scale=vs
    )
    torch.testing.assert_close(tri.double(), expect, rtol=1e-5, atol=1e-5)
    # Against the unquantized values: the quantization error itself stays small.
    exact = _attention_f64(q, k_true, v_true, tables, lens, scale)
    err = ((ref.double() - exact).norm() / exact.norm()).item()
    assert err < (0.05 if kv_dtype == torch.float8_e4m3fn else 0.01)
    # Prefill-style packed queries (the last 3 positions of each context) through varlen.
    q_lens = [1, 3, 3, 3]
    qv = torch.randn(sum(q_lens), hq, d, generator=g)
    qsl = [0, *np.cumsum(q_lens).tolist()]
    out = pa_ref.paged_attention_varlen_ref(qv, kc, vc, tables, qsl, lens, scale, ks, vs)
    expect_v = _attention_f64(qv, k_deq, v_deq, tables, lens, scale, q_lens)
    torch.testing.assert_close(out.double(), expect_v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_quantized_kv_attention_16bit_queries_match_f64(kv_dtype, q_dtype) -> None:
    """16-bit queries over FP8 / INT8 codes, against float64 over the dequantized cache."""
    lens = [1, 9, 23, 40, 70]
    hq, hkv, d = 8, 2, 32
    tables, kc, vc, ks, vs, _, _ = _quantized_pool(kv_dtype, lens, hkv, d)
    q = (torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(4)) * 3).to(q_dtype)
    k_deq = kc.double() * ks[:, None, :, None]
    v_deq = vc.double() * vs[:, None, :, None]
    expect = _attention_f64(q.double(), k_deq, v_deq, tables, lens, d**-0.5)
    # Several partitions merged; one; the engine's one-byte tiling (iterations spanning blocks).
    for ps, n in ((16, 16), (64, 64), (1024, 128)):
        tri = pa.paged_attention_decode_triton(
            q, kc, vc, tables, torch.tensor(lens), d**-0.5, partition_size=ps, block_n=n,
            k_scale=ks, v_scale=vs,
        )  # fmt: skip
        assert tri.dtype == q_dtype
        torch.testing.assert_close(tri.double(), expect, rtol=2e-2, atol=2e-2)


def test_shared_pool_and_gather_copy_carry_scales() -> None:
    from tandem.kv.block_copy import gather_copy
    from tandem.kv.cache import KVCache
    from tandem.kv.layout import PoolLayout
    from tandem.kv.transports.inline import block_to_bytes, bytes_to_block
    from tandem.kv.transports.shm import SharedPool

    layout = PoolLayout(2, 6, 4, 2, 16, "float8_e4m3fn")
    pool = SharedPool.create(layout)
    try:
        assert PoolLayout.of(pool.kv) == layout and pool.kv.scales is not None
        pool.kv.data.view(torch.uint8).random_(0, 100)
        pool.kv.scales.uniform_()
        peer = SharedPool.open(pool.name, layout)
        assert torch.equal(peer.kv.scales, pool.kv.scales)
        dst = KVCache.allocate(2, 5, 4, 2, 16, torch.float8_e4m3fn, "cpu")
        gather_copy(dst, [4, 0], peer.kv, [1, 3])
        assert torch.equal(
            dst.data[:, :, 4].view(torch.uint8), pool.kv.data[:, :, 1].view(torch.uint8)
        )
        assert torch.equal(dst.scales[:, :, 0], pool.kv.scales[:, :, 3])
        bytes_to_block(dst, 2, block_to_bytes(pool.kv, 5))
        assert torch.equal(dst.scales[:, :, 2], pool.kv.scales[:, :, 5])
        peer.close()
    finally:
        pool.close()
    from tandem.config import EngineConfig

    with pytest.raises(ValueError, match="kv_dtype must be one of auto, fp8, int8"):
        EngineConfig.from_options(kv_dtype="fp4")


# ---- engines ---------------------------------------------------------------------------------


def test_int4_engine_equals_float_engine_on_dequantized_weights(model_factory) -> None:
    """The CPU W4A16 path (the bfloat16 INT4 kernel, tandem.kernels.cpu_int4) gives a float
    model's greedy tokens on the dequantized weights, up to a near-tie (`NEAR_TIE`)."""
    from tandem.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.formats.weight import dequantize_weights
    from tandem.model.loader import LoadedModel, load_model, prepare_weights

    _, path = model_factory("qwen2")  # q/k/v biases too
    loaded = load_model(path)
    deq = dequantize_weights(prepare_weights(loaded, "int4", torch.float32), torch.float32)
    a = LLMEngine(loaded, EngineConfig(num_blocks=32, quantization="int4"))
    b = LLMEngine(
        LoadedModel(loaded.config, deq, loaded.tokenizer, path), EngineConfig(num_blocks=32)
    )
    sp = tandem.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    for eng in (a, b):
        eng.add_request([5, 9, 33, 100, 7, 7, 300], sp, request_id="r")
        eng.add_request([11, 12], sp, request_id="s")
    assert_equal_up_to_a_near_tie(run_to_completion(a), run_to_completion(b))
    assert type(a.model.layers[0].qkv.weight).__name__ == "CpuInt4Weight"


def test_quantize_checkpoint_round_trip(model_factory, tmp_path) -> None:
    """`tandem quantize --method awq` writes a directory tandem.LLM loads, with the same weights."""
    from tandem.cli import main
    from tandem.formats.weight import QuantizedWeight
    from tandem.model.loader import load_model

    _, path = model_factory("llama")
    calib = tmp_path / "calib.txt"
    g = torch.Generator().manual_seed(0)
    calib.write_text(" ".join(f"w{i}" for i in torch.randint(3, 512, (600,), generator=g).tolist()))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("default: {bits: 4, group_size: 32}\noverrides: {'*.down_proj': {bits: 8}}\n")
    out = tmp_path / "q"
    rc = main(["quantize", path, "--recipe", str(recipe), "--calib", str(calib), "--out", str(out),
               "--calib-seq-len", "64", "--awq-grid", "4"])  # fmt: skip
    assert rc == 0
    meta = json.loads((out / "quantization.json").read_text())
    assert meta["method"] == "awq" and meta["calibration"]["tokens"] % 64 == 0
    assert meta["layers"]["model.layers.0.mlp.down_proj"]["bits"] == 8
    back = load_model(str(out))
    w = back.weights["model.layers.2.self_attn.q_proj.weight"]
    assert isinstance(w, QuantizedWeight) and (w.bits, w.group_size) == (4, 32)
    llm = tandem.LLM(str(out), num_blocks=16)
    done = llm.generate([[5, 6, 7, 8]], tandem.SamplingParams(max_tokens=5, temperature=0))[0]
    assert len(done.token_ids) >= 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("default: {bits: 5}\n")
    assert main(["quantize", path, "--recipe", str(bad), "--out", str(tmp_path / "x")]) == 2


def test_default_model_with_fp8_kv_answers() -> None:
    """SmolLM2 with an FP8 KV cache still answers the capital question."""
    llm = tandem.LLM(kv_dtype="fp8", num_blocks=32)
    assert llm.engine.kv.data.dtype == torch.float8_e4m3fn
    ids = llm.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate([ids], tandem.SamplingParams(max_tokens=12, temperature=0))[0]
    assert "Paris" in out.text


def test_triton_gemv_even_tiles_match_f64() -> None:
    """Shapes that divide into whole tiles take the unmasked (EVEN) path."""
    g = torch.Generator().manual_seed(3)
    qw = quantize_rtn(torch.randn(32, 256, generator=g), 4, 64)
    x = torch.randn(1, 256, generator=g)
    ref = x.double() @ qw.dequantize(torch.float64).T
    for cfg in (
        wk.GemvConfig(block_n=8, block_w=16),
        wk.GemvConfig(block_n=16, block_w=8, split_k=2),
    ):
        torch.testing.assert_close(
            wk.w4a16_matmul_triton(x, qw, cfg).double(), ref, rtol=1e-4, atol=1e-4
        )


@pytest.mark.parametrize(
    "n, k, group, config",
    [
        (40, 200, 128, wk.GemvNConfig(block_n=16)),  # K padded to the group, ragged N
        (64, 256, 32, wk.GemvNConfig(block_n=32, split_k=2)),  # even tiles
        (48, 384, 64, wk.GemvNConfig(block_n=16, split_k=4)),  # uneven splits
        (64, 1024, 128, wk.GemvNConfig(block_n=64, split_k=8, num_warps=1)),
    ],
)
def test_triton_n_major_gemv_matches_f64(n: int, k: int, group: int, config) -> None:
    """The INT4 GEMV over N-major codes (float trick for the codes, x read as broadcasts)."""
    g = torch.Generator().manual_seed(n + k)
    qw = wk.n_major(quantize_rtn(torch.randn(n, k, generator=g), 4, group))
    assert wk.is_n_major(qw) and qw.qweight.shape == (n, -(-k // group) * group // 8)
    x = torch.randn(1, k, generator=g) * 3
    ref = x.double() @ qw.dequantize(torch.float64).T
    out = wk.w4a16_matmul_triton(x, qw, config)
    assert out.shape == (1, n) and out.dtype == torch.float32
    # The codes ride on x scaled by up to 2**11, so float32 rounding lands near 1e-5 of the norm
    # (elementwise checks would fail on outputs near zero).
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-4
    # Split K: the last program of each column block adds the partials and re-zeroes its
    # arrival counter, so a second call (same counters) gives the same output.
    torch.testing.assert_close(wk.w4a16_matmul_triton(x, qw, config), out, rtol=0, atol=0)
    assert not arrival_counters(x.device, 1).any()
    # The tl.dot kernel reads the same storage for M > 1.
    xm = torch.randn(3, k, generator=g)
    refm = xm.double() @ qw.dequantize(torch.float64).T
    torch.testing.assert_close(wk.w4a16_matmul_triton(xm, qw).double(), refm, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "n, k, group, config",
    [
        (40, 256, 128, wk.GemvH2Config(block_n=16)),  # ragged N
        (64, 256, 32, wk.GemvH2Config(block_n=32, split_k=2)),  # even tiles
        (48, 384, 64, wk.GemvH2Config(block_n=16, split_k=4)),  # uneven splits
        (64, 1024, 128, None),  # the default configuration for N-major INT4 at M = 1
    ],
)
@pytest.mark.parametrize(
    "x_scale, outlier", [(3.0, 0.0), (1e-3, 0.0), (1.0, 1e4), (3e4, 0.0)], ids=str
)
def test_triton_packed_half_gemv_matches_f64(n, k, group, config, x_scale, outlier) -> None:
    """The packed-fp16 INT4 GEMV (codes as fp16 subnormals, x scaled per group by a power of
    two, products and sums in fp16), emulated code by code in the interpreter: within bf16
    expectations for x of any magnitude, one outlier 10**4 times the rest, and |x| past fp16's
    range (6.5e4), where unscaled fp16 would overflow."""
    g = torch.Generator().manual_seed(n + k)
    qw = wk.n_major(quantize_rtn(torch.randn(n, k, generator=g), 4, group))
    x = torch.randn(1, k, generator=g) * x_scale
    x[0, 5] += outlier
    x = x.to(torch.bfloat16).float()  # the values bf16 activations take
    ref = x.double() @ qw.dequantize(torch.float64).T
    if config is None:
        assert isinstance(wk.default_config(1, n, k, x.device, qw, x.dtype), wk.GemvH2Config)
    out = wk.w4a16_matmul_triton(x, qw, config)
    assert out.shape == (1, n) and torch.isfinite(out).all()
    # fp16 products and sums: ~2**-11 per operation; a bf16 output alone rounds at 2**-9.
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3
    torch.testing.assert_close(wk.w4a16_matmul_triton(x, qw, config), out, rtol=0, atol=0)
    assert not arrival_counters(x.device, 1).any()


@pytest.mark.parametrize("n, k, config", [
    (40, 256, wk.GemvH2Config(block_n=16)),  # one program per column block, ragged N
    (64, 512, wk.GemvH2Config(block_n=32, split_k=2)),  # the last program of each block stores
    (48, 384, wk.GemvNConfig(block_n=16, split_k=2)),  # not the packed-fp16 GEMV: cast after
])  # fmt: skip
def test_gemv_float32_output_holds_the_rounded_logits(n, k, config) -> None:
    """`out_dtype=float32` (the INT4 LM head's logits): exactly the x-dtype output widened, with
    no cast launched after the packed-fp16 GEMV; the float32 reference path does the same."""
    g = torch.Generator().manual_seed(n)
    qw = wk.n_major(quantize_rtn(torch.randn(n, k, generator=g), 4, 128 if k % 128 == 0 else 64))
    x = torch.randn(1, k, generator=g).to(torch.float16)  # the interpreter has no bf16 GEMV x
    want = wk.w4a16_matmul_triton(x, qw, config)
    got = wk.w4a16_matmul_triton(x, qw, config, out_dtype=torch.float32)
    assert want.dtype == torch.float16 and got.dtype == torch.float32
    assert torch.equal(got, want.float())
    assert wk.w4a16_matmul_triton(x[:0], qw, config, out_dtype=torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="out_dtype is x's dtype or float32, got torch.float64"):
        wk.w4a16_matmul_triton(x, qw, config, out_dtype=torch.float64)
    cpu = wk.w4a16_matmul(x.float(), qw, out_dtype=torch.float32)
    assert cpu.dtype == torch.float32


def test_gemv_x_written_by_producers() -> None:
    """RMSNorm and silu*up write their output also in the packed-fp16 GEMV's GemvX form (x per
    group scaled by a power of two as fp16 pairs in the GEMV's code order, and per group the
    scale and the sum): the same as the torch reference of that form, the bf16 outputs
    unchanged, and the GEMV reading it gives what it gives reading x."""
    from tandem.kernels.activation import silu_and_mul_gemv_x, silu_and_mul_triton
    from tandem.kernels.rmsnorm import rmsnorm_gemv_x, rmsnorm_triton

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 576, generator=g).to(torch.bfloat16)
    r = torch.randn(2, 576, generator=g).to(torch.bfloat16)
    nw = (torch.rand(576, generator=g) + 0.5).to(torch.bfloat16)
    out, res, xq = rmsnorm_gemv_x(x, nw, 1e-5, r, 64)
    out_plain, res_plain = rmsnorm_triton(x, nw, 1e-5, r)
    assert torch.equal(out, out_plain) and torch.equal(res, res_plain)
    gu = (torch.randn(3, 2 * 384, generator=g) * 3).to(torch.bfloat16)
    gu[1, 5] = 3e4  # silu(3e4) * up: past fp16's range before the group's scale
    act, aq = silu_and_mul_gemv_x(gu, 128)
    assert torch.equal(act, silu_and_mul_triton(gu))
    for y, q, group in ((out, xq, 64), (act, aq, 128)):
        ref = wk.gemv_x_ref(y, group)
        assert q.group == group and torch.equal(q.scaled, ref.scaled)
        assert torch.equal(q.scalars[..., 0], ref.scalars[..., 0])  # 2**24 / scale
        torch.testing.assert_close(q.scalars[..., 1], ref.scalars[..., 1])  # sum, any order
        k = y.shape[1]
        qw = wk.n_major(quantize_rtn(torch.randn(48, k, generator=g), 4, group))
        cfg = wk.GemvH2Config(block_n=16, split_k=2)
        want = wk.w4a16_matmul_triton(y.float(), qw, cfg)
        got = wk.w4a16_matmul_triton(y.float(), qw, cfg, xq=q)
        # Equal but for the order of the group sums of x (float32).
        assert ((got - want).norm() / want.norm()).item() < 1e-6
        ref64 = y.double() @ qw.dequantize(torch.float64).T
        assert ((got.double() - ref64).norm() / ref64.norm()).item() < 2e-3
    # An act-order consumer: the GemvX form holds out[:, perm], out stays in order.
    perm = torch.randperm(576, generator=g).to(torch.int32)
    out_p, res_p, xq_p = rmsnorm_gemv_x(x, nw, 1e-5, r, 64, perm=perm)
    assert torch.equal(out_p, out) and torch.equal(res_p, res)
    ref = wk.gemv_x_ref(out[:, perm.long()], 64)
    assert torch.equal(xq_p.scaled, ref.scaled)
    torch.testing.assert_close(xq_p.scalars, ref.scalars)
    with pytest.raises(ValueError, match="perm must be int32"):
        rmsnorm_gemv_x(x, nw, 1e-5, r, 64, perm=perm.long())
    bad = wk.gemv_x_ref(act, 64)
    with pytest.raises(ValueError, match="group 64, does not fit x"):
        wk.launch_gemv_h2(act.float(), qw, cfg, bad)
    with pytest.raises(ValueError, match="whole groups"):
        rmsnorm_gemv_x(x[:, :200], nw[:200], 1e-5, None, 64)


def test_packed_half_gemv_scales_ahead_is_bit_equal() -> None:
    """Scales a group ahead (`ahead`) change only when they are loaded, so outputs equal the
    kernel's loading them in their group bit for bit, reading x (code-word addresses from a
    base per group) or its GemvX form, with uneven splits; both near the float64 product."""
    g = torch.Generator().manual_seed(7)
    for n, k, group, block_n, split in ((48, 384, 64, 16, 4), (40, 512, 128, 16, 4)):
        qw = wk.n_major(quantize_rtn(torch.randn(n, k, generator=g), 4, group))
        x = torch.randn(1, k, generator=g).to(torch.bfloat16).float()
        plain = wk.GemvH2Config(block_n=block_n, split_k=split)
        ahead = wk.GemvH2Config(block_n=block_n, split_k=split, ahead=True)
        ref64 = x.double() @ qw.dequantize(torch.float64).T
        for xq in (None, wk.gemv_x_ref(x, group)):
            want = wk.w4a16_matmul_triton(x, qw, plain, xq=xq)
            got = wk.w4a16_matmul_triton(x, qw, ahead, xq=xq)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert ((want.double() - ref64).norm() / ref64.norm()).item() < 2e-3


def test_packed_half_gemv_refuses_partial_groups() -> None:
    qw = wk.n_major(quantize_rtn(torch.randn(32, 200), 4, 64))  # K = 200: the last group partial
    x = torch.randn(1, 200)
    assert isinstance(wk.default_config(1, 32, 200, x.device, qw, x.dtype), wk.GemvNConfig)
    with pytest.raises(ValueError, match="whole groups: K 200, group size 64"):
        wk.w4a16_matmul_triton(x, qw, wk.GemvH2Config(block_n=16))


@pytest.mark.parametrize(
    "n, m, k, group, config",
    [
        (96, 1, 256, 128, wk.GemvTCConfig(block_n=64, split_k=1, num_warps=4, num_stages=1)),
        (200, 3, 384, 128, wk.GemvTCConfig(block_n=64, split_k=2, num_warps=4, num_stages=1)),
        (64, 17, 320, 64, wk.GemvTCConfig(block_n=32, split_k=4, num_warps=4, num_stages=1)),
        (64, 70, 256, 128, wk.GemvTCConfig(32, split_k=2, num_warps=4, num_stages=1, block_m=64)),
    ],
)
def test_triton_tensor_core_gemv_matches_f64(n: int, m: int, k: int, group: int, config) -> None:
    """The tensor-core INT4 kernel (bf16 code pairs, x read at stride 4, group sums of x for the
    offset and zero point): ragged N, K not a multiple of the group, M past one 16-row block,
    uneven K splits. The interpreter decodes the codes one at a time; the GPU tests cover the
    LOP3 that decodes two."""
    g = torch.Generator().manual_seed(n + m + k)
    qw = wk.n_major(quantize_rtn(torch.randn(n, k, generator=g) * 0.05, 4, group))
    x = (torch.randn(m, k, generator=g) * 2).to(torch.bfloat16)
    ref = x.double() @ qw.dequantize(torch.float64).T
    out = wk.w4a16_matmul_triton(x, qw, config)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    # Products of bf16 x and exact codes, float32 sums: only the bf16 output rounds (2**-9).
    assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-3
    assert not arrival_counters(x.device, 1).any()
    with pytest.raises(ValueError, match="bf16 activations"):
        wk.w4a16_matmul_triton(x.float(), qw, config)


def test_profile_writes_a_recipe_that_recipe_reads_back(tmp_path, model_factory, capsys) -> None:
    """`tandem quantize --profile --out r.yaml`: the table on stderr, the recipe in the file."""
    from tandem.cli import main

    _, path = model_factory("llama")
    out = tmp_path / "r.yaml"
    assert main(["quantize", path, "--profile", "--out", str(out), "--group-size", "32"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "model.layers.0.self_attn.q_proj" in captured.err  # the per-layer table
    recipe = Recipe.load(str(out))
    assert recipe.default == LayerSpec(bits=4, group_size=32, zero_point=True)
    # Without --out the recipe alone goes to stdout, so `> r.yaml` works as well.
    assert main(["quantize", path, "--profile", "--group-size", "32"]) == 0
    captured = capsys.readouterr()
    (tmp_path / "s.yaml").write_text(captured.out)
    assert Recipe.load(str(tmp_path / "s.yaml")).to_dict() == recipe.to_dict()
