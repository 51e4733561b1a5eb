"""Calibration on CUDA (`tandem quantize --device cuda`): the same maths as on the CPU.

On a small random model: the block-wise (AWQ + autoround) checkpoint made on the GPU is close to
the CPU's, sequences are sampled on the GPU, end-to-end tuning (scales only, and with the codes)
lowers the held-out KL there, and the CLI writes a checkpoint that loads back. Skipped without
CUDA; run as `pytest tests/gpu` without TRITON_INTERPRET.
"""

from __future__ import annotations

import json

import pytest
import torch

from tandem.formats.weight import QuantizedWeight
from tests.test_e2e import _calib_file

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_block_wise_calibration_on_cuda_matches_cpu(model_factory, tmp_path) -> None:
    """AWQ + autoround on the GPU fits as well as on the CPU. The codes themselves need not agree:
    autoround's signed-gradient steps turn last-bit differences of the sums into other roundings,
    so the comparison is the quantized model's KL to the float model on the calibration text."""
    from tandem.formats.weight import dequantize_weights
    from tandem.model.loader import load_model
    from tandem.quant.pipeline import calibration_batch, on_device, quantize_model
    from tandem.quant.recipe import Recipe
    from tests.test_e2e import _kl

    _, path = model_factory("llama")
    calib = _calib_file(tmp_path, 700, 7)
    kl = {}
    for dev in ("cpu", "cuda"):
        loaded = load_model(path, torch.float32)
        float_w = dequantize_weights(loaded.weights, torch.float32)
        ids, _ = calibration_batch(loaded.tokenizer, calib, 64, 8192)
        if dev == "cuda":
            on_device(loaded, dev)
        for method in ("rtn", "awq-autoround"):
            w, _ = quantize_model(
                loaded, Recipe(), method, calib_path=calib, seq_len=64, log=lambda s: None,
                autoround_iters=20,
            )  # fmt: skip
            assert sum(isinstance(v, QuantizedWeight) for v in w.values()) == 21
            w = {k: v.to("cpu") for k, v in w.items()}
            kl[dev, method] = _kl(float_w, dequantize_weights(w, torch.float32), loaded.config, ids)
    assert abs(kl["cuda", "rtn"] / kl["cpu", "rtn"] - 1) < 1e-3  # no calibration: the same
    assert kl["cuda", "awq-autoround"] < 0.8 * kl["cuda", "rtn"], kl
    assert kl["cuda", "awq-autoround"] < 1.25 * kl["cpu", "awq-autoround"], kl


def test_sampling_and_e2e_on_cuda(model_factory, tmp_path) -> None:
    from tandem.formats.weight import dequantize_weights
    from tandem.model.loader import load_model
    from tandem.quant.e2e import e2e_tune, sample_sequences
    from tandem.quant.pipeline import calibration_batch, quantize_model
    from tandem.quant.recipe import Recipe

    _, path = model_factory("llama")
    loaded = load_model(path, torch.float32)
    cfg = loaded.config
    gpu_w = {k: v.to("cuda") for k, v in loaded.weights.items()}
    s = sample_sequences(gpu_w, cfg, 5, 24, seed=3, batch=4, device="cuda")
    assert s.shape == (5, 24) and s.device.type == "cpu"
    assert 0 <= int(s.min()) and int(s.max()) < cfg.vocab_size
    assert torch.equal(s, sample_sequences(gpu_w, cfg, 5, 24, seed=3, batch=4, device="cuda"))
    weights, _ = quantize_model(loaded, Recipe(), "rtn")
    calib, _ = calibration_batch(loaded.tokenizer, _calib_file(tmp_path, 700, 8), 64, 8192)
    float_w = {
        k: v.to("cuda") for k, v in dequantize_weights(loaded.weights, torch.float32).items()
    }
    for codes in (False, True):
        tuned, report = e2e_tune(
            float_w, weights, cfg, calib, steps=20, lr=3e-3, val_seqs=2, eval_every=5,
            codes=codes, codes_lr=0.01,
        )  # fmt: skip
        assert report.best_step > 0 and report.best_kl < 0.95 * report.start_kl, report.history
        for k, w in weights.items():
            if isinstance(w, QuantizedWeight):
                assert tuned[k].qweight.device.type == "cpu"
                if not codes:
                    assert torch.equal(tuned[k].qweight, w.qweight)


def test_e2e_cuda_graph_steps_equal_eager(model_factory, tmp_path) -> None:
    """QAT with each training step replayed as a CUDA graph computes what eager steps compute:
    the same held-out KL after every evaluation (FP32 matmuls, no TF32), past the warm-up steps
    and the capture, with the cosine schedule setting the learning rates in place, and the same
    packed codes, scales and zero points at the end."""
    from tandem.formats.weight import dequantize_weights
    from tandem.model.loader import load_model
    from tandem.quant.e2e import e2e_tune
    from tandem.quant.pipeline import calibration_batch, quantize_model
    from tandem.quant.recipe import Recipe

    _, path = model_factory("llama")
    loaded = load_model(path, torch.float32)
    weights, _ = quantize_model(loaded, Recipe(), "rtn")
    calib, _ = calibration_batch(loaded.tokenizer, _calib_file(tmp_path, 700, 8), 64, 8192)
    float_w = {
        k: v.to("cuda") for k, v in dequantize_weights(loaded.weights, torch.float32).items()
    }
    runs = {}
    for graphed in (False, True):
        runs[graphed] = e2e_tune(
            float_w, weights, loaded.config, calib, steps=16, lr=3e-3, val_seqs=2, eval_every=4,
            codes=True, codes_lr=0.05, cosine=True, cuda_graph=graphed,
        )  # fmt: skip
    (eager, rep_e), (graph, rep_g) = runs[False], runs[True]
    assert [s for s, _ in rep_g.history] == [0, 4, 8, 12, 16]
    assert rep_g.best_kl < 0.95 * rep_g.start_kl, rep_g.history
    for (_, a), (_, b) in zip(rep_e.history, rep_g.history, strict=True):
        assert abs(a - b) <= 1e-3 * a, (rep_e.history, rep_g.history)  # (STE roundings)
    assert rep_g.lr_factor == rep_e.lr_factor
    for k, w in eager.items():
        if isinstance(w, QuantizedWeight):
            g = graph[k]
            same = (g.codes() == w.codes()).float().mean()
            assert same > 0.9999, (k, same)  # a latent at a rounding boundary may fall either way
            assert torch.allclose(g.scales.float(), w.scales.float(), rtol=1e-2, atol=1e-6), k


def test_cli_quantizes_on_cuda(model_factory, tmp_path) -> None:
    import tandem
    from tandem.cli import main

    _, path = model_factory("llama")
    out = tmp_path / "q"
    rc = main(
        ["quantize", path, "--calib", _calib_file(tmp_path, 400, 9), "--calib-seq-len", "64",
         "--out", str(out), "--method", "awq-autoround", "--autoround-iters", "5",
         "--e2e-steps", "4", "--e2e-val-seqs", "2", "--e2e-generated", "3", "--e2e-codes",
         "--device", "cuda"]
    )  # fmt: skip
    assert rc == 0
    meta = json.loads((out / "quantization.json").read_text())
    assert meta["method"] == "awq-autoround+e2e"
    assert meta["e2e"]["trained"] == "codes, scales and zero points"
    llm = tandem.LLM(str(out), num_blocks=16)
    done = llm.generate([[5, 6, 7, 8]], tandem.SamplingParams(max_tokens=4, temperature=0))
    assert len(done[0].token_ids) >= 1
