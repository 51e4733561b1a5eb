"""The L2 weight prefetch of decode steps (tandem.kernels.prefetch): which bytes it asks for.

The prefetch itself runs only on sm_90 GPUs (tests/gpu/test_pdl_gpu.py checks that steps with it
are bit-equal to steps without); here: the chunking, the byte ranges of a GEMV's K ranges, the
setting's parser, and that nothing is launched where there is no GPU.
"""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import w4a16 as wk
from tandem.kernels.prefetch import L2Prefetch, chunks
from tandem.quant.format import quantize_rtn


def test_chunks_cover_each_range_in_aligned_pieces() -> None:
    got = chunks([(1000, 100), (4096, 0), (8192, 40000)], chunk_bytes=16384)
    assert got == [(992, 112), (8192, 16384), (24576, 16384), (40960, 7232)]
    assert all(a % 16 == 0 and s % 16 == 0 and 0 < s <= 16384 for a, s in got)


@pytest.mark.parametrize("bad", [0, 24, -16])
def test_chunks_reject_bad_chunk_sizes(bad: int) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        chunks([(0, 64)], chunk_bytes=bad)


def test_chunks_reject_negative_sizes() -> None:
    with pytest.raises(ValueError, match="negative range size"):
        chunks([(0, -1)])


def _covered(t: torch.Tensor, ranges) -> torch.Tensor:
    """Which elements of t's storage (as a flat [rows, n] array) the ranges cover."""
    es = t.element_size()
    base = t.data_ptr()
    flat = torch.zeros(t.untyped_storage().nbytes() // es, dtype=torch.bool)
    for a, s in ranges:
        if base <= a < base + flat.numel() * es:
            assert a + s <= base + flat.numel() * es, "range runs past the tensor's storage"
            flat[(a - base) // es : (a - base + s) // es] = True
    return flat


@pytest.mark.parametrize(
    "split,fraction,want",
    [
        (4, 0.25, [0, 1, 8, 9, 16, 17, 24, 25]),  # 8 groups a K range, the first 2 of each
        (8, 0.5, [0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29]),
        (1, 1.0, list(range(32))),
        (3, 0.01, [0, 11, 22]),  # 11 groups a K range (the last has 10): at least one of each
    ],
)
def test_gemv_ranges_are_the_first_groups_of_each_k_range(split, fraction, want) -> None:
    n, k = 96, 32 * 128
    w = wk.n_major(quantize_rtn(torch.randn(n, k), 4, 128))
    ranges = wk.gemv_prefetch_ranges(w, fraction, split)
    # Codes: word rows of group g are rows 16 g .. 16 g + 15 of the [KW, N] storage.
    rows = _covered(w.qweight, ranges).view(-1, n)
    assert rows.all(1).tolist() == [r // 16 in want for r in range(rows.shape[0])]
    assert not (rows.any(1) & ~rows.all(1)).any()  # whole rows only
    for t in (w.scales, w.mins):
        g = _covered(t, ranges).view(-1, n)
        assert g.all(1).tolist() == [i in want for i in range(32)]


def test_gemv_ranges_of_other_weights_are_prefixes() -> None:
    f = torch.randn(64, 256)
    assert wk.gemv_prefetch_ranges(f, 0.5) == [(f.data_ptr(), 64 * 256 * 4 // 2)]
    assert wk.gemv_prefetch_ranges(f, 0) == []
    row_major = quantize_rtn(torch.randn(64, 256), 4, 128)
    got = wk.gemv_prefetch_ranges(row_major, 1.0)
    assert got == [(t.data_ptr(), t.numel() * t.element_size())
                   for t in (row_major.qweight, row_major.scales, row_major.mins)]  # fmt: skip
    with pytest.raises(ValueError, match=">= 0"):
        wk.gemv_prefetch_ranges(f, -0.5)


def test_spec_parser_names_the_bad_entry() -> None:
    from tandem.model.llama import l2_prefetch_spec

    assert l2_prefetch_spec("o=1,gate_up=0.25") == {"o": 1.0, "gate_up": 0.25}
    assert l2_prefetch_spec("") == {} and l2_prefetch_spec("0") == {}
    with pytest.raises(ValueError, match="'attn=1'.*qkv, o, gate_up, down"):
        l2_prefetch_spec("o=1,attn=1")
    with pytest.raises(ValueError, match="'o'.*NAME=FRACTION"):
        l2_prefetch_spec("o")
    with pytest.raises(ValueError, match="'x' is not a number"):
        l2_prefetch_spec("down=x")
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        l2_prefetch_spec("down=2")


def test_nothing_is_launched_without_a_gpu(monkeypatch) -> None:
    pf = L2Prefetch([(torch.zeros(1024).data_ptr(), 4096)], "cpu")
    assert len(pf.chunks) == 1 and pf.nbytes == 4096 and not pf.enabled
    pf.launch()  # a no-op

    from tandem.model.config import ModelConfig
    from tandem.model.llama import LlamaModel
    from tandem.model.synthetic import random_llama_weights

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=256,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True,
                      eos_token_ids=[1])  # fmt: skip
    model = LlamaModel(cfg, random_llama_weights(cfg, "cpu", torch.float32), torch.float32, "cpu")
    monkeypatch.setenv("TANDEM_L2_PREFETCH", "o=1,down=0.5")
    assert model._l2_prefetch_plan(1) == {}
    monkeypatch.setenv("TANDEM_L2_PREFETCH", "o=3")
    with pytest.raises(ValueError, match="TANDEM_L2_PREFETCH"):
        model._l2_prefetch_plan(1)
