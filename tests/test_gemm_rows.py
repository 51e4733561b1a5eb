"""The decode-batch GEMM (`tandem.kernels.gemm_rows`) against float64 references, on CPU under
the Triton interpreter: ragged tiles, bias, float32 / bf16 / fp16, strided x, K split with the
last program's merge (forced configs: the autotuner times configs on a GPU only), the input
checks, and bench/gemm_rows.py --smoke end to end.

The interpreter rounds float32 to bf16 toward zero (a GPU rounds to nearest), so bf16 outputs
are held to one bf16 step of the largest value.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from conftest import require_interpreter  # noqa: E402

from tandem.kernels import gemm_rows as gr  # noqa: E402
from tandem.kernels.arrival import arrival_counters  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # of the largest value


@pytest.fixture(autouse=True)
def _require_interpreter() -> None:
    require_interpreter(tl.sum, gr._gemm_rows_kernel)


def _cfg(block_n: int, block_k: int, split: int) -> triton.Config:
    return triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split})


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    want = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert y.shape == want.shape and y.dtype == x.dtype
    err = ((y.double() - want).abs().max() / want.abs().max()).item()
    assert err < TOL[x.dtype], err


@pytest.mark.parametrize(
    "m, n, k, dtype, bias, cfg",
    [
        # Ragged M, N and K, one split.
        pytest.param(3, 100, 200, torch.float32, True, _cfg(64, 64, 1), id="ragged-f32"),
        # Four splits of 64 columns, the last one 8 wide.
        pytest.param(3, 100, 200, torch.bfloat16, False, _cfg(32, 32, 4), id="split4-bf16"),
        # Eight splits of one 16-column tile for 96 columns: the last two splits are empty.
        pytest.param(5, 64, 96, torch.float32, True, _cfg(16, 16, 8), id="split8-empty-splits"),
        # Two row blocks of 128 (the fastest grid axis), each with its own counters.
        pytest.param(130, 48, 64, torch.float32, True, _cfg(32, 16, 2), id="two-row-blocks"),
        pytest.param(20, 192, 256, torch.float16, True, _cfg(64, 64, 2), id="split2-fp16"),
        pytest.param(2, 16, 32, torch.bfloat16, True, _cfg(16, 16, 1), id="two-rows"),
        pytest.param(256, 16, 32, torch.float32, False, _cfg(16, 16, 2), id="256-rows"),
    ],
)
def test_gemm_rows_matches_f64(m, n, k, dtype, bias, cfg) -> None:
    x, w, b = _inputs(m, n, k, dtype, bias, seed=m + n + k)
    _check(gr.gemm_rows_triton(x, w, b, _config=cfg), x, w, b)
    # The merging programs put their counters back to zero for the next call.
    assert not arrival_counters(x.device, 64).any()


@pytest.mark.parametrize("split", [1, 4])
def test_gemm_rows_strided_x(split: int) -> None:
    """x as a column slice of a wider matrix (row stride > K) and as a transpose (K stride > 1)."""
    _, w, b = _inputs(7, 80, 96, torch.bfloat16, True, seed=3)
    wide = torch.randn(7, 200).to(torch.bfloat16)
    sliced = wide[:, 50:146]
    transposed = torch.randn(96, 7).to(torch.bfloat16).t()
    for x in (sliced, transposed):
        assert not x.is_contiguous()
        _check(gr.gemm_rows_triton(x, w, b, _config=_cfg(32, 16, split)), x, w, b)


def test_gemm_rows_default_config_on_cpu() -> None:
    """Without a forced config the interpreter runs its fixed one, K split in two from 256."""
    for k, split in ((200, 1), (256, 2)):
        x, w, b = _inputs(9, 70, k, torch.float32, True, seed=k)
        assert gr.gemm_rows_config(x, w, b) == {"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": split,
                                                 "BLOCK_M": 16, "num_warps": 4,
                                                 "num_stages": 3}  # fmt: skip
        _check(gr.gemm_rows_triton(x, w, b), x, w, b)


def test_autotune_candidates_split_only_small_grids() -> None:
    """The autotuner tries K splits where the unsplit column blocks leave multiprocessors idle
    (Llama-3-8B's o_proj on 132), not where they fill them (gate_up, lm_head), nor past four
    programs per multiprocessor or 64 accumulator registers per thread; unsplit configs stay
    whenever their pipeline fits in shared memory."""

    def splits(n: int, k: int, block_m: int, m_blocks: int = 1) -> set[tuple[int, int]]:
        return {(c.kwargs["BLOCK_N"], c.kwargs["SPLIT_K"]) for c in gr._CONFIGS
                if gr._usable(c, n, k, block_m, m_blocks, 2, 132)}  # fmt: skip

    both = {(bn, s) for bn in (64, 128) for s in (1, 2, 4, 8)}
    assert splits(4096, 4096, 64) == both
    assert splits(4096, 14336, 16) == both
    assert splits(28672, 4096, 64) == {(64, 1), (128, 1)}
    assert splits(128256, 4096, 128) == {(64, 1), (128, 1)}
    # 256 rows: two row blocks of 128; 64 column blocks of 64 split up to four ways.
    assert splits(4096, 4096, 128, m_blocks=2) == {(64, 1), (128, 1), (64, 2), (64, 4)}
    big = [c for c in gr._CONFIGS if gr._usable(c, 4096, 4096, 128, 1, 2, 132)]
    assert all(c.num_stages * (c.kwargs["BLOCK_N"] + 128) * c.kwargs["BLOCK_K"] * 2 <= 220 << 10
               for c in big)  # fmt: skip


@pytest.mark.parametrize(
    "x_shape, w_shape, x_dtype, w_dtype, bias_shape, match",
    [
        ((1, 64), (32, 64), torch.float32, torch.float32, None, "2 to 256 rows, got 1"),
        ((257, 64), (32, 64), torch.float32, torch.float32, None, "2 to 256 rows, got 257"),
        ((4, 64), (32, 48), torch.float32, torch.float32, None, "x has 64 columns, weight has 48"),
        ((4, 8, 8), (32, 64), torch.float32, torch.float32, None, "takes x \\[M, K\\]"),
        ((4, 64), (32, 64), torch.bfloat16, torch.float32, None, "dtypes differ"),
        ((4, 64), (32, 64), torch.int32, torch.int32, None, "float16, bfloat16 or float32"),
        ((4, 64), (32, 64), torch.float32, torch.float32, (31,), "bias must be \\[32\\]"),
    ],
)
def test_gemm_rows_rejects_bad_inputs(x_shape, w_shape, x_dtype, w_dtype, bias_shape, match):
    x = torch.zeros(x_shape, dtype=x_dtype)
    w = torch.zeros(w_shape, dtype=w_dtype)
    b = torch.zeros(bias_shape) if bias_shape else None
    with pytest.raises(ValueError, match=match):
        gr.gemm_rows_triton(x, w, b)


def test_bench_smoke_writes_rows_that_match_the_reference(tmp_path) -> None:
    out = tmp_path / "gemm_rows.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "gemm_rows.py"), "--smoke", "--out",
         str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["smoke"] and res["command"].startswith("python ") and res["triton"]
    layers = {r["layer"] for r in res["rows"]}
    assert layers == {"qkv", "o_proj", "gate_up", "down", "lm_head"}
    assert len(res["rows"]) == 15 and {r["M"] for r in res["rows"]} == {2, 5, 20}
    for row in res["rows"]:
        assert row["max_rel_diff"] < 1e-2 and row["cublas_max_rel_diff"] < 1e-2
        assert row["triton_s"] > 0 and row["config"]["BLOCK_M"] in (16, 32)
    # K = 256 (down) runs the split-K merge under the interpreter.
    assert {r["config"]["SPLIT_K"] for r in res["rows"] if r["layer"] == "down"} == {2}
    assert [c["M"] for c in res["chain"]] == [2, 5, 20]
