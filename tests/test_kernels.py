"""Triton kernels against independent float64 references, on CPU under the Triton interpreter.

The interpreter must be chosen before triton.jit runs, hence the environment variable set before
any import (the Makefile's test target sets it too). Shapes are small: the interpreter runs each
program in Python.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from conftest import require_interpreter  # noqa: E402

from tandem.kernels import paged_attention as pa  # noqa: E402
from tandem.kernels import paged_attention_ref as pa_ref  # noqa: E402
from tandem.kernels import paged_attention_varlen as pa_varlen  # noqa: E402
from tandem.kernels import rmsnorm as rn  # noqa: E402
from tests.kernel_checks import (  # noqa: E402
    attention_decode_f64,
    attention_varlen_f64,
    make_paged,
)


@pytest.fixture(autouse=True)
def _require_interpreter() -> None:
    """Explain, rather than crash inside triton, when triton was imported in compiled mode.
    (triton.jit picks interpreter or compiler when a function is decorated, triton's own library
    included, so the choice is fixed by whoever imported triton first.)"""
    require_interpreter(tl.sum, pa._decode_partition_kernel, pa._decode_reduce_kernel,
                        pa_varlen._varlen_kernel, rn._rmsnorm_kernel)  # fmt: skip


# (context_lens, Hq, Hkv, head_dim, block_size, partition_size)
DECODE_CASES = [
    # GQA 1; a length-1 context; lengths not multiples of the block; 2 partitions.
    pytest.param([1, 17, 40], 4, 4, 64, 16, 32, id="gqa1-len1-2parts"),
    # GQA 3 (a group that is not a power of 2); up to 4 partitions.
    pytest.param([5, 33, 100, 1], 6, 2, 64, 16, 32, id="gqa3-4parts"),
    # GQA 4, head_dim 128, a partition boundary crossed by one token.
    pytest.param([16, 64, 129], 8, 2, 128, 16, 64, id="gqa4-d128"),
    # GQA 4, everything in one partition: stage 1 writes the output itself.
    pytest.param([3, 50, 77], 8, 2, 64, 16, 512, id="gqa4-single-partition"),
    # GQA 8, block size 8 (an iteration spans two blocks).
    pytest.param([9, 31, 70], 8, 1, 64, 8, 16, id="gqa8-bs8"),
    # GQA 3, block size 32 with partitions smaller than a block.
    pytest.param([9, 31, 70], 6, 2, 64, 32, 16, id="gqa3-bs32-small-partitions"),
]


@pytest.mark.parametrize("lens, hq, hkv, d, bs, ps", DECODE_CASES)
def test_decode_triton_matches_f64(
    lens: list[int], hq: int, hkv: int, d: int, bs: int, ps: int
) -> None:
    q, kc, vc, table, ctx = make_paged(lens, hq, hkv, d, bs, torch.float32, extra_table_cols=2)
    scale = d**-0.5
    out = pa.paged_attention_decode_triton(q, kc, vc, table, ctx, scale, partition_size=ps)
    assert out.shape == (len(lens), hq, d) and out.dtype == torch.float32
    expect = attention_decode_f64(q, kc, vc, table, lens, scale)
    torch.testing.assert_close(out.double(), expect, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ps", [16, 32])
def test_decode_merge_by_the_last_partition(ps: int) -> None:
    """The merge done by stage 1's last program (default) equals the second kernel's, over more
    partitions than one merge step takes (over 32 of 16 tokens for the longest context: the
    second kernel's loop) and over fewer (about 20 of 32: its single tile), and leaves its
    counters at zero."""
    from tandem.kernels.arrival import arrival_counters

    lens = [300, 5, 129, 0, 660]
    q, kc, vc, table, ctx = make_paged(lens, 6, 2, 64, 16, torch.float32, extra_table_cols=1)
    fused = pa.paged_attention_decode_triton(q, kc, vc, table, ctx, 0.125, partition_size=ps)
    assert not arrival_counters(q.device, 8)[:8].any()
    two = pa.paged_attention_decode_triton(
        q, kc, vc, table, ctx, 0.125, partition_size=ps, merge_last=False
    )
    expect = attention_decode_f64(q, kc, vc, table, lens, 0.125)
    torch.testing.assert_close(fused.double(), expect, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused, two, atol=1e-6, rtol=1e-6)
    assert torch.equal(fused[3], torch.zeros_like(fused[3]))


@pytest.mark.parametrize(
    "ps, merge_last", [(512, True), (16, True), (16, False)], ids=["direct", "merge-last", "reduce"]
)
def test_decode_writes_the_output_permuted(ps: int, merge_last: bool) -> None:
    """With `out_index` each output row is stored permuted (an act-order o_proj's input order)
    by every path that writes it: the single partition, the last partition's merge and the
    second kernel; the values are the unpermuted output's, bit for bit."""
    lens = [40, 7, 130]
    q, kc, vc, table, ctx = make_paged(lens, 6, 2, 64, 16, torch.float32)
    perm = torch.randperm(6 * 64, generator=torch.Generator().manual_seed(1))
    inv = torch.argsort(perm).to(torch.int32)
    plain = pa.paged_attention_decode_triton(
        q, kc, vc, table, ctx, 0.125, partition_size=ps, merge_last=merge_last
    )
    out = pa.paged_attention_decode_triton(
        q, kc, vc, table, ctx, 0.125, partition_size=ps, merge_last=merge_last, out_index=inv
    )
    assert torch.equal(out.view(3, -1), plain.view(3, -1)[:, perm])
    with pytest.raises(ValueError, match="out_index must be int32"):
        pa.paged_attention_decode_triton(q, kc, vc, table, ctx, 0.125, out_index=perm)


def test_decode_triton_max_context_len_bounds_partitions() -> None:
    # A wide table (room for 256 tokens) but a host-known bound of 70: 3 partitions of 32.
    lens = [70, 2, 33]
    q, kc, vc, table, ctx = make_paged(lens, 6, 2, 64, 16, torch.float32, extra_table_cols=10)
    out = pa.paged_attention_decode_triton(
        q, kc, vc, table, ctx, 0.125, partition_size=32, max_context_len=70
    )
    expect = attention_decode_f64(q, kc, vc, table, lens, 0.125)
    torch.testing.assert_close(out.double(), expect, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ps", [16, 512])
def test_decode_triton_empty_context_gives_zeros(ps: int) -> None:
    # Padding slots of a captured batch have no context: zeros, and the neighbours are unaffected.
    lens = [0, 37, 0]
    q, kc, vc, table, ctx = make_paged(lens, 4, 2, 64, 16, torch.float32)
    out = pa.paged_attention_decode_triton(q, kc, vc, table, ctx, 0.125, partition_size=ps)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    expect = attention_decode_f64(q, kc, vc, table, lens, 0.125)
    torch.testing.assert_close(out[1].double(), expect[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)], ids=["fp16", "bf16"]
)
def test_decode_triton_half_precision(dtype: torch.dtype, tol: float) -> None:
    lens = [1, 45, 100]
    q, kc, vc, table, ctx = make_paged(lens, 8, 2, 64, 16, dtype)
    out = pa.paged_attention_decode_triton(q, kc, vc, table, ctx, 0.125, partition_size=32)
    assert out.dtype == dtype
    expect = attention_decode_f64(q, kc, vc, table, lens, 0.125)
    torch.testing.assert_close(out.double(), expect, atol=tol, rtol=tol)


@pytest.mark.parametrize("lens, hq, hkv, d, bs, ps", DECODE_CASES[:3])
def test_decode_ref_matches_f64(
    lens: list[int], hq: int, hkv: int, d: int, bs: int, ps: int
) -> None:
    q, kc, vc, table, ctx = make_paged(lens, hq, hkv, d, bs, torch.float32, extra_table_cols=2)
    out = pa_ref.paged_attention_decode_ref(q, kc, vc, table, ctx, d**-0.5)
    expect = attention_decode_f64(q, kc, vc, table, lens, d**-0.5)
    torch.testing.assert_close(out.double(), expect, atol=1e-4, rtol=1e-4)


def test_decode_dispatch_uses_reference_on_cpu() -> None:
    q, kc, vc, table, ctx = make_paged([5, 40], 6, 2, 64, 16, torch.float32)
    got = pa.paged_attention_decode(q, kc, vc, table, ctx, 0.125)
    assert torch.equal(got, pa_ref.paged_attention_decode_ref(q, kc, vc, table, ctx, 0.125))


def test_varlen_ref_matches_f64() -> None:
    # Prefill (q_len == context), chunked prefill / verification (q_len < context), and a
    # sequence with no queries this step.
    lens, q_lens = [7, 40, 20, 33], [7, 5, 0, 1]
    _, kc, vc, table, _ = make_paged(lens, 6, 2, 64, 16, torch.float32, extra_table_cols=1)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], 6, 64, generator=torch.Generator().manual_seed(1))
    out = pa_ref.paged_attention_varlen_ref(q, kc, vc, table, starts, lens, 0.125)
    expect = attention_varlen_f64(q, kc, vc, table, starts, lens, 0.125)
    torch.testing.assert_close(out.double(), expect, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "lens, q_lens",
    [
        # Decodes of several lengths beside a whole prompt, a chunk after a cached prefix, a
        # sequence with no queries and a verification of 3 positions.
        ([9, 40, 20, 33, 1, 17, 64], [1, 1, 0, 3, 1, 17, 5]),
        ([5, 30], [1, 30]),  # one decode: nothing to batch
        ([12, 50, 3], [1, 1, 1]),  # decodes only, as a verification step can leave them
    ],
)
def test_cpu_varlen_batches_the_decodes_of_a_mixed_step_and_matches_f64(lens, q_lens) -> None:
    from tandem.layers.attention import AttentionMetadata, CpuVarlenAttention

    _, kc, vc, table, ctx = make_paged(lens, 6, 2, 64, 16, torch.float32, extra_table_cols=2)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], 6, 64, generator=torch.Generator().manual_seed(7))
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long),
        block_tables=table,
        context_lens=ctx,
        context_lens_list=lens,
        query_start_loc=starts,
        decode_only=False,
    )
    attn = CpuVarlenAttention(meta, 16)
    assert (attn.decode is not None) == (q_lens.count(1) > 1)
    got = attn(q, torch.stack([kc, vc]), 0.125)
    expect = attention_varlen_f64(q, kc, vc, table, starts, lens, 0.125)
    torch.testing.assert_close(got.double(), expect, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "lens, groups",
    [
        (
            [700] + [9, 40, 20, 33, 1, 17, 64] * 2,
            [[700], [64, 64, 40, 40, 33, 33, 20, 20, 17, 17, 9, 9, 1, 1]],
        ),  # fmt: skip
        ([300, 290, 280, 5, 6], [[300, 290, 280, 6, 5]]),  # padding the two costs too little
        # 600 and 30 split would save 4 x 570 padded tokens: too few for a group of its own.
        ([1500, 600, 30, 30, 30, 30], [[1500], [600, 30, 30, 30, 30]]),
        ([48, 48, 48], [[48, 48, 48]]),  # one length: no mask
    ],
)
def test_cpu_decode_pads_each_sequence_to_its_groups_longest_and_matches_f64(lens, groups):
    """A long context beside short ones: the short ones are padded to the longest of their own
    group, not to the long one, and every row still equals float64."""
    from tandem.layers.attention import AttentionMetadata, CpuDecodeAttention

    q, kc, vc, table, ctx = make_paged(lens, 6, 2, 64, 16, torch.float32, extra_table_cols=2)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.long),
        block_tables=table,
        context_lens=ctx,
        context_lens_list=lens,
        query_start_loc=list(range(len(lens) + 1)),
        decode_only=True,
    )
    attn = CpuDecodeAttention(meta, 16)
    got_groups = [
        [lens[i] for i in (g.rows.tolist() if g.rows is not None else range(len(lens)))]
        for g in attn.groups
    ]
    assert [sorted(g, reverse=True) for g in got_groups] == groups
    assert [g.length for g in attn.groups] == [max(g) for g in groups]
    assert [g.mask is None for g in attn.groups] == [len(set(g)) == 1 for g in groups]
    got = attn(q, torch.stack([kc, vc]), 0.125)
    expect = attention_decode_f64(q, kc, vc, table, lens, 0.125)
    torch.testing.assert_close(got.double(), expect, atol=1e-4, rtol=1e-4)


