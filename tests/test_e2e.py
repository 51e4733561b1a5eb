"""End-to-end tuning of group scales and zero points (`tandem.quant.e2e`) on CPU: on a small
random model the tuned model's KL divergence to the float model is lower than before, the integer
codes do not change, the checkpoint round-trips, and bad options are refused with a message."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tandem.formats.weight import QuantizedWeight, dequantize_weights
from tandem.model.rotary import cos_sin_table
from tandem.quant.e2e import check_options, e2e_tune, forward_logits


def _calib_file(tmp_path, words: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    path = tmp_path / "calib.txt"
    ids = torch.randint(3, 512, (words,), generator=g).tolist()
    path.write_text(" ".join(f"w{i}" for i in ids))
    return str(path)


def _kl(float_w, quant_w, cfg, ids: torch.Tensor) -> float:
    """Mean KL (float -> quantized) per token over `ids` [S, L]."""
    s, n = ids.shape
    cs = cos_sin_table(cfg, n, "cpu")
    d = cfg.head_dim
    cos, sin = cs[:, None, : d // 2].repeat(s, 1, 1), cs[:, None, d // 2 :].repeat(s, 1, 1)
    with torch.no_grad():
        t = F.log_softmax(forward_logits(float_w, cfg, ids, cos, sin), -1)
        q = F.log_softmax(forward_logits(quant_w, cfg, ids, cos, sin), -1)
    return float(F.kl_div(q, t, log_target=True, reduction="sum")) / (s * n)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # untied head; tied head with biases
def test_tuning_lowers_kl_and_keeps_codes(model_factory, tmp_path, kind) -> None:
    from tandem.model.loader import load_model
    from tandem.quant.pipeline import calibration_batch, quantize_model
    from tandem.quant.recipe import Recipe

    _, path = model_factory(kind)
    loaded = load_model(path, torch.float32)
    cfg = loaded.config
    weights, _ = quantize_model(loaded, Recipe(), "rtn")
    calib, _ = calibration_batch(loaded.tokenizer, _calib_file(tmp_path, 700, 0), 64, 8192)
    float_w = dequantize_weights(loaded.weights, torch.float32)
    tuned, report = e2e_tune(
        float_w, weights, cfg, calib, steps=30, lr=3e-3, batch=2, val_seqs=2, eval_every=5
    )
    assert report.train_seqs == calib.shape[0] - 2 and report.val_seqs == 2
    assert 0 < report.best_step <= 30 and report.best_kl < report.start_kl
    before = _kl(float_w, dequantize_weights(weights, torch.float32), cfg, calib)
    after = _kl(float_w, dequantize_weights(tuned, torch.float32), cfg, calib)
    assert after < 0.9 * before
    n = 0
    for k, w in weights.items():
        if isinstance(w, QuantizedWeight):
            t = tuned[k]
            assert isinstance(t, QuantizedWeight)
            assert torch.equal(t.qweight, w.qweight)  # the codes are untouched
            assert (t.bits, t.group_size, t.in_features, t.zero_point) == (
                w.bits,
                w.group_size,
                w.in_features,
                w.zero_point,
            )
            assert t.scales.dtype == t.mins.dtype == torch.float16 and (t.scales > 0).all()
            n += 1
        else:
            assert tuned[k] is w
    assert n == 3 * 7
    changed = [
        not torch.equal(tuned[k].scales, w.scales) or not torch.equal(tuned[k].mins, w.mins)
        for k, w in weights.items()
        if isinstance(w, QuantizedWeight)
    ]
    assert sum(changed) > n // 2


def test_start_is_kept_when_no_step_helps(model_factory, tmp_path) -> None:
    """A learning rate far too large makes every step worse: early stopping returns the start."""
    from tandem.model.loader import load_model
    from tandem.quant.pipeline import calibration_batch, quantize_model
    from tandem.quant.recipe import Recipe

    _, path = model_factory("llama")
    loaded = load_model(path, torch.float32)
    weights, _ = quantize_model(loaded, Recipe(), "rtn")
    calib, _ = calibration_batch(loaded.tokenizer, _calib_file(tmp_path, 400, 1), 64, 8192)
    float_w = dequantize_weights(loaded.weights, torch.float32)
    tuned, report = e2e_tune(
        float_w, weights, loaded.config, calib, steps=4, lr=5.0, val_seqs=2, eval_every=1
    )
    assert report.best_step == 0 and report.best_kl == report.start_kl
    assert all(tuned[k] is w for k, w in weights.items())


@pytest.mark.parametrize(
    "steps, lr, batch, val_seqs, every, message",
    [
        (-1, 1e-4, 2, 4, 10, "steps must be an integer >= 0"),
        (10, 0.0, 2, 4, 10, "lr must be > 0"),
        (10, 1e-4, 0, 4, 10, "batch must be at least 1"),
        (10, 1e-4, 2, 0, 10, "at least 1 held-out calibration sequence"),
        (10, 1e-4, 2, 4, 0, "eval_every must be an integer >= 1"),
    ],
)
def test_bad_options_are_refused(steps, lr, batch, val_seqs, every, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_options(steps, lr, batch, val_seqs, every)
    with pytest.raises(ValueError, match="generated sequences must be an integer >= 0"):
        check_options(10, 1e-4, 2, 4, 10, -1)


def test_sampled_sequences_follow_the_model(model_factory) -> None:
    """`sample_sequences` draws [count, length] in-vocabulary ids, the same for the same seed,
    and (greedy, temperature near 0) the continuation the model itself predicts."""
    from tandem.model.loader import load_model
    from tandem.quant.e2e import sample_sequences

    _, path = model_factory("llama")
    loaded = load_model(path, torch.float32)
    cfg = loaded.config
    a = sample_sequences(loaded.weights, cfg, 5, 12, seed=3, batch=2)
    assert a.shape == (5, 12) and 0 <= int(a.min()) and int(a.max()) < cfg.vocab_size
    assert torch.equal(a, sample_sequences(loaded.weights, cfg, 5, 12, seed=3, batch=2))
    g = sample_sequences(loaded.weights, cfg, 2, 8, seed=1, temperature=1e-4)
    cs = cos_sin_table(cfg, 8, "cpu")
    d = cfg.head_dim
    cos, sin = cs[:, None, : d // 2].repeat(2, 1, 1), cs[:, None, d // 2 :].repeat(2, 1, 1)
    with torch.no_grad():
        logits = forward_logits(loaded.weights, cfg, g, cos, sin).view(2, 8, -1)
    assert torch.equal(logits[:, :-1].argmax(-1), g[:, 1:])


def test_quantize_model_e2e_round_trips(model_factory, tmp_path) -> None:
    """`quantize_model(..., e2e_steps=N)` records what it did in quantization.json and its
    checkpoint loads back bit for bit; too little calibration text for the held-out split is a
    clear error before any work."""
    from tandem.model.loader import load_model
    from tandem.quant.checkpoint import save_quantized
    from tandem.quant.pipeline import quantize_model
    from tandem.quant.recipe import Recipe

    _, path = model_factory("llama")
    loaded = load_model(path, torch.float32)
    short = _calib_file(tmp_path, 130, 2)  # two sequences of 64
    with pytest.raises(ValueError, match="has none left to train on"):
        quantize_model(
            loaded, Recipe(), "rtn", calib_path=short, seq_len=64, e2e_steps=2, e2e_val_seqs=2
        )
    calib = _calib_file(tmp_path, 400, 3)
    weights, info = quantize_model(
        loaded,
        Recipe(),
        "awq",
        calib_path=calib,
        seq_len=64,
        log=lambda s: None,
        e2e_steps=6,
        e2e_lr=3e-3,
        e2e_val_seqs=2,
        e2e_eval_every=2,
        e2e_generated=3,
    )
    assert info["method"] == "awq+e2e"
    e2e = info["e2e"]
    assert (e2e["steps"], e2e["held_out_seqs"], e2e["generated_seqs"]) == (6, 2, 3)
    # The sampled sequences go last, so the two held out are sampled ones.
    assert e2e["held_out"] == "sampled sequences"
    assert e2e["train_seqs"] == e2e["calibration_seqs"] + 3 - 2
    assert e2e["held_out_kl"]["best"] <= e2e["held_out_kl"]["start"]
    out = tmp_path / "q"
    save_quantized(str(out), loaded.config, weights, loaded.tokenizer, info)
    assert json.loads((out / "quantization.json").read_text())["e2e"]["lr"] == 3e-3
    back = load_model(str(out), torch.float32)
    for k, w in weights.items():
        if isinstance(w, QuantizedWeight):
            assert torch.equal(back.weights[k].dequantize(), w.dequantize())


def test_cli_e2e(model_factory, tmp_path, capsys) -> None:
    """`tandem quantize --e2e-steps` refuses bad options (exit 2, a message naming the option)
    and writes a checkpoint that tandem.LLM serves."""
    import tandem
    from tandem.cli import main

    _, path = model_factory("llama")
    calib = _calib_file(tmp_path, 400, 4)
    out = tmp_path / "q"
    base = ["quantize", path, "--calib", calib, "--out", str(out), "--calib-seq-len", "64"]
    assert main(base + ["--method", "rtn", "--e2e-steps", "3", "--e2e-lr", "-1"]) == 2
    assert "e2e lr must be > 0" in capsys.readouterr().err
    assert main(base + ["--method", "rtn", "--e2e-steps", "3", "--e2e-val-seqs", "0"]) == 2
    assert "held-out calibration sequence" in capsys.readouterr().err
    rc = main(base + ["--method", "rtn", "--e2e-steps", "3", "--e2e-val-seqs", "2"])
    assert rc == 0
    meta = json.loads((out / "quantization.json").read_text())
    assert meta["method"] == "rtn+e2e" and meta["e2e"]["steps"] == 3
    llm = tandem.LLM(str(out), num_blocks=16)
    done = llm.generate([[5, 6, 7, 8]], tandem.SamplingParams(max_tokens=5, temperature=0))
    assert len(done[0].token_ids) >= 1


def test_calibration_with_sampled_sequences(model_factory, tmp_path, capsys) -> None:
    """`--calib-generated N` calibrates the base method on the calibration file's sequences plus N
    sampled from the float model (another seed than e2e's, so e2e's held-out sampled sequences
    are not among them); quantization.json records it; a negative count is refused by name."""
    from tandem.cli import main
    from tandem.model.loader import load_model
    from tandem.quant.e2e import sample_sequences
    from tandem.quant.pipeline import CALIB_GENERATED_SEED, quantize_model
    from tandem.quant.recipe import Recipe

    _, path = model_factory("llama")
    loaded = load_model(path, torch.float32)
    calib = _calib_file(tmp_path, 400, 5)  # 6 sequences of 64 tokens
    w0, plain = quantize_model(loaded, Recipe(), "gptq", calib_path=calib, seq_len=64, log=print)
    w, info = quantize_model(
        loaded, Recipe(), "gptq", calib_path=calib, seq_len=64, log=print, generated=3
    )
    assert "+ 3 x 64 tokens sampled from the float model" in capsys.readouterr().out
    cal = info["calibration"]
    assert cal["generated_seqs"] == 3 and cal["tokens"] == plain["calibration"]["tokens"] + 3 * 64
    # More calibration text changes GPTQ's Hessians and so its codes.
    assert any(
        not torch.equal(w[k].qweight, w0[k].qweight) for k in w if isinstance(w[k], QuantizedWeight)
    )
    assert CALIB_GENERATED_SEED != 0  # e2e samples with seed 0
    assert not torch.equal(
        sample_sequences(loaded.weights, loaded.config, 2, 16, seed=0),
        sample_sequences(loaded.weights, loaded.config, 2, 16, seed=CALIB_GENERATED_SEED),
    )
    out = tmp_path / "q"
    base = ["quantize", path, "--calib", calib, "--out", str(out), "--calib-seq-len", "64"]
    assert main(base + ["--method", "gptq", "--calib-generated", "-1"]) == 2
    assert "calib-generated must be an integer >= 0" in capsys.readouterr().err
    assert main(base + ["--method", "gptq", "--calib-generated", "2"]) == 0
    meta = json.loads((out / "quantization.json").read_text())
    assert meta["calibration"]["generated_seqs"] == 2


def test_training_codes_moves_codes_and_packs_what_it_trained(model_factory, tmp_path) -> None:
    """`codes=True` (quantization-aware training): codes change, stay in range, the KL drops, and
    the packed checkpoint holds exactly the weight the forward pass used."""
    from tandem.model.loader import load_model
    from tandem.quant.e2e import GroupParams
    from tandem.quant.pipeline import calibration_batch, quantize_model
    from tandem.quant.recipe import Recipe

    _, path = model_factory("llama")
    loaded = load_model(path, torch.float32)
    cfg = loaded.config
    weights, _ = quantize_model(loaded, Recipe(), "rtn")
    calib, _ = calibration_batch(loaded.tokenizer, _calib_file(tmp_path, 700, 6), 64, 8192)
    float_w = dequantize_weights(loaded.weights, torch.float32)
    tuned, report = e2e_tune(
        float_w,
        weights,
        cfg,
        calib,
        steps=30,
        lr=3e-3,
        batch=2,
        val_seqs=2,
        eval_every=5,
        codes=True,
        codes_lr=0.05,
    )
    assert report.best_step > 0 and report.best_kl < report.start_kl
    before = _kl(float_w, dequantize_weights(weights, torch.float32), cfg, calib)
    assert _kl(float_w, dequantize_weights(tuned, torch.float32), cfg, calib) < 0.9 * before
    # The packed weight is the forward pass's: latents rounded and clamped to the code range,
    # FP16 scale and zero point.
    w0 = weights["model.layers.0.mlp.down_proj.weight"]
    gp = GroupParams(w0, codes=True)
    with torch.no_grad():
        gp.c.add_(torch.rand(gp.c.shape, generator=torch.Generator().manual_seed(0)) * 3 - 1.5)
        gp.a.fill_(0.01)
        gp.b.fill_(-0.02)
    packed = gp.packed()
    assert torch.allclose(packed.dequantize(torch.float32), gp.weight(), rtol=0, atol=1e-6)
    moved = packed.codes() != w0.codes()
    assert 0.5 < moved.float().mean() < 0.9  # |offset| > 0.5 for two thirds of the codes
    assert packed.codes().min() == 0 and packed.codes().max() == 15
    # The latents get gradients: one step moves them.
    gp.weight().sum().backward()
    assert gp.c.grad is not None and gp.c.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="codes lr must be > 0"):
        e2e_tune(float_w, weights, cfg, calib, steps=1, val_seqs=2, codes=True, codes_lr=0.0)
    with pytest.raises(ValueError, match="cuda_graph needs the weights on a CUDA device"):
        e2e_tune(float_w, weights, cfg, calib, steps=1, val_seqs=2, cuda_graph=True)


def test_cli_device_is_checked(model_factory, tmp_path, capsys) -> None:
    """`tandem quantize --device` names what is wrong with a device it cannot use."""
    from tandem.cli import main

    _, path = model_factory("llama")
    out = str(tmp_path / "q")
    assert main(["quantize", path, "--out", out, "--method", "rtn", "--device", "abacus"]) == 2
    assert "--device 'abacus' is not a device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["quantize", path, "--out", out, "--method", "rtn", "--device", "cuda"]) == 2
        assert "has no CUDA GPU" in capsys.readouterr().err


def test_time_limit_and_cosine_schedule(model_factory, tmp_path) -> None:
    """A time limit stops tuning at the first evaluation past it (the best state kept); the
    cosine schedule runs the same loop with decaying learning rates."""
    from tandem.model.loader import load_model
    from tandem.quant.pipeline import calibration_batch, quantize_model
    from tandem.quant.recipe import Recipe

    _, path = model_factory("llama")
    loaded = load_model(path, torch.float32)
    weights, _ = quantize_model(loaded, Recipe(), "rtn")
    calib, _ = calibration_batch(loaded.tokenizer, _calib_file(tmp_path, 400, 10), 64, 8192)
    float_w = dequantize_weights(loaded.weights, torch.float32)
    _, report = e2e_tune(
        float_w, weights, loaded.config, calib, steps=50, lr=3e-3, val_seqs=2, eval_every=20,
        time_limit_s=0.0,
    )  # fmt: skip
    assert report.stopped_at == 1 and [s for s, _ in report.history] == [0, 1]
    _, report = e2e_tune(
        float_w, weights, loaded.config, calib, steps=6, lr=3e-3, val_seqs=2, eval_every=2,
        cosine=True, codes=True,
    )  # fmt: skip
    assert report.stopped_at is None and [s for s, _ in report.history] == [0, 2, 4, 6]
    assert report.best_kl < report.start_kl
    assert report.lr_factor == pytest.approx(0.0, abs=1e-12)  # decayed to 0 at the last step
    # A clock that ends first: the cosine runs over the time limit, so the step that reaches it
    # has decayed fully although few of the 10**6 steps ran.
    _, report = e2e_tune(
        float_w, weights, loaded.config, calib, steps=10**6, lr=3e-3, val_seqs=2, eval_every=2,
        cosine=True, time_limit_s=0.5,
    )  # fmt: skip
    assert report.stopped_at is not None and report.stopped_at < 10**6
    assert report.lr_factor == pytest.approx(0.0, abs=1e-12)


def test_tf32_option_is_recorded_and_restored(model_factory, tmp_path) -> None:
    """`--e2e-tf32` is written into quantization.json, and the process's TF32 setting is what it
    was before tuning, also when tuning fails."""
    from tandem.cli import main

    _, path = model_factory("llama")
    calib = _calib_file(tmp_path, 400, 12)
    out = tmp_path / "q"
    before = torch.backends.cuda.matmul.allow_tf32
    args = ["quantize", path, "--calib", calib, "--out", str(out), "--calib-seq-len", "64",
            "--method", "rtn", "--e2e-steps", "2", "--e2e-val-seqs", "2", "--e2e-tf32"]  # fmt: skip
    assert main(args) == 0
    assert json.loads((out / "quantization.json").read_text())["e2e"]["matmul"] == "tf32"
    assert torch.backends.cuda.matmul.allow_tf32 == before
    assert main(args[:-1]) == 0
    assert "matmul" not in json.loads((out / "quantization.json").read_text())["e2e"]
    from tandem.quant.e2e import tf32_matmuls

    with pytest.raises(ValueError, match="holds out"), tf32_matmuls(True):
        assert torch.backends.cuda.matmul.allow_tf32
        e2e_tune({}, {}, None, torch.zeros(2, 8, dtype=torch.long), val_seqs=4)
    assert torch.backends.cuda.matmul.allow_tf32 == before


def test_perplexity_reports_each_window(model_factory) -> None:
    """perplexity's per-window mean NLLs are those of each window scored alone, and average to
    its total (windows of equal length)."""
    import math

    from tandem.model.llama import LlamaModel
    from tandem.model.loader import load_model
    from tandem.quant.eval import perplexity

    _, path = model_factory("llama")
    loaded = load_model(path, torch.float32)
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, "cpu", 64)
    ids = torch.randint(
        0, loaded.config.vocab_size, (96,), generator=torch.Generator().manual_seed(3)
    )
    ids = ids.tolist()
    both = perplexity(model, ids, window=32, decode_tokens=8)
    assert len(both["window_nll"]) == 3
    assert sum(both["window_nll"]) / 3 == pytest.approx(both["nll"], rel=1e-9)
    assert both["ppl"] == pytest.approx(math.exp(both["nll"]), rel=1e-12)
    for i, w_nll in enumerate(both["window_nll"]):
        alone = perplexity(model, ids[32 * i : 32 * (i + 1)], window=32, decode_tokens=8)
        assert alone["window_nll"] == [pytest.approx(w_nll, rel=1e-6)]
    # Windows batched as sequences (one prefill, then decode steps for all): the same per-window
    # NLLs but for rounding, with a bf16, an FP8 and an INT8 cache, and a last batch not full.
    for kv_dtype in (None, torch.float8_e4m3fn, torch.int8):
        one = perplexity(model, ids, window=32, kv_dtype=kv_dtype, decode_tokens=8)
        for batch in (2, 3, 8):
            many = perplexity(
                model, ids, window=32, kv_dtype=kv_dtype, decode_tokens=8, batch=batch
            )
            assert many["tokens"] == one["tokens"] == 93
            assert many["window_nll"] == pytest.approx(one["window_nll"], rel=1e-5)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        perplexity(model, ids, window=32, batch=0)
    with pytest.raises(ValueError, match="need at least 32 tokens"):
        perplexity(model, ids[:20], window=32)


def test_second_round_keeps_the_first(model_factory, tmp_path) -> None:
    """Tuning a tuned checkpoint again (`tune_end_to_end` on QAT weights read back) records both
    rounds: the method gains another "+e2e", the new record holds the first as "previous"; and the
    bench names such checkpoints and refuses a mismatched reuse by its rounds."""
    import importlib.util
    import os

    from tandem.model.loader import load_model
    from tandem.model.quantized_checkpoint import read_quantization
    from tandem.quant.checkpoint import info_of, save_quantized
    from tandem.quant.pipeline import quantize_model, tune_end_to_end
    from tandem.quant.recipe import Recipe

    _, path = model_factory("llama")
    loaded = load_model(path, torch.float32)
    calib = _calib_file(tmp_path, 400, 6)
    opts = dict(calib_path=calib, seq_len=64, log=lambda s: None, val_seqs=2, eval_every=2)
    w1, info1 = quantize_model(
        loaded, Recipe(), "rtn", calib_path=calib, seq_len=64, log=lambda s: None, e2e_steps=4,
        e2e_val_seqs=2, e2e_eval_every=2, e2e_codes=True, e2e_generated=0,
    )  # fmt: skip
    out1 = tmp_path / "q1"
    save_quantized(str(out1), loaded.config, w1, loaded.tokenizer, info1)
    meta1 = read_quantization(str(out1))
    back = load_model(str(out1), torch.float32)
    base = info_of(meta1)
    w2, info2 = tune_end_to_end(loaded, back.weights, base, 4, codes=True, generated=0, **opts)
    assert info2["method"] == "rtn+e2e+e2e"
    assert info2["e2e"]["previous"] == meta1["e2e"] and "previous" not in meta1["e2e"]
    # The second round starts where the first ended: its start KL is the first one's end state.
    assert info2["e2e"]["held_out_kl"]["start"] == pytest.approx(
        meta1["e2e"]["held_out_kl"]["best"], rel=1e-4
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "quant_quality", os.path.join(root, "bench", "quant_quality.py")
    )
    qq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qq)
    assert qq.bench_method(info2) == "rtn-qat-qat" and qq.bench_method(info1) == "rtn-qat"
    assert qq.base_method("awq-autoround-gen-qat-qat") == "awq-autoround-gen-qat"
    assert qq.root_method("awq-autoround-gen-e2e-qat") == "awq-autoround-gen"
    assert qq.e2e_rounds("awq-autoround-gen-qat-e2e") == 2 and qq.e2e_rounds("awq") == 0
    assert qq.cli_method("awq-autoround-gen-qat-qat") == ("awq-autoround", qq.CALIB_GENERATED)


def test_cli_from_tunes_a_checkpoint_again(model_factory, tmp_path, capsys) -> None:
    """`tandem quantize MODEL --from DIR --e2e-steps N` tunes DIR's checkpoint again (the codes
    too with --e2e-codes): quantization.json gains a round with the first kept as "previous",
    the result is served; --from without --e2e-steps, with --recipe, from a directory with no
    checkpoint or from another model's checkpoint is refused by name."""
    import tandem
    from tandem.cli import main

    _, path = model_factory("llama")
    _, other = model_factory("qwen2")
    calib = _calib_file(tmp_path, 400, 8)
    first, second = tmp_path / "q1", tmp_path / "q2"
    common = ["--calib", calib, "--calib-seq-len", "64", "--e2e-val-seqs", "2"]
    rc = main(["quantize", path, "--method", "rtn", "--out", str(first), "--e2e-steps", "3",
               "--e2e-codes", *common])  # fmt: skip
    assert rc == 0
    again = ["quantize", path, "--from", str(first), "--out", str(second), *common]
    assert main(again) == 2
    assert "give --e2e-steps" in capsys.readouterr().err
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"default": {"bits": 4, "group_size": 64, "zero_point": True}}))
    assert main([*again, "--e2e-steps", "3", "--recipe", str(recipe)]) == 2
    assert "drop --recipe" in capsys.readouterr().err
    assert main([*again[:3], str(tmp_path), *again[4:], "--e2e-steps", "3"]) == 2
    assert "no quantization.json there" in capsys.readouterr().err
    assert main(["quantize", other, *again[2:], "--e2e-steps", "3"]) == 2
    assert "its model config differs" in capsys.readouterr().err
    assert main([*again, "--e2e-steps", "3", "--e2e-codes"]) == 0
    m1 = json.loads((first / "quantization.json").read_text())
    m2 = json.loads((second / "quantization.json").read_text())
    assert m1["method"] == "rtn+e2e" and m2["method"] == "rtn+e2e+e2e"
    assert m2["e2e"]["previous"] == m1["e2e"] and m2["recipe"] == m1["recipe"]
    assert m2["e2e"]["trained"] == "codes, scales and zero points"
    llm = tandem.LLM(str(second), num_blocks=16)
    done = llm.generate([[5, 6, 7, 8]], tandem.SamplingParams(max_tokens=4, temperature=0))
    assert len(done[0].token_ids) >= 1
