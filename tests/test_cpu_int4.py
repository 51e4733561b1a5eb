"""The CPU INT4 kernel path (tandem.kernels.cpu_int4) against float64 references, and GGUF Q8_0
blocks loaded as codes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.formats.gguf import q8_0_to_quantized
from tandem.formats.weight import quantize_rtn
from tandem.kernels import cpu_int4
from tandem.layers.linear import cpu_linear, pack_cpu_weight


@pytest.mark.parametrize(
    "bits,group,n,k,rows",
    [(4, 32, 960, 576, 1), (4, 32, 96, 576, 8), (8, 32, 200, 576, 1), (4, 128, 50, 200, 3)],
)
def test_kernel_matches_float64_reference(bits: int, group: int, n: int, k: int, rows: int):
    """The kernel computes with the weight as stored (bf16 scales and zeros) and x rounded to
    bfloat16; only its float32 summation order and the bfloat16 output rounding differ."""
    g = torch.Generator().manual_seed(bits * n + k)
    qw = quantize_rtn(torch.randn(n, k, generator=g), bits, group)
    cw = cpu_int4.pack_int4_cpu(qw)
    assert (cw.out_features, cw.in_features, cw.halves) == (n, k, 1 if bits == 4 else 2)
    x = torch.randn(rows, k, generator=g)
    with torch.inference_mode():
        got = cpu_int4.int4_linear_cpu(x, cw)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    codes = qw.codes()
    if bits == 8:
        codes = torch.cat([codes >> 4, codes & 0xF], dim=1)
    want = cpu_int4.int4_linear_ref(x, cw, codes)
    # bfloat16 output: half an ulp of 8 bits, on the largest values of the row.
    atol = 2**-8 * want.abs().amax(dim=-1, keepdim=True)
    assert ((got.double() - want).abs() <= atol).all()
    # The stored grid is the QuantizedWeight's up to the bfloat16 rounding of scales and zeros.
    exact = qw.dequantize(torch.float64)
    grid = cpu_int4.dequantize_int4_cpu(cw, codes)
    if bits == 8:
        grid = grid[:, : grid.shape[1] // 2] + grid[:, grid.shape[1] // 2 :]
    kp = qw.padded_in_features
    err = (grid[:, :k] - exact).abs()
    assert (err <= 2**-8 * exact.abs().amax() + 1e-6).all()
    assert kp == grid.shape[1]


def test_cpu_linear_packs_quantized_weights_and_adds_bias():
    g = torch.Generator().manual_seed(0)
    qw = quantize_rtn(torch.randn(64, 96, generator=g), 4, 32)
    packed = pack_cpu_weight(qw)
    assert isinstance(packed, cpu_int4.CpuInt4Weight)
    x = torch.randn(2, 96, generator=g)
    b = torch.randn(64, generator=g)
    with torch.inference_mode():
        y = cpu_linear(x, packed, b)
    ref = x.double() @ qw.dequantize(torch.float64).t() + b.double()
    assert ((y.double() - ref).abs() <= 2**-7 * ref.abs().amax()).all()
    odd = quantize_rtn(torch.randn(64, 96, generator=g), 4, 64)
    odd.group_size = 48  # not a group size the CPU kernel takes: left as it is
    assert pack_cpu_weight(odd) is odd


def test_q8_0_blocks_load_as_identical_codes():
    import gguf

    g = np.random.default_rng(0)
    w = g.standard_normal((6, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
    qw = q8_0_to_quantized(raw, 6, 64)
    assert (qw.bits, qw.group_size, qw.zero_point) == (8, 32, False)
    assert torch.equal(qw.dequantize(torch.float32), torch.from_numpy(want))


def test_lm_head_recomputes_the_best_logits_in_float32():
    """INT4-kernel logits are bfloat16; the LOGIT_REFINE best of each row are float32-exact."""
    from tandem.layers.embedding import LOGIT_REFINE, cpu_logits

    g = torch.Generator().manual_seed(3)
    qw = quantize_rtn(torch.randn(4096, 64, generator=g), 8, 32, zero_point=False)
    x = 4 * torch.randn(3, 64, generator=g)
    with torch.inference_mode():
        got = cpu_logits(x, pack_cpu_weight(qw), qw)
    exact = x.double() @ qw.dequantize(torch.float64).t()
    best = exact.topk(LOGIT_REFINE // 2, dim=-1).indices
    assert torch.allclose(got.gather(1, best).double(), exact.gather(1, best), rtol=0, atol=1e-4)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    assert ((got.double() - exact).abs() <= 2**-7 * exact.abs().amax()).all()