# (context_lens, q_lens, Hq, Hkv, head_dim, block_size, block_m, block_n)
VARLEN_CASES = [
    # Whole prompts (q_len == context), a chunk after a cached prefix, a sequence without queries,
    # a verification of k + 1 = 4 positions; GQA 3 (group not a power of 2).
    pytest.param([7, 40, 20, 33], [7, 5, 0, 4], 6, 2, 64, 16, 4, 16, id="gqa3-mixed"),
    # GQA 1, tiles of 16 queries, a prompt longer than a tile and an iteration spanning blocks.
    pytest.param([37, 16], [37, 16], 4, 4, 32, 8, 16, 16, id="gqa1-prefill"),
    # GQA 4, head_dim 128, block size 32, a long context with a short chunk at its end.
    pytest.param([100, 3], [9, 3], 8, 2, 128, 32, 4, 32, id="gqa4-d128-chunk"),
]


@pytest.mark.parametrize("lens, q_lens, hq, hkv, d, bs, bm, bn", VARLEN_CASES)
def test_varlen_triton_matches_f64(
    lens: list[int], q_lens: list[int], hq: int, hkv: int, d: int, bs: int, bm: int, bn: int
) -> None:
    _, kc, vc, table, _ = make_paged(lens, hq, hkv, d, bs, torch.float32, extra_table_cols=1)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], hq, d, generator=torch.Generator().manual_seed(len(lens)))
    expect = attention_varlen_f64(q, kc, vc, table, starts, lens, d**-0.5)
    got = pa_varlen.paged_attention_varlen_triton(
        q, kc, vc, table, starts, lens, d**-0.5, block_m=bm, block_n=bn
    )
    assert got.shape == q.shape and not got.isnan().any()
    torch.testing.assert_close(got.double(), expect, atol=1e-4, rtol=1e-4)
    # The offsets as the engine sends them: int32 views into one buffer of its step inputs.
    words = torch.zeros(64, dtype=torch.int64)
    words.view(torch.int32)[32 : 32 + len(starts)] = torch.tensor(starts)
    words.view(torch.int32)[64 : 64 + len(lens)] = torch.tensor(lens)
    offsets = (
        words[16:32].view(torch.int32)[: len(starts)],
        words[32:].view(torch.int32)[: len(lens)],
    )
    again = pa_varlen.paged_attention_varlen_triton(
        q, kc, vc, table, starts, lens, d**-0.5, block_m=bm, block_n=bn, device_offsets=offsets
    )
    assert torch.equal(again, got)
    shifted = (offsets[0], offsets[1] + 1)  # the kernel reads the lens given, not the list's
    assert not torch.equal(
        pa_varlen.paged_attention_varlen_triton(
            q, kc, vc, table, starts, lens, d**-0.5, block_m=bm, block_n=bn, device_offsets=shifted
        ),
        got,
    )


