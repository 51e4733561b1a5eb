"""The quantization pipeline: calibration text, a method per layer, end-to-end tuning.

`quantize_model` turns a float model's weights into INT4/INT8 ones by a recipe and a method
(rtn, awq, gptq, awq-gptq, autoround, awq-autoround); `tune_end_to_end` then tunes the group
scales (and, optionally, the codes) against the float model. `tandem quantize`
(tandem/quant/cli.py) and the draft models (tandem/engine/draft_models.py) both call it.
"""

from __future__ import annotations

import hashlib
import os
import time
from importlib import resources

CALIBRATION_FILE = "calibration.txt"
AUTOROUND_ITERS, AUTOROUND_BATCH = 100, 4
E2E_LR, E2E_BATCH, E2E_VAL_SEQS, E2E_EVAL_EVERY, E2E_GENERATED = 3e-4, 2, 4, 10, 0
E2E_CODES_LR = 1e-3
# Sequences sampled for --calib-generated use another seed than e2e's (0), so e2e's held-out
# sampled sequences are not ones the base method was calibrated on.
CALIB_GENERATED_SEED = 1
METHODS = ("rtn", "awq", "gptq", "awq-gptq", "autoround", "awq-autoround")


def default_calibration_path() -> str:
    return str(resources.files("tandem.quant").joinpath("data", CALIBRATION_FILE))


def calibration_batch(tokenizer, path: str, seq_len: int, max_tokens: int):
    """Token ids [S, seq_len] from a text file (whole sequences only)."""
    import torch

    if not os.path.isfile(path):
        raise ValueError(f"calibration file {path!r} does not exist")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    n = len(ids) // seq_len
    if n < 1:
        raise ValueError(
            f"calibration file {path!r} holds {len(ids)} tokens, fewer than one sequence of "
            f"{seq_len} (lower --calib-seq-len or give more text)"
        )
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len), text


def quantize_model(
    loaded,
    recipe,
    method: str = "awq",
    *args,
    e2e_steps: int = 0,
    e2e_lr: float = E2E_LR,
    e2e_batch: int = E2E_BATCH,
    e2e_val_seqs: int = E2E_VAL_SEQS,
    e2e_eval_every: int = E2E_EVAL_EVERY,
    e2e_generated: int = E2E_GENERATED,
    e2e_codes: bool = False,
    e2e_codes_lr: float = E2E_CODES_LR,
    e2e_cosine: bool = False,
    e2e_max_seconds: float | None = None,
    e2e_tf32: bool = False,
    **options,
):
    """Quantized weights of `loaded` per `recipe`; returns (weights, info for quantization.json).

    The decoder's linear layers by `method` (`_quantize_decoder`), then the token embedding and
    LM head where the recipe names them (`recipe.head_specs`), round-to-nearest; then, with
    `e2e_steps` > 0, the decoder's scales and zero points tuned end to end (`tune_end_to_end`).
    """
    from tandem.formats.weight import quantize_weights
    from tandem.quant.e2e import check_options
    from tandem.quant.recipe import head_specs

    if e2e_steps:
        check_options(e2e_steps, e2e_lr, e2e_batch, e2e_val_seqs, e2e_eval_every, e2e_generated)
    weights, info = _quantize_decoder(loaded, recipe, method, *args, **options)
    head = head_specs(recipe, loaded.config.tie_word_embeddings)
    if head:
        weights = quantize_weights(weights, head)
        info["head_layers"] = {n: "rtn" for n in sorted(head)}
    if e2e_steps:
        calib = dict(zip(("calib_path", "seq_len", "max_tokens"), args, strict=False))
        for k in ("calib_path", "seq_len", "max_tokens", "log"):
            if k in options:
                calib[k] = options[k]
        weights, info = tune_end_to_end(
            loaded,
            weights,
            info,
            steps=e2e_steps,
            lr=e2e_lr,
            batch=e2e_batch,
            val_seqs=e2e_val_seqs,
            eval_every=e2e_eval_every,
            generated=e2e_generated,
            codes=e2e_codes,
            codes_lr=e2e_codes_lr,
            cosine=e2e_cosine,
            max_seconds=e2e_max_seconds,
            tf32=e2e_tf32,
            **calib,
        )
    return weights, info


