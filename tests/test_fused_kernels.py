"""The fused rotary + KV-write and SwiGLU kernels against the eager ops they replace (CPU, Triton
interpreter; tests/gpu runs the compiled kernels on CUDA)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from conftest import require_interpreter  # noqa: E402

from tandem.kernels import activation as act  # noqa: E402
from tandem.kernels import gemv  # noqa: E402
from tandem.kernels import rotary as rot  # noqa: E402
from tandem.model.config import ModelConfig  # noqa: E402
from tandem.model.rotary import cos_sin_table  # noqa: E402


@pytest.fixture(autouse=True)
def _require_interpreter() -> None:
    require_interpreter(tl.sum, rot._rope_cache_kernel, act._silu_mul_kernel, gemv._gemv_kernel.fn)


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
        x, w, b, y, n, k, w.stride(0), HAS_BIAS=bias, BLOCK_N=block_n, BLOCK_K=block_k, PDL=False
    )
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    assert ((y.double() - want).norm() / want.norm()).item() < 1e-6


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # bf16: tests/gpu
def test_rope_cache_write_scaled_matches_eager(kv_dtype, dtype):
    """Decode steps into FP8/INT8 caches: blocks that start afresh (stale codes and scales of a
    previous owner), blocks whose scale grows (held codes re-quantized) or does not, a padding
    row (slot -1); codes, scales and q equal the eager rotary + write_kv_block_scaled path."""
    hq, hkv, d, bs, nb = 4, 2, 16, 4, 8
    g = torch.Generator().manual_seed(7)
    cos_sin = cos_sin_table(_cfg(hq, hkv, d), 64, "cpu")
    kc = (torch.randn(nb, bs, hkv, d, generator=g) * 20).to(kv_dtype)  # stale junk
    vc = (torch.randn(nb, bs, hkv, d, generator=g) * 20).to(kv_dtype)
    ks = torch.rand(nb, hkv, generator=g) * 3
    vs = torch.rand(nb, hkv, generator=g) * 3
    caches = [kc, vc, ks, vs]
    ref_caches = [c.clone() for c in caches]
    width = (hq + 2 * hkv) * d
    # Blocks 1, 2, 5 hold sequences; each step appends one token to each (slots advance).
    lens = {1: 0, 2: 2, 5: 3}
    for step in range(5):
        slots, pos, scale = [], [], []
        for b, n in lens.items():
            slots.append(b * bs + (n + step) % bs)
            pos.append(n + step)
            scale.append(8.0 if (step, b) in ((1, 2), (3, 5)) else 1.0)  # a few scales grow
        slots.append(-1)  # a padding row
        pos.append(0)
        scale.append(1.0)
        t = len(slots)
        qkv = (torch.randn(t, width, generator=g) * torch.tensor(scale)[:, None]).to(dtype)
        positions = torch.tensor(pos)
        slot_mapping = torch.tensor(slots)
        q = rot.rope_cache_write_scaled(qkv, positions, cos_sin, slot_mapping, *caches, hq, hkv)
        q_ref = rot.rope_cache_write_scaled_ref(
            qkv, positions, cos_sin, slot_mapping, *ref_caches, hq, hkv
        )
        torch.testing.assert_close(q, q_ref, rtol=0, atol=0)
        for name, c, r in zip("kc vc ks vs".split(), caches, ref_caches, strict=True):
            if c.dtype == torch.float8_e4m3fn:
                # The interpreter's float -> fp8 conversion is not exact (it flushes subnormals,
                # and once in a few thousand values misses a carry into the exponent); the GPU
                # test compares bit for bit. Here: all but a few codes equal (a logic error
                # spoils whole blocks: 1 in 8 of these codes).
                same = (c.view(torch.uint8) == r.view(torch.uint8)).float().mean().item()
                assert same > 0.98, f"step {step} {name}: only {same:.3%} of codes equal"
                continue
            if c.dtype == kv_dtype:
                c, r = c.view(torch.uint8), r.view(torch.uint8)
            bad = (c != r).nonzero()
            assert not len(bad), f"step {step} {name}: {len(bad)} differ, first {bad[:4].tolist()}"


def test_rope_kernels_prewait_order_is_bit_equal(monkeypatch):
    """With PREWAIT (`pdl.prewait`: with PDL on a GPU) both rotary kernels load the
    token's position, slot and cos/sin before their wait: the same q, codes, scales and cache
    rows as without, for the bf16-style and the FP8 (scaled) write."""
    hq, hkv, d, bs, nb = 4, 2, 16, 4, 8
    g = torch.Generator().manual_seed(13)
    cos_sin = cos_sin_table(_cfg(hq, hkv, d), 64, "cpu")
    t = 4
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    positions = torch.randint(0, 64, (t,), generator=g)
    slots = torch.tensor([5, 9, 22, -1])  # one token per block; the last a padding row
    kc8 = (torch.randn(nb, bs, hkv, d, generator=g) * 5).to(torch.int8)
    scales = torch.rand(nb, hkv, generator=g) + 0.5

    def run():
        kc, vc = torch.zeros(nb, bs, hkv, d), torch.zeros(nb, bs, hkv, d)
        q = rot.rope_cache_write_triton(qkv, positions, cos_sin, slots, kc, vc, hq, hkv)
        scaled = [kc8.clone(), kc8.clone(), scales.clone(), scales.clone()]
        q8 = rot.rope_cache_write_scaled(qkv, positions, cos_sin, slots, *scaled, hq, hkv)
        return [q, kc, vc, q8, *scaled]

    plain = run()
    monkeypatch.setattr(rot.pdl, "prewait", lambda t: True)
    early = run()
    for a, b in zip(early, plain, strict=True):
        assert torch.equal(a, b)
    assert plain[1].abs().sum() > 0  # the cache rows were written
