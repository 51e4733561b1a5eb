"""The decode-batch GEMM (`tandem.kernels.gemm_rows`) compiled on CUDA against float64, bf16, at
Llama-3-8B's linear shapes: the autotuned launch (with programmatic dependent launch where the
GPU has it), forced K splits, and replays of a captured chain of calls.

Skipped without CUDA; run as `pytest tests/gpu` without TRITON_INTERPRET.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from tests.kernel_checks import compiled_kernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
TOL = 1e-2  # of the largest value: bf16 output (2**-9 relative), float32 sums
LAYERS = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


@pytest.fixture(scope="module")
def gr() -> ModuleType:
    return compiled_kernel("gemm_rows")


@pytest.fixture(scope="module")
def weights() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's bf16 weight and its float64 copy."""
    g = torch.Generator(device=DEV).manual_seed(0)
    out = {}
    for name, (n, k) in LAYERS.items():
        w = (torch.randn(n, k, generator=g, device=DEV) * k**-0.5).to(torch.bfloat16)
        out[name] = (w, w.double())
    return out


def _poison() -> None:
    """Fill freed blocks of the caching allocator with NaN, so an output element the kernel
    failed to write shows up as NaN rather than as a stale value."""
    junk = torch.full((256 << 20,), float("nan"), device=DEV)
    del junk


def _check(y: torch.Tensor, want: torch.Tensor) -> None:
    assert y.dtype == torch.bfloat16 and y.shape == want.shape
    assert not y.isnan().any(), "unwritten or NaN outputs"
    err = ((y.double() - want).abs().max() / want.abs().max()).item()
    assert err < TOL, err


@pytest.mark.parametrize("m", [2, 16, 64, 100, 256])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_gemm_rows_matches_f64(gr, weights, layer: str, m: int) -> None:
    w, w64 = weights[layer]
    x = torch.randn(m, w.shape[1], device=DEV).to(torch.bfloat16)
    bias = torch.randn(w.shape[0], device=DEV).to(torch.bfloat16) if layer == "qkv" else None
    want = x.double() @ w64.T + (bias.double() if bias is not None else 0)
    _poison()
    y = gr.gemm_rows_triton(x, w, bias)  # the autotuner runs on the first call of a shape
    _check(y, want)
    assert gr.gemm_rows_config(x, w, bias) is not None
    _poison()
    _check(gr.gemm_rows_triton(x, w, bias), want)  # the chosen config, its own workspace


@pytest.mark.parametrize("split", [2, 3, 8])
@pytest.mark.parametrize("m", [5, 64, 200])
def test_gemm_rows_forced_split(gr, weights, m: int, split: int) -> None:
    """K splits through the last program's merge, a split count that leaves a short last split
    (3 of 4096 in 128-wide tiles), and two row blocks (200 rows); equal on a second call (the
    counters were put back to zero, the sum order is fixed)."""
    import triton

    w, w64 = weights["o_proj"]
    x = torch.randn(m, 4096, device=DEV).to(torch.bfloat16)
    cfg = triton.Config({"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": split}, num_warps=4,
                        num_stages=3)  # fmt: skip
    _poison()
    y = gr.gemm_rows_triton(x, w, _config=cfg)
    _check(y, x.double() @ w64.T)
    assert torch.equal(gr.gemm_rows_triton(x, w, _config=cfg), y)


@pytest.mark.parametrize("m", [2, 64, 256])
def test_gemm_rows_in_cuda_graph(gr, weights, m: int) -> None:
    """A captured chain o_proj -> qkv -> o_proj -> ... (x of each call a slice of the previous
    output: a strided view) replays equal to eager calls bit for bit, on fresh inputs each
    replay, and matches float64."""
    from tandem.engine.cuda_graphs import capture_graph

    w_o, w_o64 = weights["o_proj"]
    w_q, w_q64 = weights["qkv"]
    x = torch.randn(m, 4096, device=DEV).to(torch.bfloat16)
    outs: list[torch.Tensor] = []

    def step() -> None:
        outs.clear()
        h = x
        for w in (w_o, w_q, w_o, w_q):
            h = gr.gemm_rows_triton(h, w)
            outs.append(h)
            h = h[:, :4096]

    step()  # autotunes outside the capture
    graph, _ = capture_graph(step)
    for _ in range(3):
        x.copy_(torch.randn(m, 4096, device=DEV).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        captured = [o.clone() for o in outs]
        h = x
        for w, w64, c in zip((w_o, w_q, w_o, w_q), (w_o64, w_q64, w_o64, w_q64), captured,
                             strict=True):  # fmt: skip
            _check(c, h.double() @ w64.T)
            h = gr.gemm_rows_triton(h, w)
            assert torch.equal(h, c)
            h = h[:, :4096]