def tune_end_to_end(
    loaded,
    weights,
    info: dict,
    steps: int,
    lr: float = E2E_LR,
    batch: int = E2E_BATCH,
    val_seqs: int = E2E_VAL_SEQS,
    eval_every: int = E2E_EVAL_EVERY,
    generated: int = E2E_GENERATED,
    calib_path: str | None = None,
    seq_len: int = 256,
    max_tokens: int = 8192,
    log=print,
    codes: bool = False,
    codes_lr: float = E2E_CODES_LR,
    cosine: bool = False,
    max_seconds: float | None = None,
    tf32: bool = False,
):
    """`weights` (quantized from `loaded`, e.g. by `quantize_model` or read back from a
    checkpoint) with their decoder scales and zero points tuned by `tandem.quant.e2e.e2e_tune`
    on the calibration text; returns (weights, `info` with an "e2e" entry)."""
    import torch

    from tandem.formats.weight import dequantize_weights
    from tandem.quant.e2e import check_options, e2e_tune, sample_sequences, tf32_matmuls

    check_options(steps, lr, batch, val_seqs, eval_every, generated)
    calib_path = calib_path or default_calibration_path()
    calib, text = calibration_batch(loaded.tokenizer, calib_path, seq_len, max_tokens)
    log(f"e2e: {calib.shape[0]} x {calib.shape[1]} calibration tokens from {calib_path}")
    t0 = time.monotonic()
    float_w = dequantize_weights(loaded.weights, torch.float32)
    device = float_w["model.embed_tokens.weight"].device
    if generated:
        # Sampled sequences last: the held-out ones are sampled (when there are enough of them).
        sampled = sample_sequences(
            float_w,
            loaded.config,
            generated,
            seq_len,
            device=device,
            batch=16 if device.type == "cpu" else 512,  # more sequences per forward on a GPU
        )
        log(f"e2e: {generated} x {seq_len} tokens sampled from the float model")
        calib_ids = torch.cat([calib, sampled.to(calib.dtype)])
    else:
        calib_ids = calib
    with tf32_matmuls(tf32):
        out, report = e2e_tune(
            float_w,
            weights,
            loaded.config,
            calib_ids,
            steps=steps,
            lr=lr,
            batch=batch,
            val_seqs=val_seqs,
            eval_every=eval_every,
            log=log,
            codes=codes,
            codes_lr=codes_lr,
            cosine=cosine,
            time_limit_s=max_seconds,
        )
    log(f"e2e done in {time.monotonic() - t0:.1f}s (best step {report.best_step})")
    info = dict(info)
    info["method"] = info.get("method", "?") + "+e2e"
    info["e2e"] = {
        "trained": "codes, scales and zero points" if codes else "scales and zero points",
        **({"codes_lr": codes_lr} if codes else {}),
        "calibration_file": os.path.basename(calib_path),
        "calibration_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "seq_len": seq_len,
        "calibration_seqs": int(calib.shape[0]),
        "generated_seqs": generated,
        "train_seqs": report.train_seqs,
        "held_out_seqs": report.val_seqs,
        "held_out": "sampled sequences" if generated >= val_seqs else "calibration file's last",
        "steps": steps,
        **({"stopped_at_step": report.stopped_at} if report.stopped_at else {}),
        **({"final_lr_factor": round(report.lr_factor, 6)} if cosine else {}),
        "lr": lr,
        "schedule": "cosine" if cosine else "constant",
        **({"matmul": "tf32"} if tf32 else {}),
        "batch": batch,
        "eval_every": eval_every,
        "best_step": report.best_step,
        "held_out_kl": {"start": report.start_kl, "best": report.best_kl},
        "history": report.history,
        "seconds": report.seconds,
        # Tuned again from a tuned checkpoint: the earlier round's record.
        **({"previous": info["e2e"]} if "e2e" in info else {}),
    }
    return out, info


