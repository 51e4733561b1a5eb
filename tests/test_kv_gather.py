"""The KV block gather off CUDA (its torch path) against copying block by block."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.kv_gather import gather_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_gather_blocks_copies_listed_blocks_only(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    src = torch.randn(2, 2, 9, 4, 2, 8, generator=g).to(dtype)
    dst = torch.randn(2, 2, 6, 4, 2, 8, generator=g).to(dtype)
    want = dst.clone()
    s, d = [8, 0, 3], [5, 1, 2]
    for a, b in zip(s, d, strict=True):
        want[:, :, b] = src[:, :, a]
    gather_blocks(dst, torch.tensor(d), src, torch.tensor(s))
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))


def test_gather_blocks_refuses_mismatched_pools() -> None:
    src, dst = torch.zeros(2, 2, 4, 4, 2, 8), torch.zeros(2, 2, 4, 4, 2, 16)
    with pytest.raises(ValueError, match="copying blocks of a"):
        gather_blocks(dst, torch.tensor([0]), src, torch.tensor([1]))
    with pytest.raises(ValueError, match="2 blocks into 1"):
        gather_blocks(src.clone(), torch.tensor([0]), src, torch.tensor([1, 2]))