def test_varlen_triton_scaled_cache_matches_f64() -> None:
    """An INT8-style cache: codes times per-(block, head) scales, dequantized as it is read."""
    lens = [21, 9]
    _, kc, vc, table, _ = make_paged(lens, 4, 2, 32, 8, torch.float32)
    g = torch.Generator().manual_seed(3)
    kq, vq = kc.round().clamp(-8, 8), vc.round().clamp(-8, 8)
    ks = torch.rand(kc.shape[0], 2, generator=g) + 0.1
    vs = torch.rand(kc.shape[0], 2, generator=g) + 0.1
    starts = [0, 6, 15]
    q = torch.randn(15, 4, 32, generator=g)
    expect = attention_varlen_f64(
        q, kq * ks[:, None, :, None], vq * vs[:, None, :, None], table, starts, lens, 0.2
    )
    got = pa_varlen.paged_attention_varlen_triton(q, kq, vq, table, starts, lens, 0.2, ks, vs, 4, 8)
    torch.testing.assert_close(got.double(), expect, atol=1e-4, rtol=1e-4)


def test_varlen_triton_rejects_more_queries_than_context() -> None:
    _, kc, vc, table, _ = make_paged([4], 4, 2, 32, 8, torch.float32)
    q = torch.randn(5, 4, 32)
    with pytest.raises(ValueError, match="more queries than cached tokens"):
        pa_varlen.paged_attention_varlen_triton(q, kc, vc, table, [0, 5], [4], 0.2)