def _quantize_decoder(
    loaded,
    recipe,
    method: str = "awq",
    calib_path: str | None = None,
    seq_len: int = 256,
    max_tokens: int = 8192,
    grid: int = 20,
    log=print,
    clip: bool = True,
    damp: float = 0.01,
    autoround_iters: int = AUTOROUND_ITERS,
    autoround_lr: float | None = None,
    autoround_batch: int = AUTOROUND_BATCH,
    generated: int = 0,
):
    """Quantized weights of `loaded` per `recipe`; returns (weights, info for quantization.json).

    `method`: one of METHODS (see the module docstring); `clip`: search per-group clipping
    ratios (AWQ, GPTQ); `damp`: GPTQ's Hessian dampening; `autoround_*`: the autoround
    methods' steps per layer, first step size (None: 1 / steps) and sequences per step;
    `generated`: sequences sampled from the float model added to the calibration text.
    """
    import torch

    from tandem.formats.weight import dequantize_weights, quantize_weights
    from tandem.quant.recipe import resolve_specs

    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if not isinstance(generated, int) or generated < 0:
        raise ValueError(f"calib-generated must be an integer >= 0, got {generated!r}")
    if method.endswith("autoround"):
        from tandem.quant.autoround import check_options

        check_options(autoround_iters, autoround_lr, autoround_batch)
    cfg = loaded.config
    specs = resolve_specs(recipe, cfg.num_layers)
    weights = dequantize_weights(loaded.weights, torch.float32)
    info: dict = {"method": method, "recipe": recipe.to_dict(), "source": str(loaded.path)}
    if method == "rtn":
        return quantize_weights(weights, specs), info
    calib_path = calib_path or default_calibration_path()
    calib, text = calibration_batch(loaded.tokenizer, calib_path, seq_len, max_tokens)
    log(f"{method}: {calib.shape[0]} x {calib.shape[1]} calibration tokens from {calib_path}")
    info["calibration"] = {
        "file": os.path.basename(calib_path),
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "tokens": int(calib.numel()),
        "seq_len": seq_len,
        "clip_search": clip,
    }
    if generated:
        from tandem.quant.e2e import sample_sequences

        t0 = time.monotonic()
        sampled = sample_sequences(
            weights,
            cfg,
            generated,
            seq_len,
            seed=CALIB_GENERATED_SEED,
            device=weights["model.embed_tokens.weight"].device,
        )
        calib = torch.cat([calib, sampled.to(calib.dtype)])
        log(
            f"{method}: + {generated} x {seq_len} tokens sampled from the float model "
            f"({time.monotonic() - t0:.1f}s)"
        )
        info["calibration"].update(
            {
                "tokens": int(calib.numel()),
                "generated_seqs": generated,
                "generated": "sampled from the float model: a uniformly random first token, then "
                f"temperature 1 (seed {CALIB_GENERATED_SEED})",
            }
        )
    clips = None
    if method in ("awq", "awq-gptq", "awq-autoround"):
        from tandem.quant.awq import awq_scale

        t0 = time.monotonic()
        # Before GPTQ (autoround) the clipping is GPTQ's own search (autoround's learned ranges).
        weights, report = awq_scale(
            weights, cfg, specs, calib, grid=grid, log=log, clip=clip and method == "awq"
        )
        clips = report.clips
        log(f"AWQ scales searched in {time.monotonic() - t0:.1f}s")
        info["calibration"].update({"grid": grid, "alphas": report.alphas})
    if method in ("gptq", "awq-gptq"):
        from tandem.quant.gptq import CLIP_RATIOS, gptq_quantize

        t0 = time.monotonic()
        out, report = gptq_quantize(
            weights,
            cfg,
            specs,
            calib,
            damp=damp,
            clip_ratios=CLIP_RATIOS if clip else (1.0,),
            log=log,
        )
        log(f"GPTQ done in {time.monotonic() - t0:.1f}s")
        info["calibration"].update(
            {
                "gptq_damp": damp,
                "gptq_act_order": "per group",
                "gptq_relative_output_error": {
                    m: {"rtn": e[0], "gptq": e[1]} for m, e in report.errors.items()
                },
            }
        )
        return out, info
    if method in ("autoround", "awq-autoround"):
        from tandem.quant.autoround import autoround_quantize

        t0 = time.monotonic()
        out, report = autoround_quantize(
            weights,
            cfg,
            specs,
            calib,
            iters=autoround_iters,
            lr=autoround_lr,
            batch=autoround_batch,
            log=log,
        )
        log(f"autoround done in {time.monotonic() - t0:.1f}s")
        info["calibration"].update(
            {
                "autoround_iters": autoround_iters,
                "autoround_lr": autoround_lr or 1.0 / max(autoround_iters, 1),
                "autoround_batch": autoround_batch,
                "autoround_layer_output_mse": {
                    m: {"start": e[0], "tuned": e[1]} for m, e in report.errors.items()
                },
            }
        )
        return out, info
    return quantize_weights(weights, specs, clips), info


def on_device(loaded, device: str) -> None:
    """Move `loaded`'s weights to `device` (calibration then runs there)."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"--device {device!r} is not a device: {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine has no CUDA GPU (use --device cpu)")
    loaded.weights = {k: v.to(dev) for k, v in loaded.weights.items()}
