"""The tensor-core INT4 GEMV (`_gemv_tc_kernel`, 16 to 64 rows per program) against float64, on
CUDA.

Ragged N and K (masked tiles), K splits that leave a partial last split, M from 1 to past one
16-row block, group sizes 64 and 128; inside a CUDA graph (with programmatic dependent launch
where the GPU has it) replays equal eager calls bit for bit.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from tests.kernel_checks import compiled_kernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
TOL = 1e-2  # bf16 output: relative 2**-9 per value; the products are exact, sums in float32


@pytest.fixture(scope="module")
def wk() -> ModuleType:
    return compiled_kernel("w4a16")


def _weight(wk, n: int, k: int, group: int, seed: int):
    from tandem.formats.weight import quantize_rtn

    g = torch.Generator(device=DEV).manual_seed(seed)
    return wk.n_major(quantize_rtn(torch.randn(n, k, generator=g, device=DEV) * 0.05, 4, group))


def _poison() -> None:
    """Fill freed blocks of the caching allocator with NaN, so an output element the kernel
    failed to write shows up as NaN rather than as a stale value."""
    junk = torch.full((64 << 20,), float("nan"), device=DEV)
    del junk


def _check(wk, x, qw, cfg) -> torch.Tensor:
    ref = x.double() @ qw.dequantize(torch.float64).T
    _poison()
    out = wk.w4a16_matmul_triton(x, qw, cfg)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert not out.isnan().any(), "unwritten or NaN outputs"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < TOL, err
    return out


@pytest.mark.parametrize("m", [1, 2, 7, 16, 17, 40])
@pytest.mark.parametrize(
    "n, k, group",
    [
        (4096, 4096, 128),
        (1000, 4096 + 128 + 64, 64),
        (3000, 1536, 128),
        (640, 160, 128),  # the last group partial (K padded), as in small models
        (512, 64, 128),  # K under one group
    ],
)
def test_gemv_tc_matches_f64(wk, m: int, n: int, k: int, group: int) -> None:
    qw = _weight(wk, n, k, group, seed=m + n + k)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16) * 2
    _check(wk, x, qw, wk.GemvTCConfig(block_n=128, split_k=3, num_warps=4, num_stages=3))


@pytest.mark.parametrize(
    "block_n, split, warps, stages",
    [(64, 1, 4, 1), (128, 8, 4, 2), (256, 4, 4, 3), (256, 16, 8, 3), (128, 5, 8, 4)],
)
@pytest.mark.parametrize("m, block_m", [(1, 16), (9, 16), (30, 32), (64, 64), (100, 64)])
def test_gemv_tc_configs(wk, block_n, split, warps, stages, m: int, block_m: int) -> None:
    qw = _weight(wk, 3000, 4096 + 128, 128, seed=block_n + split)
    x = torch.randn(m, qw.in_features, device=DEV, dtype=torch.bfloat16) * 4
    _check(wk, x, qw, wk.GemvTCConfig(block_n, split, warps, stages, block_m))


def test_gemv_tc_default_route(wk) -> None:
    """2 <= M <= 32, bf16 x, INT4 g128 N-major: the default launch is the tensor-core kernel
    (M = 1 takes the packed-fp16 GEMV, faster there; past 32 rows the tl.dot GEMM)."""
    qw = _weight(wk, 4096, 4096, 128, seed=11)
    x1 = torch.randn(1, 4096, device=DEV, dtype=torch.bfloat16)
    assert isinstance(wk.default_config(1, 4096, 4096, x1.device, qw, x1.dtype), wk.GemvH2Config)
    x33 = torch.randn(33, 4096, device=DEV, dtype=torch.bfloat16)
    assert isinstance(wk.default_config(33, 4096, 4096, x33.device, qw, x33.dtype), wk.GemmConfig)
    for m in (2, 5, 16, 17, 32):
        x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
        assert isinstance(wk.default_config(m, 4096, 4096, x.device, qw, x.dtype), wk.GemvTCConfig)
        ref = x.double() @ qw.dequantize(torch.float64).T
        out = wk.w4a16_matmul_triton(x, qw)
        assert ((out.double() - ref).norm() / ref.norm()).item() < TOL


def test_gemv_tc_in_cuda_graph(wk) -> None:
    """Replays of a captured sequence of calls (split-K arrival counters reused, PDL where the
    GPU has it) equal the eager calls bit for bit, on fresh inputs each replay."""
    ws = [_weight(wk, 4096, 4096, 128, seed=s) for s in range(3)]
    cfg = wk.GemvTCConfig(block_n=256, split_k=8, num_warps=4, num_stages=3)
    x = torch.randn(1, 4096, device=DEV, dtype=torch.bfloat16)
    outs: list[torch.Tensor] = []

    def step() -> None:
        h = x
        outs.clear()
        for w in ws:
            h = wk.w4a16_matmul_triton(h, w, cfg)
            outs.append(h)

    from tandem.engine.cuda_graphs import capture_graph

    g, _ = capture_graph(step)
    for _ in range(3):
        x.copy_(torch.randn(1, 4096, device=DEV, dtype=torch.bfloat16))
        g.replay()
        torch.cuda.synchronize()
        captured = [o.clone() for o in outs]
        h = x
        for w, c in zip(ws, captured, strict=True):
            h = wk.w4a16_matmul_triton(h, w, cfg)
            assert torch.equal(h, c)
