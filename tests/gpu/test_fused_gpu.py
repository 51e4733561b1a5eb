"""The fused rotary + KV-write and SwiGLU kernels compiled on CUDA, against float64 and against
the eager ops they replace (bit for bit in bf16 and fp16, where both round every product)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from tests.kernel_checks import compiled_kernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"


@pytest.fixture(scope="module")
def rot() -> ModuleType:
    return compiled_kernel("rotary")


@pytest.fixture(scope="module")
def act() -> ModuleType:
    return compiled_kernel("activation")


@pytest.fixture(scope="module")
def gemv() -> ModuleType:
    return compiled_kernel("gemv")


def _table(d: int, positions: int) -> torch.Tensor:
    from tandem.model.config import ModelConfig
    from tandem.model.rotary import cos_sin_table

    cfg = ModelConfig("llama", 64, 32 * d, 64, 1, 32, 8, d, rope_theta=500000.0)
    return cos_sin_table(cfg, positions, DEV)


@pytest.mark.parametrize(
    "t,hq,hkv,d,dtype",
    [
        (1, 32, 8, 128, torch.bfloat16),
        (300, 32, 8, 128, torch.bfloat16),
        (7, 14, 2, 64, torch.float16),
        (33, 4, 2, 16, torch.float32),
    ],
)
def test_rope_cache_write(rot: ModuleType, t, hq, hkv, d, dtype) -> None:
    g = torch.Generator(device=DEV).manual_seed(t + d)
    cos_sin = _table(d, 4096)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g, device=DEV).to(dtype)
    positions = torch.randint(0, 4096, (t,), generator=g, device=DEV)
    num_blocks, bs = (t + 15) // 16 + 4, 16
    slots = torch.randperm(num_blocks * bs, generator=g, device=DEV)[:t]
    slots[0] = -1  # a padding row
    poison = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=dtype, device=DEV)
    kc_r, vc_r, kc_t, vc_t = (poison.clone() for _ in range(4))
    q_r = rot.rope_cache_write_ref(qkv, positions, cos_sin, slots, kc_r, vc_r, hq, hkv)
    q_t = rot.rope_cache_write_triton(qkv, positions, cos_sin, slots, kc_t, vc_t, hq, hkv)
    if dtype == torch.float32:  # FMA contraction may differ from the separate eager ops by an ulp
        torch.testing.assert_close(q_t, q_r, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(kc_t, kc_r, atol=1e-6, rtol=1e-6, equal_nan=True)
    else:
        assert torch.equal(q_t, q_r)
        assert torch.equal(kc_t.nan_to_num(7.0), kc_r.nan_to_num(7.0))
    assert torch.equal(vc_t.nan_to_num(7.0), vc_r.nan_to_num(7.0))
    # Exactly the real rows' slots were written (NaN poison elsewhere).
    written = ~kc_t.view(-1, hkv, d).isnan().any(-1).any(-1)
    assert sorted(written.nonzero().flatten().tolist()) == sorted(slots[1:].tolist())
    # Against float64 rotate-half on the fp32 table.
    cs = cos_sin[positions].double()
    x = qkv[:, : hq * d].double().view(t, hq, d)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    c, s = cs[:, None, : d // 2], cs[:, None, d // 2 :]
    want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    rel = ((q_t.double() - want).norm() / want.norm()).item()
    assert rel < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("t,dtype", [(1, torch.bfloat16), (64, torch.bfloat16), (9, torch.float16)])
def test_rope_cache_write_scaled(rot: ModuleType, kv_dtype, t, dtype) -> None:
    """Decode steps into an FP8/INT8 cache (one token per block, fresh blocks with stale codes,
    growing scales, a padding row): codes, scales and q equal the eager path bit for bit."""
    hq, hkv, d, bs = 32, 8, 128, 16
    g = torch.Generator(device=DEV).manual_seed(t)
    cos_sin = _table(d, 4096)
    nb = 2 * t + 3
    blocks = torch.randperm(nb, generator=g, device=DEV)[:t]
    start = torch.randint(0, bs, (t,), generator=g, device=DEV)
    # Stale codes of a previous owner: anything quantize_codes can write (int8 never holds -128).
    lim = 127.0 if kv_dtype == torch.int8 else 448.0
    caches = [
        (torch.randn(nb, bs, hkv, d, generator=g, device=DEV) * 30).clamp(-lim, lim).to(kv_dtype),
        (torch.randn(nb, bs, hkv, d, generator=g, device=DEV) * 30).clamp(-lim, lim).to(kv_dtype),
        torch.rand(nb, hkv, generator=g, device=DEV),
        torch.rand(nb, hkv, generator=g, device=DEV),
    ]
    ref = [c.clone() for c in caches]
    for step in range(bs + 2):
        slots = blocks * bs + (start + step) % bs
        slots[0] = -1 if t > 1 else slots[0]
        grow = 1 + 7 * (torch.rand(t, 1, generator=g, device=DEV) < 0.2)
        qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g, device=DEV) * grow).to(dtype)
        pos = torch.randint(0, 4096, (t,), generator=g, device=DEV)
        q = rot.rope_cache_write_scaled(qkv, pos, cos_sin, slots, *caches, hq, hkv)
        q_r = rot.rope_cache_write_scaled_ref(qkv, pos, cos_sin, slots, *ref, hq, hkv)
        assert torch.equal(q, q_r)
        for name, c, r in zip("k v k_scale v_scale".split(), caches, ref, strict=True):
            cv, rv = (c.view(torch.uint8), r.view(torch.uint8)) if c.dtype == kv_dtype else (c, r)
            bad = (cv != rv).nonzero()[:3].tolist()
            assert not bad, (
                f"step {step} {name}: {(cv != rv).sum().item()} differ, at {bad}: "
                f"{[c[tuple(i)].float().item() for i in bad]} vs "
                f"{[r[tuple(i)].float().item() for i in bad]}; slots {slots.tolist()[:6]}"
            )


@pytest.mark.parametrize(
    "rows,inter,dtype",
    [(1, 14336, torch.bfloat16), (64, 14336, torch.bfloat16), (5, 1000, torch.float32)],
)
def test_silu_and_mul(act: ModuleType, rows, inter, dtype) -> None:
    g = torch.Generator(device=DEV).manual_seed(rows)
    x = (torch.randn(rows, 2 * inter, generator=g, device=DEV) * 4).to(dtype)
    out = act.silu_and_mul_triton(x)
    xd = x.double()
    want = torch.nn.functional.silu(xd[:, :inter]) * xd[:, inter:]
    rel = ((out.double() - want).norm() / want.norm()).item()
    assert rel < (1e-6 if dtype == torch.float32 else 1e-2)
    eager = act.silu_and_mul_ref(x)
    # exp differs from libm's by an ulp or so in float32: in bf16 that flips a rounding rarely.
    if dtype == torch.float32:
        torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    else:
        assert (out != eager).float().mean().item() < 1e-2


@pytest.mark.parametrize(
    "n,k,dtype,bias",
    [
        (6144, 4096, torch.bfloat16, False),
        (4096, 14336, torch.bfloat16, False),
        (1000, 576, torch.bfloat16, True),
        (37, 300, torch.float32, True),
        (128256, 4096, torch.bfloat16, False),
    ],
)
def test_gemv(gemv: ModuleType, n, k, dtype, bias) -> None:
    g = torch.Generator(device=DEV).manual_seed(n + k)
    x = torch.randn(1, k, generator=g, device=DEV).to(dtype)
    w = (torch.randn(n, k, generator=g, device=DEV) * 0.02).to(dtype)
    b = torch.randn(n, generator=g, device=DEV).to(dtype) if bias else None
    y = gemv.gemv_triton(x, w, b)
    assert y.shape == (1, n) and y.dtype == dtype and not y.isnan().any()
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    rel = ((y.double() - want).norm() / want.norm()).item()
    assert rel < (1e-6 if dtype == torch.float32 else 5e-3)
    eager = torch.nn.functional.linear(x, w, b)
    # No worse than cuBLAS: both round one float32 sum to the output dtype.
    assert rel <= 2 * ((eager.double() - want).norm() / want.norm()).item() + 1e-6
