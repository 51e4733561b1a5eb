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
import json
import sys

from tandem.quant.pipeline import (
    AUTOROUND_BATCH,
    AUTOROUND_ITERS,
    E2E_BATCH,
    E2E_CODES_LR,
    E2E_EVAL_EVERY,
    E2E_GENERATED,
    E2E_LR,
    E2E_VAL_SEQS,
    METHODS,
    on_device,
    quantize_model,
    tune_end_to_end,
)


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


def _tune_again(args: argparse.Namespace, loaded):
    """`--from DIR`: DIR's quantized weights tuned end to end again against `loaded` (the float
    model it was made from); returns (weights, info) as `quantize_model` does."""
    import dataclasses

    import torch

    from tandem.model.loader import load_model
    from tandem.model.quantized_checkpoint import read_quantization
    from tandem.quant.checkpoint import info_of

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

    from tandem.formats.weight import QuantizedWeight
    from tandem.model.loader import load_model
    from tandem.quant.checkpoint import save_quantized
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
