"""Triton kernels on CUDA (compiled) against float64 references, in bf16/fp16 and larger shapes.

Skipped without CUDA. The kernels must run compiled: with TRITON_INTERPRET=1 in the environment
(the interpreter is chosen when triton is imported) these tests skip, so run this directory as
`pytest tests/gpu` without it. The tandem kernels are imported lazily so that collecting this
module on a CPU host does not import triton before tests/test_kernels.py selects the interpreter.
"""

from __future__ import annotations

import functools
from types import ModuleType

import pytest
import torch

from tandem.kernels import paged_attention_ref as pa_ref
from tests.kernel_checks import (
    attention_decode_f64,
    attention_varlen_f64,
    compiled_kernel,
    make_paged,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"


@pytest.fixture(scope="module")
def pa() -> ModuleType:
    """The paged-attention module, compiled (not interpreted) kernels required."""
    return compiled_kernel("paged_attention")


@pytest.fixture(scope="module")
def pa_varlen() -> ModuleType:
    """The varlen (multi-token) paged-attention module, compiled kernels required."""
    return compiled_kernel("paged_attention_varlen")


@pytest.fixture(scope="module")
def rn() -> ModuleType:
    return compiled_kernel("rmsnorm")


# The GPU cases: three spare table columns, seven blocks nobody owns, on the device.
make_paged = functools.partial(make_paged, extra_table_cols=3, spare_blocks=7, device=DEV)


TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
LENS = [1, 16, 17, 511, 512, 513, 1000, 2047, 3001, 64, 7, 1500]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "hq, hkv, d",
    [(16, 16, 128), (12, 4, 64), (32, 8, 128), (28, 4, 128), (64, 8, 128), (9, 3, 64)],
    ids=["gqa1", "gqa3-d64", "gqa4", "gqa7", "gqa8", "gqa3-odd"],
)
@pytest.mark.parametrize("ps", [512, 256])
def test_decode_triton_matches_f64(
    pa: ModuleType, dtype: torch.dtype, hq: int, hkv: int, d: int, ps: int
) -> None:
    q, kc, vc, table, ctx = make_paged(LENS, hq, hkv, d, 16, dtype)
    out = pa.paged_attention_decode_triton(q, kc, vc, table, ctx, d**-0.5, partition_size=ps)
    assert out.dtype == dtype
    expect = attention_decode_f64(q, kc, vc, table, LENS, d**-0.5)
    torch.testing.assert_close(out.double(), expect, **TOL[dtype])


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_decode_triton_without_prefetch(pa: ModuleType, kv_dtype: torch.dtype) -> None:
    """Large batches skip the L2 prefetch before the PDL wait (decode_prefetch); the prefetch
    only moves data into L2, so both launches give the same bits, and match float64 (FP8: over
    the codes times their scales)."""
    q, kc, vc, table, ctx = make_paged(LENS, 32, 8, 128, 16, torch.bfloat16)
    ks = vs = None
    if kv_dtype != torch.bfloat16:
        # Per-(block, head) scales that map each block's largest value to FP8's largest.
        ks = kc.float().abs().amax(dim=(1, 3)).contiguous() / 448 + 1e-6
        vs = vc.float().abs().amax(dim=(1, 3)).contiguous() / 448 + 1e-6
        kc = (kc.float() / ks[:, None, :, None]).to(kv_dtype)
        vc = (vc.float() / vs[:, None, :, None]).to(kv_dtype)
    runs = [
        pa.paged_attention_decode_triton(
            q, kc, vc, table, ctx, 128**-0.5, k_scale=ks, v_scale=vs, prefetch=prefetch
        )
        for prefetch in (True, False)
    ]
    assert torch.equal(runs[0], runs[1])
    if ks is not None:  # the codes times their scales: what the kernel should attend over
        kc = kc.double() * ks.double()[:, None, :, None]
        vc = vc.double() * vs.double()[:, None, :, None]
    expect = attention_decode_f64(q, kc, vc, table, LENS, 128**-0.5)
    torch.testing.assert_close(runs[1].double(), expect, **TOL[torch.bfloat16])


