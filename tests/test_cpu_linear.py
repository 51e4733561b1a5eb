"""CPU linear layers through oneDNN with weights packed at load (tandem.layers.linear)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.layers import linear as layer

pytestmark = pytest.mark.skipif(
    not layer.CPU_PACKED_LINEAR, reason="torch built without oneDNN (mkldnn)"
)


@pytest.mark.parametrize("rows", [1, 3, 8, 37])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g)
    x = torch.randn(rows, 64, generator=g)
    b = torch.randn(96, generator=g) if with_bias else None
    packed = layer.pack_cpu_weight(w)
    assert packed.is_mkldnn
    with torch.inference_mode():
        got = layer.cpu_linear(x, packed, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)


def test_only_float32_cpu_weights_are_packed() -> None:
    w16 = torch.randn(8, 8, dtype=torch.bfloat16)
    assert layer.pack_cpu_weight(w16) is w16
    w = torch.randn(8, 8)
    packed = layer.pack_cpu_weight(w)
    assert layer.pack_cpu_weight(packed) is packed  # packing twice is a no-op


def test_cpu_model_holds_packed_weights(model_factory) -> None:
    import tandem

    _, path = model_factory("llama")
    model = tandem.LLM(path, num_blocks=32).engine.model
    lw = model.layers[0]
    assert all(getattr(lw, f).weight.is_mkldnn for f in ("qkv", "o", "gate_up", "down"))
    assert model.lm_head.packed.is_mkldnn and not model.embed.weight.is_mkldnn
