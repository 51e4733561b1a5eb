"""The host KV tier's copy stream on CUDA (tandem/kv/host_tier.py): blocks saved while the next
kernels overwrite them come back byte for byte, a restore's blocks hold the saved KV for the
kernel that reads them next, and the engine (asynchronous scheduling, CUDA graphs) serves a
prefix from the host tier with the tokens it gives from its own pool.

Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

import tandem
from tandem.kv.block_pool import BlockPool
from tandem.kv.cache import KVCache
from tandem.kv.host_tier import HostTier
from tests.engine_checks import rand_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _busy(x: torch.Tensor, n: int = 30) -> None:
    """Queue some milliseconds of work on the current stream."""
    for _ in range(n):
        x = x @ x
        x = x / x.norm()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_copies_are_ordered_against_the_compute_stream(dtype):
    nb = 64
    shape = (4, 2, nb, 16, 8, 128)
    data = torch.randint(-100, 100, shape, device="cuda").to(dtype)
    scales = torch.rand((4, 2, nb, 8), device="cuda") if dtype == torch.int8 else None
    kv = KVCache(data, scales)
    pool = BlockPool(nb)
    tier = HostTier(kv, pool, 2 * nb)
    assert tier.data.is_pinned()
    blocks = pool.allocate(nb)
    for i, b in enumerate(blocks):
        pool.cache(b, b"k" + i.to_bytes(2, "little"))
    pool.free(reversed(blocks))
    busy = torch.randn(2048, 2048, device="cuda")
    _busy(busy)  # a step in flight
    want = kv.data.clone()
    want_scales = kv.scales.clone() if scales is not None else None
    got = pool.allocate(nb)  # every block is evicted into the tier ...
    assert tier.blocks_to_host == nb
    kv.data.fill_(7)  # ... and overwritten by the next kernel on the compute stream
    if scales is not None:
        kv.scales.fill_(7)
    pool.free(reversed(got))
    names = [b"k" + i.to_bytes(2, "little") for i in range(nb)]
    perm = torch.randperm(nb).tolist()
    _busy(busy)
    tier.restore(tier.lock(names), perm)  # block i's KV into pool block perm[i]
    out = kv.data[:, :, perm].clone()  # the next kernel reads them
    torch.cuda.synchronize()
    assert torch.equal(out, want[:, :, blocks])
    if scales is not None:
        assert torch.equal(kv.scales[:, :, perm], want_scales[:, :, blocks])
    assert tier.num_locked == 0 and tier.blocks_to_device == nb


def test_engine_serves_a_host_tier_prefix_like_its_own_pool(model_factory):
    _, path = model_factory("llama")
    a = rand_ids(50, 1)
    greedy = tandem.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm = tandem.LLM(path, device="cuda", dtype="float32", num_blocks=16, kv_host_cache_gb=0.0005)
    eng = llm.engine
    assert eng.async_scheduling
    first = llm.generate([a], greedy)[0].token_ids
    from_pool = llm.generate([a], greedy)[0].token_ids  # a hit in the pool
    llm.generate([rand_ids(60, 100 + i) for i in range(4)], greedy)  # a leaves the pool
    assert eng.prefix_cache.match(a, 49) == ([], [])
    from_host = llm.generate([a], greedy)[0].token_ids
    assert eng.prefix_cache.host_hit_tokens == 48
    assert from_host == from_pool == first
    assert eng.pool.num_used == 0 and eng.host_tier.num_locked == 0
    assert eng.host_tier.bandwidth >= 0