@pytest.mark.parametrize(
    "code, seqs, tiling",
    [
        (torch.float8_e4m3fn, 36, (1024, 128)),
        (torch.int8, 24, (512, 128)),
        (torch.int8, 36, (512, 32)),
    ],
    ids=["fp8", "int8-b24", "int8-b36"],
)
def test_decode_triton_one_byte_engine_tiling(
    pa: ModuleType, code: torch.dtype, seqs: int, tiling: tuple[int, int]
) -> None:
    """The tilings the engine takes over an FP8 or INT8 cache past the smallest batches (8 kv
    heads: 24 sequences are 192 pairs, 36 are 288), no prefetch, against float64 over the codes
    times their scales."""
    from tandem.layers.attention import decode_tiling

    lens = ([1, 100, 300, 17, 1500, 64] * 6)[:seqs]
    q, kc, vc, table, ctx = make_paged(lens, 32, 8, 128, 16, torch.bfloat16)
    top = 448 if code == torch.float8_e4m3fn else 127
    ks = kc.float().abs().amax(dim=(1, 3)).contiguous() / top + 1e-6
    vs = vc.float().abs().amax(dim=(1, 3)).contiguous() / top + 1e-6
    kc, vc = kc.float() / ks[:, None, :, None], vc.float() / vs[:, None, :, None]
    if code == torch.int8:
        kc, vc = kc.round().clamp(-127, 127), vc.round().clamp(-127, 127)
    kc, vc = kc.to(code), vc.to(code)
    ps, n = decode_tiling(len(lens), 8, code)
    assert (ps, n) == tiling
    out = pa.paged_attention_decode_triton(
        q, kc, vc, table, ctx, 128**-0.5, partition_size=ps, block_n=n, prefetch=False,
        k_scale=ks, v_scale=vs,
    )  # fmt: skip
    kd = kc.double() * ks.double()[:, None, :, None]
    vd = vc.double() * vs.double()[:, None, :, None]
    expect = attention_decode_f64(q, kd, vd, table, lens, 128**-0.5)
    torch.testing.assert_close(out.double(), expect, **TOL[torch.bfloat16])


@pytest.mark.parametrize("bs", [8, 32])
def test_decode_triton_other_block_sizes(pa: ModuleType, bs: int) -> None:
    q, kc, vc, table, ctx = make_paged(LENS, 32, 8, 128, bs, torch.bfloat16)
    out = pa.paged_attention_decode_triton(q, kc, vc, table, ctx, 128**-0.5)
    expect = attention_decode_f64(q, kc, vc, table, LENS, 128**-0.5)
    torch.testing.assert_close(out.double(), expect, **TOL[torch.bfloat16])


