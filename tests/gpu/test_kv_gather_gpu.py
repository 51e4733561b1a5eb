"""The KV block gather kernel on CUDA against torch indexing of the same pools.

Skipped without CUDA (compiled kernels only: with TRITON_INTERPRET=1 these tests skip)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.device_busy import queue_busy_ms

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: run `pytest tests/gpu` without it")


def _pool(layers: int, blocks: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(layers, 2, blocks, 16, 8, 128, device="cuda", generator=g)
    return t.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scattered", [False, True])
def test_gather_blocks_equals_indexing(dtype: torch.dtype, scattered: bool) -> None:
    from tandem.kernels.kv_gather import gather_block_pairs

    src, dst = _pool(3, 40, dtype, 0), _pool(3, 25, dtype, 1)
    before = dst.clone()
    if scattered:
        src_ids = torch.tensor([37, 2, 19, 5, 0, 33, 11], device="cuda")
        dst_ids = torch.tensor([24, 0, 7, 13, 3, 1, 18], device="cuda")
    else:
        src_ids = torch.arange(10, 22, device="cuda")
        dst_ids = torch.arange(4, 16, device="cuda", dtype=torch.int32)
    gather_block_pairs(dst, src, torch.cat([src_ids.to(dst_ids.dtype), dst_ids]))
    want = before.clone()
    want[:, :, dst_ids.long()] = src[:, :, src_ids.long()]
    assert torch.equal(dst, want)  # other blocks untouched, copied ones bit for bit


def test_gather_copy_quantized_pool_moves_data_and_scales() -> None:
    from tandem.kv.block_copy import gather_copy
    from tandem.kv.cache import KVCache

    g = torch.Generator(device="cuda").manual_seed(2)
    data = torch.randint(-128, 127, (2, 2, 30, 16, 8, 128), device="cuda", generator=g)
    src = KVCache(data.to(torch.int8), torch.rand(2, 2, 30, 8, device="cuda", generator=g))
    dst = KVCache(
        torch.zeros(2, 2, 12, 16, 8, 128, dtype=torch.int8, device="cuda"),
        torch.zeros(2, 2, 12, 8, device="cuda"),
    )
    s, d = [29, 3, 4, 17], [0, 11, 5, 6]
    gather_copy(dst, d, src, s)
    torch.cuda.synchronize()
    for a, b in zip(s, d, strict=True):
        assert torch.equal(dst.data[:, :, b], src.data[:, :, a])
        assert torch.equal(dst.scales[:, :, b], src.scales[:, :, a])
    untouched = [i for i in range(12) if i not in d]
    assert not dst.data[:, :, untouched].any() and not dst.scales[:, :, untouched].any()


def test_gather_copy_fp8_pool() -> None:
    from tandem.kv.block_copy import gather_copy
    from tandem.kv.cache import KVCache

    fp8 = torch.float8_e4m3fn
    src = KVCache(_pool(2, 20, torch.float32, 3).to(fp8), torch.rand(2, 2, 20, 8, device="cuda"))
    dst = KVCache(
        torch.zeros(2, 2, 9, 16, 8, 128, device="cuda").to(fp8),
        torch.zeros(2, 2, 9, 8, device="cuda"),
    )
    gather_copy(dst, [8, 1], src, [0, 19])
    torch.cuda.synchronize()
    assert torch.equal(dst.data[:, :, 8].view(torch.uint8), src.data[:, :, 0].view(torch.uint8))
    assert torch.equal(dst.data[:, :, 1].view(torch.uint8), src.data[:, :, 19].view(torch.uint8))
    assert torch.equal(dst.scales[:, :, 1], src.scales[:, :, 19])


def test_gather_block_pairs_equals_indexing() -> None:
    from tandem.kernels.kv_gather import gather_block_pairs

    src, dst = _pool(2, 30, torch.bfloat16, 4), _pool(2, 12, torch.bfloat16, 5)
    want = dst.clone()
    s, d = [29, 3, 4, 17], [0, 11, 5, 6]
    want[:, :, d] = src[:, :, s]
    gather_block_pairs(dst, src, torch.tensor(s + d, device="cuda", dtype=torch.int32))
    assert torch.equal(dst, want)


def test_device_copy_passed_at_is_when_the_device_ran_it() -> None:
    """A copy queued behind 25 ms of work is enqueued at once (no wait for the stream), and its
    `passed_at` falls after that work ran and no later than the host saw it pass."""
    import time

    from tandem.kv.block_copy import copy_blocks
    from tandem.kv.cache import KVCache

    src = KVCache(_pool(2, 30, torch.bfloat16, 6))
    dst = KVCache(torch.zeros(2, 2, 12, 16, 8, 128, dtype=torch.bfloat16, device="cuda"))
    copy_blocks(dst, [0], src, [1]).end.synchronize()  # compiled, pinned buffers warm
    queue_busy_ms(25)
    queued = time.monotonic()
    copy = copy_blocks(dst, [0, 11, 5], src, [29, 3, 4])
    enqueued = time.monotonic()
    assert enqueued - queued < 0.005, f"enqueueing the copy took {(enqueued - queued) * 1e3} ms"
    assert not copy.passed()
    copy.end.synchronize()
    seen = time.monotonic()
    at = copy.passed_at()
    assert queued + 0.015 < at <= seen + 1e-4, (queued, at, seen)
    assert torch.equal(dst.data[:, :, [0, 11, 5]], src.data[:, :, [29, 3, 4]])
