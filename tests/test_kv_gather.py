"""The KV block gather off CUDA (its torch path, and its kernel under the Triton interpreter)
against copying block by block."""

from __future__ import annotations

import pytest
import torch
from conftest import require_interpreter

from tandem.kernels import kv_gather
from tandem.kernels.kv_gather import gather_block_pairs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_gather_blocks_copies_listed_blocks_only(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    src = torch.randn(2, 2, 9, 4, 2, 8, generator=g).to(dtype)
    dst = torch.randn(2, 2, 6, 4, 2, 8, generator=g).to(dtype)
    want = dst.clone()
    s, d = [8, 0, 3], [5, 1, 2]
    for a, b in zip(s, d, strict=True):
        want[:, :, b] = src[:, :, a]
    gather_block_pairs(dst, src, torch.tensor(s + d))
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))


def test_gather_blocks_refuses_mismatched_pools() -> None:
    src, dst = torch.zeros(2, 2, 4, 4, 2, 8), torch.zeros(2, 2, 4, 4, 2, 16)
    with pytest.raises(ValueError, match="copying blocks of a"):
        gather_block_pairs(dst, src, torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="3 block ids: not source and destination pairs"):
        gather_block_pairs(src.clone(), src, torch.tensor([1, 2, 0]))


def _blockwise(dst: torch.Tensor, src: torch.Tensor, s: list[int], d: list[int]) -> torch.Tensor:
    want = dst.clone()
    for a, b in zip(s, d, strict=True):
        want.view(torch.uint8)[:, :, b] = src.view(torch.uint8)[:, :, a]
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_kernel_copies_listed_blocks_of_every_plane(dtype, index_dtype) -> None:
    """The kernel itself (interpreted), reading any dtype as 32-bit words: scattered blocks,
    a pool of another size, blocks of 2 words and of more than one chunk."""
    require_interpreter(kv_gather._gather_blocks_kernel)
    g = torch.Generator().manual_seed(1)
    for tail in ((4, 2, 8), (1, 1, 8), (2, 8, 320)):
        src = torch.randn(3, 2, 40, *tail, generator=g).to(dtype)
        dst = torch.randn(3, 2, 25, *tail, generator=g).to(dtype)
        s, d = [37, 2, 19, 5, 0, 33, 11], [24, 0, 7, 13, 3, 1, 18]
        want = _blockwise(dst, src, s, d)
        words = kv_gather._block_words(src)
        assert words == src[0, 0, 0].numel() * src.element_size() // 4
        kv_gather._launch(dst, src, torch.tensor(s + d, dtype=index_dtype), words)
        assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8)), (dtype, tail)


def test_block_pairs_take_sources_then_destinations() -> None:
    g = torch.Generator().manual_seed(2)
    src = torch.randn(2, 2, 9, 4, 2, 8, generator=g)
    dst = torch.randn(2, 2, 6, 4, 2, 8, generator=g)
    want = _blockwise(dst, src, [8, 0, 3], [5, 1, 2])
    gather_block_pairs(dst, src, torch.tensor([8, 0, 3, 5, 1, 2]))
    assert torch.equal(dst, want)
    with pytest.raises(ValueError, match="5 block ids"):
        gather_block_pairs(dst, src, torch.tensor([0, 1, 2, 3, 4]))


def test_blocks_that_are_not_whole_words_are_not_for_the_kernel() -> None:
    assert kv_gather._block_words(torch.zeros(2, 2, 4, 3, dtype=torch.int8)) is None
    assert kv_gather._block_words(torch.zeros(2, 2, 4, 8).transpose(2, 3)) is None
    assert kv_gather._block_words(torch.zeros(2, 2, 4, 2, 6, dtype=torch.bfloat16)) == 6