def test_decode_triton_fp32_single_partition(pa: ModuleType) -> None:
    lens = [1, 100, 300, 17]
    q, kc, vc, table, ctx = make_paged(lens, 32, 8, 128, 16, torch.float32)
    out = pa.paged_attention_decode_triton(q, kc, vc, table, ctx, 128**-0.5, max_context_len=300)
    expect = attention_decode_f64(q, kc, vc, table, lens, 128**-0.5)
    torch.testing.assert_close(out.double(), expect, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_decode_ref_matches_f64(pa: ModuleType, dtype: torch.dtype) -> None:
    q, kc, vc, table, ctx = make_paged(LENS, 32, 8, 128, 16, dtype)
    out = pa_ref.paged_attention_decode_ref(q, kc, vc, table, ctx, 128**-0.5)
    expect = attention_decode_f64(q, kc, vc, table, LENS, 128**-0.5)
    torch.testing.assert_close(out.double(), expect, **TOL[dtype])


def test_decode_dispatch_uses_triton_on_cuda(pa: ModuleType) -> None:
    q, kc, vc, table, ctx = make_paged(LENS, 32, 8, 128, 16, torch.bfloat16)
    got = pa.paged_attention_decode(q, kc, vc, table, ctx, 128**-0.5)
    assert torch.equal(got, pa.paged_attention_decode_triton(q, kc, vc, table, ctx, 128**-0.5))


def test_decode_triton_cuda_graph_replay(pa: ModuleType) -> None:
    # Captured once with a fixed bound; replays see new lengths and tables written in place.
    lens = [5, 1000, 1, 0]  # 0: a padding slot of the captured batch
    q, kc, vc, table, ctx = make_paged(lens, 32, 8, 128, 16, torch.bfloat16)
    static_q = q.clone()

    def step() -> torch.Tensor:
        return pa.paged_attention_decode_triton(
            static_q, kc, vc, table, ctx, 128**-0.5, max_context_len=1024
        )

    from tandem.engine.cuda_graphs import capture_graph

    graph, static_out = capture_graph(step)  # compiled outside the capture

    for new_lens in ([6, 901, 2, 0], [700, 3, 1000, 0]):
        need = max((n + 15) // 16 for n in new_lens)
        assert need <= table.shape[1]
        ctx.copy_(torch.tensor(new_lens, dtype=torch.int32))
        table.copy_(table.flip(0))  # other sequences' blocks: a changed table, same shape
        static_q.copy_(torch.randn_like(static_q))
        graph.replay()
        torch.cuda.synchronize()
        expect = attention_decode_f64(static_q, kc, vc, table, new_lens, 128**-0.5)
        torch.testing.assert_close(static_out.double(), expect, **TOL[torch.bfloat16])
        assert torch.equal(static_out[3], torch.zeros_like(static_out[3]))


def test_decode_triton_pool_beyond_int32_offsets(pa: ModuleType) -> None:
    # Element offsets past 2**31 in the cache: the kernel must index in int64.
    num_blocks, bs, hkv, d = 140_000, 16, 8, 128  # 2.3e9 elements per cache, 4.6 GB in bf16
    need_bytes = 2 * num_blocks * bs * hkv * d * 2
    if torch.cuda.mem_get_info()[0] < need_bytes + (2 << 30):
        pytest.skip("not enough free GPU memory for a >2**31-element pool")
    kc = torch.empty(num_blocks, bs, hkv, d, dtype=torch.bfloat16, device=DEV)
    vc = torch.empty_like(kc)
    lens = [40, 33]
    table = torch.tensor([[num_blocks - 1, 5, num_blocks - 2], [num_blocks - 3, 0, 0]], device=DEV)
    table = table.int()
    for blk in (num_blocks - 1, num_blocks - 2, num_blocks - 3, 5, 0):
        kc[blk].normal_()
        vc[blk].normal_()
    q = torch.randn(2, 32, d, device=DEV, dtype=torch.bfloat16)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = pa.paged_attention_decode_triton(q, kc, vc, table, ctx, d**-0.5)
    expect = attention_decode_f64(q, kc, vc, table, lens, d**-0.5)
    torch.testing.assert_close(out.double(), expect, **TOL[torch.bfloat16])


@pytest.mark.parametrize(
    "x_dtype, w_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float32),
    ],
    ids=["bf16", "fp16", "bf16-fp32-weight"],
)
@pytest.mark.parametrize("hidden", [576, 4096, 8192])
def test_rmsnorm_matches_llama_module(
    rn: ModuleType, x_dtype: torch.dtype, w_dtype: torch.dtype, hidden: int
) -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    g = torch.Generator(device=DEV).manual_seed(0)
    x = (torch.randn(64, hidden, generator=g, device=DEV) * 4).to(x_dtype)
    res = (torch.randn(64, hidden, generator=g, device=DEV) * 4).to(x_dtype)
    module = llama.LlamaRMSNorm(hidden, eps=1e-5).to(DEV)
    with torch.no_grad():
        module.weight.copy_(torch.rand(hidden, generator=g, device=DEV) + 0.5)
    module = module.to(w_dtype)
    w = module.weight.detach()
    with torch.no_grad():
        expect_res = x + res
        expect = module(expect_res)
        expect_plain = module(x)

    out, new_res = rn.rmsnorm_triton(x, w, 1e-5, res)
    assert out.dtype == expect.dtype
    assert torch.equal(new_res, expect_res)
    # Only the float32 summation order differs from torch's mean, which now and then moves a
    # value across a rounding boundary (one ulp of the activation dtype); a wrong cast order
    # changes about a quarter of the elements.
    ulp_tol = dict(rtol=2 * torch.finfo(x_dtype).eps, atol=1e-5)
    torch.testing.assert_close(out, expect, **ulp_tol)
    assert (out != expect).float().mean().item() < 0.01

    out, same = rn.rmsnorm_triton(x, w, 1e-5)
    assert same is x
    torch.testing.assert_close(out, expect_plain, **ulp_tol)
    assert (out != expect_plain).float().mean().item() < 0.01

    ref_out, ref_res = rn.rmsnorm_ref(x, w, 1e-5, res)
    assert torch.equal(ref_res, expect_res) and torch.equal(ref_out, expect)
    got = rn.rmsnorm(x, w, 1e-5, res)  # the dispatcher takes the Triton path on CUDA
    assert torch.equal(got[0], rn.rmsnorm_triton(x, w, 1e-5, res)[0])


def test_rmsnorm_triton_fp32_matches_f64(rn: ModuleType) -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(3, 5, 4096, generator=g, device=DEV)
    res = torch.randn(3, 5, 4096, generator=g, device=DEV)
    w = torch.rand(4096, generator=g, device=DEV) + 0.5
    out, new_res = rn.rmsnorm_triton(x, w, 1e-6, res)
    h = x.double() + res.double()
    expect = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(out.double(), expect, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_res.double(), h, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "hq, hkv, d", [(32, 8, 128), (12, 4, 64), (9, 3, 64)], ids=["gqa4", "gqa3-d64", "gqa3-odd"]
)
def test_varlen_triton_matches_f64(
    pa_varlen: ModuleType, dtype: torch.dtype, hq: int, hkv: int, d: int
):
    # whole prompts, chunks after a cached prefix, a verification of 5 positions, no queries
    lens = [300, 1000, 77, 513, 40]
    q_lens = [300, 129, 5, 0, 40]
    _, kc, vc, table, _ = make_paged(lens, hq, hkv, d, 16, dtype)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], hq, d, device=DEV).to(dtype)
    out = pa_varlen.paged_attention_varlen_triton(q, kc, vc, table, starts, lens, d**-0.5)
    expect = attention_varlen_f64(q, kc, vc, table, starts, lens, d**-0.5)
    torch.testing.assert_close(out.double(), expect, **TOL[dtype])
    ref = pa_ref.paged_attention_varlen_ref(q, kc, vc, table, starts, lens, d**-0.5)
    torch.testing.assert_close(ref.double(), expect, **TOL[dtype])
