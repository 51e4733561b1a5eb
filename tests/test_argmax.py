"""The one-launch row argmax (tandem/kernels/argmax.py) against torch.argmax, on CPU under the
Triton interpreter (tests/gpu/test_argmax_gpu.py runs it compiled): ties, NaN, signed zeros,
rows of -inf, partial last blocks, several rows; its counters left at zero."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from conftest import require_interpreter  # noqa: E402

from tandem.kernels import argmax as am  # noqa: E402
from tandem.kernels.arrival import arrival_counters  # noqa: E402


@pytest.fixture(autouse=True)
def _require_interpreter() -> None:
    require_interpreter(tl.sum, am._argmax_kernel)


def hard_rows(v: int, seed: int = 0) -> torch.Tensor:
    """Rows that each test one rule: random; a tie (first wins); NaN twice (first NaN wins, over
    +inf); +inf; all -inf (column 0); -0.0 before 0.0 as the maximum (equal: -0.0 wins);
    negatives only; a maximum in the last, partial block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, v, generator=g)
    x[1, v // 3] = x[1, 2 * v // 3] = 50.0
    x[2, v // 4] = float("inf")
    x[2, v // 2] = x[2, v - 2] = float("nan")
    x[3, v - 5] = float("inf")
    x[4] = float("-inf")
    x[5] = -1.0
    x[5, 1] = -0.0
    x[5, v // 2] = 0.0
    x[6] = -torch.rand(v, generator=g) - 1e-3
    x[7, v - 1] = 99.0
    return x


@pytest.mark.parametrize("v,block", [(1000, 128), (130, 64), (6, 16), (4096, 1024)])
def test_argmax_equals_torch(v: int, block: int) -> None:
    x = hard_rows(v, v)
    got = am.argmax_triton(x, block)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.argmax(x, dim=-1)), (got, torch.argmax(x, dim=-1))
    assert torch.count_nonzero(arrival_counters(x.device, 8)[:8]) == 0
    # Strided rows (a view of every other column) are made contiguous first.
    wide = hard_rows(2 * v, v)[:, ::2]
    assert torch.equal(am.argmax_triton(wide, block), torch.argmax(wide, dim=-1))


def test_argmax_rows_falls_back_to_torch_off_cuda() -> None:
    x = hard_rows(300)
    assert torch.equal(am.argmax_rows(x), torch.argmax(x, dim=-1))
    assert torch.equal(am.argmax_rows(x.double()), torch.argmax(x.double(), dim=-1))


def test_argmax_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"2-D float32 tensor, got torch.float64 \(2, 3\)"):
        am.argmax_triton(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="block must be a power of 2 >= 16, got 100"):
        am.argmax_triton(torch.zeros(2, 3), block=100)
    with pytest.raises(ValueError, match="argmax of an empty row"):
        am.argmax_triton(torch.zeros(2, 0))
    assert am.argmax_triton(torch.zeros(0, 7)).shape == (0,)
