"""`tandem quantize MODEL`: profile weights, or write an INT4/INT8 checkpoint.

    tandem quantize MODEL --profile                       per-layer statistics + a suggested recipe
    tandem quantize MODEL --recipe R --calib FILE --out DIR [--method M]

Methods (`--method`): `rtn` rounds to nearest; `awq` searches activation-aware scales
(`tandem.quant.awq`) and per-group clipping, then rounds; `gptq` quantizes with second-order
error compensation (`tandem.quant.gptq`); `awq-gptq` runs GPTQ on the AWQ-scaled weights;
`autoround` tunes each decoder layer's rounding offsets and group ranges so the quantized layer's
output matches the float model's (`tandem.quant.autoround`); `awq-autoround` does it on the
AWQ-scaled weights.

`--e2e-steps N` then tunes the FP16 group scales and zero points of any of these (codes fixed) so
the quantized model's next-token distribution matches the float model's (`tandem.quant.e2e`,
knowledge distillation) on the calibration text and `--e2e-generated` sequences sampled from the
float model itself; the last `--e2e-val-seqs` of those sequences (sampled ones when there are
enough, else the calibration file's last) are held out for early stopping. `--e2e-codes` trains
the integer codes too (quantization-aware training, straight-through rounding).

`--device cuda` runs the calibration (and the sampling of sequences) on a GPU: the same maths,
minutes instead of an hour for the block-wise and end-to-end methods.

The calibration text defaults to `tandem/quant/data/calibration.txt`, which is this project's own
documentation (README, design contract, conventions); evaluate on different text.
`--calib-generated N` adds N sequences sampled from the float model itself (data-free text of
every kind the model writes), so a method does not fit one kind of text only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
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


def add_quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", nargs="?", default=None, help="model path (default: the embedded SmolLM2 GGUF)"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="print per-layer weight statistics (to stderr) and a suggested recipe (YAML, to "
        "--out FILE when given, else to stdout), which --recipe reads back",
    )
    p.add_argument("--recipe", default=None, help="recipe file, JSON or YAML (default: INT4 g128)")
    p.add_argument(
        "--calib",
        default=None,
        help="calibration text file (default: the project's own docs, shipped with Tandem)",
    )
    p.add_argument(
        "--method",
        choices=METHODS,
        default="awq",
        help="rtn: round to nearest; awq: activation-aware scales + clipping from the calibration "
        "text; gptq: second-order error compensation on the calibration text; awq-gptq: both; "
        "autoround: learned rounding and group ranges per decoder layer (block output "
        "reconstruction); awq-autoround: autoround on AWQ-scaled weights",
    )
    p.add_argument(
        "--out",
        default=None,
        help="output directory of the quantized checkpoint (with --profile: the recipe file)",
    )
    p.add_argument(
        "--from",
        dest="start_from",
        default=None,
        metavar="DIR",
        help="start from this quantized checkpoint (written by tandem quantize from MODEL) "
        "instead of quantizing: tune it end to end again (--e2e-steps, with --e2e-codes for "
        "QAT) with a fresh schedule; its recipe and method stay, the earlier round is kept in "
        "quantization.json",
    )
    p.add_argument("--calib-seq-len", type=int, default=256, help="tokens per calibration sequence")
    p.add_argument(
        "--calib-max-tokens", type=int, default=8192, help="calibration tokens used at most"
    )
    p.add_argument(
        "--calib-generated",
        type=int,
        default=0,
        help="also calibrate on this many sequences of --calib-seq-len tokens sampled from the "
        "float model itself (data-free text, as in LLM-QAT), after the calibration file's",
    )
    p.add_argument("--awq-grid", type=int, default=20, help="alpha grid points in [0, 1]")
    p.add_argument(
        "--no-clip",
        action="store_true",
        help="AWQ/GPTQ without the per-group clipping search",
    )
    p.add_argument(
        "--gptq-damp",
        type=float,
        default=0.01,
        help="GPTQ: dampening added to the Hessian diagonal, as a fraction of its mean",
    )
    p.add_argument(
        "--autoround-iters",
        type=int,
        default=AUTOROUND_ITERS,
        help="autoround: signed-gradient steps per decoder layer",
    )
    p.add_argument(
        "--autoround-lr",
        type=float,
        default=None,
        help="autoround: first step size (decays linearly to 0; default 1 / iterations)",
    )
    p.add_argument(
        "--autoround-batch",
        type=int,
        default=AUTOROUND_BATCH,
        help="autoround: calibration sequences per step",
    )
    p.add_argument(
        "--e2e-steps",
        type=int,
        default=0,
        help="after the method: Adam steps tuning the group scales and zero points (codes fixed) "
        "to the float model's next-token distribution on the calibration text (0: off)",
    )
    p.add_argument("--e2e-lr", type=float, default=E2E_LR, help="e2e: Adam learning rate")
    p.add_argument(
        "--e2e-batch", type=int, default=E2E_BATCH, help="e2e: calibration sequences per step"
    )
    p.add_argument(
        "--e2e-val-seqs",
        type=int,
        default=E2E_VAL_SEQS,
        help="e2e: sequences held out for early stopping (not trained on): the last sampled ones, "
        "or the calibration file's last without --e2e-generated",
    )
    p.add_argument(
        "--e2e-eval-every",
        type=int,
        default=E2E_EVAL_EVERY,
        help="e2e: steps between held-out evaluations (the best one is kept)",
    )
    p.add_argument(
        "--e2e-generated",
        type=int,
        default=E2E_GENERATED,
        help="e2e: also train on this many sequences sampled from the float model itself",
    )
    p.add_argument(
        "--e2e-codes",
        action="store_true",
        help="e2e: train the integer codes too (straight-through rounding), not only the group "
        "scales and zero points",
    )
    p.add_argument(
        "--e2e-codes-lr",
        type=float,
        default=E2E_CODES_LR,
        help="e2e --e2e-codes: Adam learning rate of the codes' latents, in code units",
    )
    p.add_argument(
        "--e2e-cosine",
        action="store_true",
        help="e2e: learning rates decay to 0 along a half cosine over --e2e-steps, or over "
        "--e2e-max-seconds where that ends first (default: constant)",
    )
    p.add_argument(
        "--e2e-max-seconds",
        type=float,
        default=None,
        help="e2e: stop tuning after this many seconds (the best state so far is kept)",
    )
    p.add_argument(
        "--e2e-tf32",
        action="store_true",
        help="e2e on a CUDA device: float32 matrix products in TF32 on the tensor cores (faster "
        "steps; the default keeps full float32)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where calibration runs: cpu (default) or cuda[:N]",
    )
    p.add_argument(
        "--float-dtype",
        choices=["float16", "bfloat16", "float32"],
        default="float16",
        help="dtype of the tensors left in floating point (embeddings, norms, 16-bit layers)",
    )
    p.add_argument(
        "--group-size", type=int, default=128, help="group size probed by --profile (default 128)"
    )


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
    from tandem.quant.e2e import check_options
    from tandem.quant.recipe import head_specs
    from tandem.quant.weights import quantize_weights

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

    from tandem.quant.e2e import check_options, e2e_tune, sample_sequences, tf32_matmuls
    from tandem.quant.weights import dequantize_weights

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

    from tandem.quant.recipe import resolve_specs
    from tandem.quant.weights import dequantize_weights, quantize_weights

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


def _tune_again(args: argparse.Namespace, loaded):
    """`--from DIR`: DIR's quantized weights tuned end to end again against `loaded` (the float
    model it was made from); returns (weights, info) as `quantize_model` does."""
    import dataclasses

    import torch

    from tandem.model.loader import load_model
    from tandem.quant.checkpoint import info_of, read_quantization

    if not args.e2e_steps:
        raise ValueError("--from tunes a checkpoint again: give --e2e-steps N (> 0)")
    if args.recipe:
        raise ValueError("--from keeps the checkpoint's own recipe: drop --recipe")
    meta = read_quantization(args.start_from)
    if meta is None:
        raise ValueError(f"--from {args.start_from}: no quantization.json there")
    base = load_model(args.start_from, torch.float32)
    if dataclasses.replace(base.config, name=loaded.config.name) != loaded.config:
        model = args.model or "the default model"
        raise ValueError(f"--from {args.start_from}: its model config differs from {model}'s")
    if args.device != "cpu":
        on_device(base, args.device)
    return tune_end_to_end(
        loaded,
        base.weights,
        info_of(meta),
        args.e2e_steps,
        lr=args.e2e_lr,
        batch=args.e2e_batch,
        val_seqs=args.e2e_val_seqs,
        eval_every=args.e2e_eval_every,
        generated=args.e2e_generated,
        calib_path=args.calib,
        seq_len=args.calib_seq_len,
        max_tokens=args.calib_max_tokens,
        codes=args.e2e_codes,
        codes_lr=args.e2e_codes_lr,
        cosine=args.e2e_cosine,
        max_seconds=args.e2e_max_seconds,
        tf32=args.e2e_tf32,
    )


def run_quantize(args: argparse.Namespace) -> int:
    import torch

    from tandem.model.loader import load_model
    from tandem.quant.checkpoint import save_quantized
    from tandem.quant.format import QuantizedWeight
    from tandem.quant.profile import format_table, profile_weights, suggest_recipe
    from tandem.quant.recipe import Recipe, RecipeError

    if not args.profile and not args.out:
        print("tandem quantize: give --out DIR (or --profile)", file=sys.stderr)
        return 2
    try:
        recipe = Recipe.load(args.recipe) if args.recipe else Recipe()
        loaded = load_model(args.model, torch.float32)
        if args.device != "cpu":
            on_device(loaded, args.device)
        if args.profile:
            import yaml

            stats = profile_weights(loaded.weights, loaded.config.num_layers, args.group_size)
            print(format_table(stats), file=sys.stderr)
            suggestion = suggest_recipe(stats, args.group_size)
            text = (
                f"# suggested recipe ({len(suggestion.overrides)} layers kept at 8 bits)\n"
                + yaml.safe_dump(suggestion.to_dict(), sort_keys=False)
            )
            if args.out:
                with open(args.out, "w") as f:
                    f.write(text)
                print(f"recipe written to {args.out} (use it with --recipe)", file=sys.stderr)
            else:
                sys.stdout.write(text)
            return 0
        if args.start_from:
            weights, info = _tune_again(args, loaded)
        else:
            weights, info = quantize_model(
                loaded,
                recipe,
                args.method,
                args.calib,
                args.calib_seq_len,
                args.calib_max_tokens,
                args.awq_grid,
                clip=not args.no_clip,
                damp=args.gptq_damp,
                autoround_iters=args.autoround_iters,
                autoround_lr=args.autoround_lr,
                autoround_batch=args.autoround_batch,
                generated=args.calib_generated,
                e2e_steps=args.e2e_steps,
                e2e_lr=args.e2e_lr,
                e2e_batch=args.e2e_batch,
                e2e_val_seqs=args.e2e_val_seqs,
                e2e_eval_every=args.e2e_eval_every,
                e2e_generated=args.e2e_generated,
                e2e_codes=args.e2e_codes,
                e2e_codes_lr=args.e2e_codes_lr,
                e2e_cosine=args.e2e_cosine,
                e2e_max_seconds=args.e2e_max_seconds,
                e2e_tf32=args.e2e_tf32,
            )
        weights = {k: v.to("cpu") for k, v in weights.items()}
        save_quantized(
            args.out,
            loaded.config,
            weights,
            loaded.tokenizer,
            info,
            getattr(torch, args.float_dtype),
        )
    except (RecipeError, ValueError, FileNotFoundError) as e:
        print(f"tandem quantize: {e}", file=sys.stderr)
        return 2
    q = [w for w in weights.values() if isinstance(w, QuantizedWeight)]
    q_bytes = sum(w.nbytes for w in q)
    f_bytes = sum(w.out_features * w.in_features * 2 for w in q)  # the same layers in 16 bits
    print(
        f"wrote {args.out}: {len(q)} quantized layers, {q_bytes / 2**20:.1f} MiB "
        f"({q_bytes / f_bytes:.3f}x their 16-bit size); quantization.json:"
    )
    print(json.dumps({k: v for k, v in info.items() if k != "calibration"}, indent=None))
    return 0
