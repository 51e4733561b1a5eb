"""GPTQ (second-order error compensation) on CPU: it beats round-to-nearest on the inputs it saw,
what it packs is what it assumed, and `tandem quantize --method gptq` writes a loadable model."""

from __future__ import annotations

import json

import pytest
import torch

import tandem
from tandem.formats.weight import LayerSpec, quantize_rtn
from tandem.quant.gptq import gptq_layer


def _correlated_inputs(t: int, k: int, seed: int) -> torch.Tensor:
    """Inputs [t, k] with correlated channels and a few loud ones, as real activations have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k // 4, generator=g) @ torch.randn(k // 4, k, generator=g)
    x = x + 0.3 * torch.randn(t, k, generator=g)
    x[:, :: k // 8] *= 8.0
    return x


def _output_error(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    return float((x.double() @ (w.double() - q.double()).T).pow(2).sum())


@pytest.mark.parametrize("zero_point", [True, False])
@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_output_error_below_rtn(zero_point: bool, act_order: bool) -> None:
    """On its calibration inputs a GPTQ layer's output error is well below RTN's, and the
    relative errors it reports are the measured ones."""
    k, n, group = 200, 24, 64  # K not a multiple of the group: a partial last group
    x = _correlated_inputs(512, k, seed=0)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05
    spec = LayerSpec(bits=4, group_size=group, zero_point=zero_point)
    qw, rel_rtn, rel_gptq = gptq_layer(w, x.T @ x, spec, act_order=act_order)
    rtn = quantize_rtn(w, 4, group, zero_point).dequantize()
    e_rtn, e_gptq = _output_error(x, w, rtn), _output_error(x, w, qw.dequantize())
    assert e_gptq < 0.7 * e_rtn
    energy = float((x.double() @ w.double().T).pow(2).sum())
    assert rel_rtn == pytest.approx(e_rtn / energy, rel=1e-3)
    assert rel_gptq == pytest.approx(e_gptq / energy, rel=1e-3)
    assert qw.shape == (n, k) and (qw.bits, qw.group_size, qw.zero_point) == (4, group, zero_point)


@pytest.mark.parametrize("zero_point", [True, False])
def test_gptq_without_correlation_is_rtn_bit_for_bit(zero_point: bool) -> None:
    """With uncorrelated inputs (diagonal Hessian) there is no error to compensate and no
    clipping: GPTQ must pick exactly RTN's codes, FP16 scales and zero points. This pins the
    arithmetic GPTQ assumes to the packed format's (`QuantizedWeight.dequantize`)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 160, generator=g) * 0.1
    h = torch.diag(torch.rand(160, generator=g) + 0.5)
    spec = LayerSpec(bits=4, group_size=32, zero_point=zero_point)
    qw, _, _ = gptq_layer(w, h, spec, clip_ratios=(1.0,))
    rtn = quantize_rtn(w, 4, 32, zero_point)
    assert torch.equal(qw.qweight, rtn.qweight)
    assert torch.equal(qw.scales, rtn.scales) and torch.equal(qw.mins, rtn.mins)


def test_gptq_packs_what_it_compensated_for() -> None:
    """The error GPTQ propagates is computed on the values the format dequantizes to: refeeding
    the dequantized weight quantizes to the same codes and grid (every value lies on its grid)."""
    k = 128
    x = _correlated_inputs(256, k, seed=3)
    w = torch.randn(8, k, generator=torch.Generator().manual_seed(4)) * 0.05
    qw, _, _ = gptq_layer(w, x.T @ x, LayerSpec(bits=4, group_size=32), clip_ratios=(1.0,))
    deq = qw.dequantize()
    codes = qw.codes().float().view(8, k // 32, 32)
    again = codes * qw.scales.float()[:, :, None]
    again = again + qw.mins.float()[:, :, None]
    assert torch.equal(again.view(8, k), deq)
    assert ((codes >= 0) & (codes <= 15)).all()


def test_quantize_gptq_checkpoint_loads(model_factory, tmp_path) -> None:
    """`tandem quantize --method gptq` writes a checkpoint tandem.LLM loads, holding the weights
    GPTQ made."""
    from tandem.cli import main
    from tandem.formats.weight import QuantizedWeight
    from tandem.model.loader import load_model

    _, path = model_factory("llama")
    calib = tmp_path / "calib.txt"
    g = torch.Generator().manual_seed(0)
    calib.write_text(" ".join(f"w{i}" for i in torch.randint(3, 512, (600,), generator=g).tolist()))
    out = tmp_path / "q"
    rc = main(["quantize", path, "--method", "gptq", "--calib", str(calib), "--out", str(out),
               "--calib-seq-len", "64"])  # fmt: skip
    assert rc == 0
    meta = json.loads((out / "quantization.json").read_text())
    assert meta["method"] == "gptq" and meta["calibration"]["tokens"] % 64 == 0
    errs = meta["calibration"]["gptq_relative_output_error"]
    assert len(errs) == 3 * 7  # every linear layer of the 3-layer model
    assert sum(e["gptq"] for e in errs.values()) < sum(e["rtn"] for e in errs.values())
    back = load_model(str(out))
    w = back.weights["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(w, QuantizedWeight) and (w.bits, w.group_size) == (4, 128)
    llm = tandem.LLM(str(out), num_blocks=16)
    done = llm.generate([[5, 6, 7, 8]], tandem.SamplingParams(max_tokens=5, temperature=0))
    assert len(done[0].token_ids) >= 1