# ---------------------------------------------------------------------------------------------
# RMSNorm


def rmsnorm_f64(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (+ residual) / sqrt(mean(x^2) + eps) * weight, in float64 and without intermediate casts."""
    h = x.double() if residual is None else x.double() + residual.double()
    return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double(), h


@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 96), (4, 576)], ids=["2d", "3d", "smollm"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rmsnorm_triton_matches_f64(shape: tuple[int, ...], with_residual: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3
    w = torch.rand(shape[-1], generator=g) + 0.5
    res = torch.randn(shape, generator=g) if with_residual else None
    out, new_res = rn.rmsnorm_triton(x, w, 1e-6, res)
    expect, expect_res = rmsnorm_f64(x, w, 1e-6, res)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expect, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_res.double(), expect_res, atol=1e-6, rtol=1e-6)
    ref_out, ref_res = rn.rmsnorm_ref(x, w, 1e-6, res)
    torch.testing.assert_close(ref_out.double(), expect, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref_res.double(), expect_res, atol=1e-6, rtol=1e-6)
    if not with_residual:
        assert new_res is x  # no copy when there is nothing to add


@pytest.mark.parametrize(
    "x_dtype, w_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float32),
    ],
    ids=["bf16", "fp16", "bf16-fp32-weight"],
)
def test_rmsnorm_matches_llama_module(x_dtype: torch.dtype, w_dtype: torch.dtype) -> None:
    # Same rounding points as transformers' LlamaRMSNorm after the decoder's residual add.
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    g = torch.Generator().manual_seed(0)
    hidden = 576
    x = (torch.randn(8, hidden, generator=g) * 4).to(x_dtype)
    res = (torch.randn(8, hidden, generator=g) * 4).to(x_dtype)
    module = llama.LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(torch.rand(hidden, generator=g) + 0.5)
    module = module.to(w_dtype)
    w = module.weight.detach()
    with torch.no_grad():
        expect_res = x + res
        expect = module(expect_res)

    ref_out, ref_res = rn.rmsnorm_ref(x, w, 1e-5, res)
    assert ref_out.dtype == expect.dtype
    assert torch.equal(ref_res, expect_res) and torch.equal(ref_out, expect)

    out, new_res = rn.rmsnorm_triton(x, w, 1e-5, res)
    assert out.dtype == expect.dtype and new_res.dtype == x_dtype
    if x_dtype == torch.bfloat16:
        # The interpreter truncates float32 -> bf16 instead of rounding to nearest even, so each
        # cast may land one bf16 ulp (<= 2**-7 relative) off; tests/gpu checks exact rounding.
        torch.testing.assert_close(new_res, expect_res, rtol=2**-6, atol=0)
        torch.testing.assert_close(out, expect, rtol=3 * 2**-7, atol=1e-3)
        return
    assert torch.equal(new_res, expect_res)
    # Only the float32 summation order differs from torch's mean, which now and then moves a
    # value across a rounding boundary (one ulp); a wrong cast order changes about a quarter.
    torch.testing.assert_close(out, expect, rtol=2 * torch.finfo(x_dtype).eps, atol=1e-5)
    assert (out != expect).float().mean().item() < 0.01


def test_rmsnorm_dispatch_uses_reference_on_cpu() -> None:
    x, res, w = torch.randn(3, 64), torch.randn(3, 64), torch.rand(64)
    got = rn.rmsnorm(x, w, 1e-6, res)
    ref = rn.rmsnorm_ref(x, w, 1e-6, res)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("bits, group, n_major", [(8, 128, False), (4, 32, True), (4, 64, False)])
def test_embedding_lookup_of_a_quantized_table_equals_torch_dequantize(bits, group, n_major):
    """The one-pass lookup of a quantized embedding (`embed_dequant_triton`) gives the torch
    path's rows bit for bit (gather, code * scale, + min, cast), row-major or N-major codes, a
    row width that is not a multiple of the block, repeated ids; ids past the table give zero
    rows; bad inputs are named."""
    from tandem.formats.weight import permute_rows, quantize_rtn
    from tandem.kernels.embedding import embed_dequant_triton
    from tandem.kernels.w4a16 import n_major as to_n_major

    g = torch.Generator().manual_seed(bits + group)
    w = quantize_rtn(torch.randn(50, 1216, generator=g), bits, group)
    if n_major:
        w = to_n_major(w)
    ids = torch.tensor([3, 49, 0, 3, 17])
    for dtype in (torch.float16, torch.float32):
        got = embed_dequant_triton(w, ids, dtype)
        want = permute_rows(w, ids).dequantize(dtype)
        assert got.dtype == dtype and torch.equal(got, want)
    ref = w.dequantize(torch.float64)[ids]  # and the values themselves
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
    out = embed_dequant_triton(w, torch.tensor([50, 2]), torch.float32)
    assert torch.equal(out[0], torch.zeros(1216))
    assert torch.equal(out[1], permute_rows(w, torch.tensor([2])).dequantize(torch.float32)[0])
    empty = embed_dequant_triton(w, torch.tensor([], dtype=torch.long), torch.float32)
    assert empty.shape == (0, 1216)
    with pytest.raises(ValueError, match="ids must be a 1-D integer tensor"):
        embed_dequant_triton(w, ids.float(), torch.float32)
