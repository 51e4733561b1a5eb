"""One-row INT4 GEMVs adding into a float32 row that their reader rounds and zeroes (CPU, Triton
interpreter; tests/gpu/test_pdl_gpu.py runs the decode step this way on CUDA).

The GEMV's programs add their parts into a zeroed float32 row (`accumulate`) instead of summing
the K split through partials and an arrival counter; the kernel that reads the row (RMSNorm,
silu * up, rotary + KV write) rounds it to the activation dtype, as the GEMV would have stored
it, and writes zeros back. Each reader must give what it gives for the rounded row, bit for
bit, and leave the row zero.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from conftest import require_interpreter  # noqa: E402

from tandem.formats.weight import quantize_rtn  # noqa: E402
from tandem.kernels import activation as act  # noqa: E402
from tandem.kernels import rmsnorm as rn  # noqa: E402
from tandem.kernels import rotary as rot  # noqa: E402
from tandem.kernels import w4a16 as wk  # noqa: E402
from tandem.model.config import ModelConfig  # noqa: E402
from tandem.model.rotary import cos_sin_table  # noqa: E402

DT = torch.float16  # the activation dtype here (the interpreter has no bfloat16)


@pytest.fixture(autouse=True)
def _require_interpreter() -> None:
    require_interpreter(tl.sum, rn._rmsnorm_kernel)


@pytest.mark.parametrize("n,k,split,gemv_x", [(96, 1024, 4, True), (64, 768, 3, False)])
def test_gemv_adds_into_the_row(n, k, split, gemv_x) -> None:
    g = torch.Generator().manual_seed(n)
    w = wk.n_major(quantize_rtn(torch.randn(n, k, generator=g) * 0.02, 4, 128))
    x = torch.randn(1, k, generator=g)
    xq = wk.gemv_x_ref(x, 128) if gemv_x else None
    cfg = wk.GemvH2Config(32, split, 1)
    want = wk.w4a16_matmul_triton(x, w, cfg, xq=xq)
    row = torch.zeros(1, n)
    got = wk.w4a16_matmul_triton(x, w, cfg, xq=xq, accumulate=row)
    assert got is row
    torch.testing.assert_close(row, want, rtol=1e-6, atol=1e-7)
    wk.w4a16_matmul_triton(x, w, cfg, xq=xq, accumulate=row)  # adds: the row is not cleared
    torch.testing.assert_close(row, 2 * want, rtol=1e-6, atol=1e-7)


def test_gemv_accumulate_errors_name_the_problem() -> None:
    w = wk.n_major(quantize_rtn(torch.randn(64, 256) * 0.02, 4, 128))
    x = torch.randn(1, 256)
    cfg = wk.GemvH2Config(32, 2, 1)
    with pytest.raises(ValueError, match=r"float32 \[1, 64\].*float16 \(1, 64\)"):
        wk.w4a16_matmul_triton(x, w, cfg, accumulate=torch.zeros(1, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"float32 \[1, 64\].*\(1, 32\)"):
        wk.w4a16_matmul_triton(x, w, cfg, accumulate=torch.zeros(1, 32))
    with pytest.raises(ValueError, match="needs the packed-fp16 GEMV"):
        wk.w4a16_matmul_triton(x, w, wk.GemvNConfig(32, 2, 1), accumulate=torch.zeros(1, 64))
    # Not on CPU tensors outside the interpreter's reach, nor where the GEMV is not the GPU's.
    assert not wk.gemv_accumulates(w, torch.bfloat16)
    assert not wk.gemv_accumulates(torch.zeros(4, 4), torch.bfloat16)


def _acc_row(shape, seed: int) -> torch.Tensor:
    """A float32 row with values between the activation dtype's steps."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 3 + torch.rand(shape, generator=g) * 1e-3


@pytest.mark.parametrize("gemv_x", [False, True])
def test_rmsnorm_reads_rounds_and_zeroes_the_row(gemv_x) -> None:
    h = 256
    acc = _acc_row((1, h), 1)
    residual = torch.randn(1, h).to(DT)
    w = (torch.rand(h) + 0.5).to(DT)
    if gemv_x:
        want = rn.rmsnorm_gemv_x(acc.to(DT), w, 1e-5, residual, 64)
        got = rn.rmsnorm_gemv_x(acc, w, 1e-5, residual, 64, acc_input=True)
        assert torch.equal(got[2].scaled, want[2].scaled)
        assert torch.equal(got[2].scalars, want[2].scalars)
    else:
        want = rn.rmsnorm_triton(acc.to(DT), w, 1e-5, residual)
        got = rn.rmsnorm_triton(acc, w, 1e-5, residual, acc_input=True)
    assert got[0].dtype == want[0].dtype == DT and got[1].dtype == DT
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.count_nonzero(acc) == 0


def test_rmsnorm_acc_input_needs_a_residual_and_float32() -> None:
    w = torch.ones(64, dtype=DT)
    with pytest.raises(ValueError, match="acc_input needs a contiguous float32 accumulator"):
        rn.rmsnorm_triton(torch.zeros(1, 64), w, 1e-5, None, acc_input=True)
    with pytest.raises(ValueError, match="got x torch.float16"):
        rn.rmsnorm_triton(torch.zeros(1, 64, dtype=DT), w, 1e-5, torch.zeros(1, 64, dtype=DT),
                          acc_input=True)  # fmt: skip


def test_silu_mul_reads_rounds_and_zeroes_the_row() -> None:
    n = 512
    acc = _acc_row((1, 2 * n), 2)
    want, wq = act.silu_and_mul_gemv_x(acc.to(DT), 128)
    got, gq = act.silu_and_mul_gemv_x(acc, 128, acc_dtype=DT)
    assert got.dtype == DT
    assert torch.equal(got, want) and torch.equal(gq.scaled, wq.scaled)
    assert torch.equal(gq.scalars, wq.scalars)
    assert torch.count_nonzero(acc) == 0
    with pytest.raises(ValueError, match="float32 accumulator"):
        act.silu_and_mul_gemv_x(acc.to(DT), 128, acc_dtype=DT)


@pytest.mark.parametrize("slot", [5, -1])  # -1: a padding row, which writes no cache but reads
def test_rope_cache_write_reads_rounds_and_zeroes_the_row(slot) -> None:
    hq, hkv, d, bs = 4, 2, 16, 4
    cfg = ModelConfig("llama", 64, hq * d, 4 * hq * d, 1, hq, hkv, d, rope_theta=10000.0)
    cs = cos_sin_table(cfg, 32, "cpu")
    acc = _acc_row((1, (hq + 2 * hkv) * d), 3)
    pos = torch.tensor([7])
    slots = torch.tensor([slot])
    out = {}
    for name, qkv, acc_dtype in (("want", acc.to(DT), None), ("got", acc, DT)):
        kc = torch.zeros(3, bs, hkv, d, dtype=DT)
        vc = torch.zeros(3, bs, hkv, d, dtype=DT)
        q = rot.rope_cache_write_triton(qkv, pos, cs, slots, kc, vc, hq, hkv, acc_dtype)
        out[name] = (q, kc, vc)
    for a, b in zip(out["got"], out["want"], strict=True):
        assert a.dtype == DT and torch.equal(a, b)
    assert torch.count_nonzero(acc) == 0
