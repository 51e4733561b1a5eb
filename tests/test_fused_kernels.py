"""The fused rotary + KV-write and SwiGLU kernels against the eager ops they replace (CPU, Triton
interpreter; tests/gpu runs the compiled kernels on CUDA)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from tandem.kernels import activation as act  # noqa: E402
from tandem.kernels import gemv  # noqa: E402
from tandem.kernels import rotary as rot  # noqa: E402
from tandem.model.config import ModelConfig  # noqa: E402
from tandem.model.rotary import cos_sin_table  # noqa: E402

_INTERPRETED = all(
    isinstance(f, InterpretedFunction)
    for f in (tl.sum, rot._rope_cache_kernel, act._silu_mul_kernel, gemv._gemv_kernel.fn)
)


@pytest.fixture(autouse=True)
def _require_interpreter() -> None:
    if _INTERPRETED:
        return
    if torch.cuda.is_available():
        pytest.skip("triton is in compiled mode (TRITON_INTERPRET unset); tests/gpu covers CUDA")
    pytest.fail("triton was imported before TRITON_INTERPRET=1 was set; run `make test`")


def _cfg(hq: int, hkv: int, d: int) -> ModelConfig:
    return ModelConfig("llama", 64, hq * d, 4 * hq * d, 1, hq, hkv, d, rope_theta=10000.0)


@pytest.mark.parametrize(
    "t,hq,hkv,d,dtype",
    [(5, 4, 2, 16, torch.float32), (3, 6, 2, 32, torch.float16), (1, 8, 8, 16, torch.float32)],
)
def test_rope_cache_write_matches_eager(t, hq, hkv, d, dtype):
    g = torch.Generator().manual_seed(t * 100 + hq)
    cos_sin = cos_sin_table(_cfg(hq, hkv, d), 64, "cpu")
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    positions = torch.randint(0, 64, (t,), generator=g)
    num_blocks, bs = 6, 4
    # Distinct slots; the last token is a padding row (slot -1) that must write nothing.
    slots = torch.randperm(num_blocks * bs, generator=g)[:t]
    slots[-1] = -1
    poison = torch.full((num_blocks, bs, hkv, d), 7.0, dtype=dtype)
    caches = {name: (poison.clone(), poison.clone()) for name in ("ref", "tri")}
    q_ref = rot.rope_cache_write_ref(qkv, positions, cos_sin, slots, *caches["ref"], hq, hkv)
    q_tri = rot.rope_cache_write_triton(qkv, positions, cos_sin, slots, *caches["tri"], hq, hkv)
    assert torch.equal(q_tri, q_ref)
    for a, b in zip(caches["tri"], caches["ref"], strict=True):
        assert torch.equal(a, b)
    # Slots nobody wrote still hold the poison; the padding row left none of its values.
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert (caches["tri"][0].view(-1, hkv, d)[untouched] == 7.0).all()
    # And the rotation itself is right: float64 rotate-half against the fp32 table.
    cs = cos_sin[positions].double()
    x = qkv[:, : hq * d].double().view(t, hq, d)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    c, s = cs[:, None, : d // 2], cs[:, None, d // 2 :]
    want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert (q_tri.double() - want).abs().max().item() <= tol * want.abs().max().item()


@pytest.mark.parametrize(
    "shape,dtype", [((3, 2 * 40), torch.float32), ((2, 5, 2 * 1100), torch.float16)]
)
def test_silu_and_mul_matches_eager(shape, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype) * 3
    out = act.silu_and_mul_triton(x)
    ref = act.silu_and_mul_ref(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # exp differs from libm's by an ulp or so in float32, so fp16 results may differ by one ulp.
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert (out.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()


@pytest.mark.parametrize(
    "n,k,block_n,block_k,bias", [(37, 300, 4, 128, True), (16, 64, 8, 64, False)]
)
def test_gemv_kernel_matches_f64(n, k, block_n, block_k, bias):
    # The autotuner times configs on a GPU; here one config is launched directly.
    g = torch.Generator().manual_seed(n)
    x, w, b = torch.randn(1, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n)
    y = torch.empty(1, n)
    grid = (-(-n // block_n),)
    gemv._gemv_kernel.fn[grid](
        x, w, b, y, n, k, w.stride(0), HAS_BIAS=bias, BLOCK_N=block_n, BLOCK_K=block_k
    )
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    assert ((y.double() - want).norm() / want.norm()).item() < 1e-6
