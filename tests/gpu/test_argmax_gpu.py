"""The one-launch row argmax (tandem/kernels/argmax.py) compiled on CUDA against torch.argmax on
the same device: Llama-3's 128256 logits, batches of 1 to 64, rows that each test one rule
(ties, NaN, infinities, signed zeros, a maximum in the last block), eager and in a CUDA graph.

Skipped without CUDA; run as `pytest tests/gpu` without TRITON_INTERPRET.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernel_checks import compiled_kernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"


@pytest.fixture(scope="module")
def am():
    return compiled_kernel("argmax")


def _rows(b: int, v: int, seed: int) -> torch.Tensor:
    """Random rows, the first six of which each test one rule: a tie (the first wins); +inf;
    NaN twice (the first NaN, over everything); all -inf (column 0); -0.0 before 0.0 as the
    maximum (equal: -0.0's column); a maximum in the last block."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(b, v, device=DEV, generator=g) * 4
    special = torch.randn(6, v, device=DEV, generator=g)
    special[0, v // 3] = special[0, 2 * v // 3] = 1e3
    special[1, v // 5] = float("inf")
    special[2, v // 2] = special[2, v - 3] = float("nan")
    special[3] = float("-inf")
    special[4] = -2.0
    special[4, 11] = -0.0
    special[4, v // 2] = 0.0
    special[5, v - 1] = 1e4
    n = min(b, 6)
    x[:n] = special[:n]
    return x


@pytest.mark.parametrize("b", [1, 6, 64])
@pytest.mark.parametrize("block", [1024, 2048, 4096])
def test_argmax_equals_torch_on_cuda(am, b: int, block: int) -> None:
    v = 128256
    for seed in range(3):
        x = _rows(b, v, seed)
        got = am.argmax_triton(x, block)
        assert torch.equal(got, torch.argmax(x, dim=-1)), f"seed {seed}"


def test_argmax_in_a_cuda_graph(am) -> None:
    """Captured once, replayed on new rows: the counters are left ready for every replay."""
    x = _rows(4, 128256, 0)
    from tandem.engine.cuda_graphs import capture_graph

    graph, out = capture_graph(lambda: am.argmax_rows(x))
    for seed in range(20):
        x.copy_(_rows(4, 128256, seed + 1))
        graph.replay()
        assert torch.equal(out, torch.argmax(x, dim=-1)), f"replay {seed}"
