"""Quantization quality on SmolLM2-135M-Instruct: perplexity on held-out real text, CPU.

Rows (all through Tandem's LlamaModel and paged KV cache):
  reference        the default GGUF's weights dequantized to float32. The GGUF stores its linear
                   layers as Q4_1 (INT4, group 32) and no higher-precision SmolLM2 is on disk, so
                   this "unquantized" reference is itself the dequantized Q4_1 model.
  q4_1_native      the same Q4_1 tensors loaded directly as INT4 g32 (no re-quantization):
                   must equal the reference.
  int4_g128_rtn    INT4 group 128 with zero point, round-to-nearest (no calibration).
  int4_g128_awq, int4_g128_gptq, int4_g128_awq_gptq, int4_g128_autoround,
  int4_g128_awq_autoround
                   the same after calibration on the shipped calibration text (this project's own
                   docs, tandem/quant/data/calibration.txt): AWQ-style scales + clipping, GPTQ
                   (act order within groups, clipping), GPTQ on AWQ-scaled weights, learned
                   rounding + group ranges per decoder layer (block output reconstruction), the
                   same on AWQ-scaled weights. Every linear layer is 4-bit g128.
  mixed_*          the calibrated method with the profiler's suggested recipe (`tandem quantize
                   --profile`: layers whose weight statistics stand out kept at 8 bits); its
                   memory is in quantized_bytes / bytes_vs_int4. Not a pure INT4 result.
  kv_fp8, kv_int8  reference weights, KV cache in FP8 e4m3 / INT8 with per-block scales.
  <calibrated>_kv_fp8  both.
The quantized checkpoints are written with `tandem quantize`'s code path and loaded back from disk.

Held-out text: the Python language reference shipped with the interpreter (pydoc_data.topics,
topics in sorted order), a text different from the calibration file. Perplexity runs over
non-overlapping windows (--window tokens, one prefill each). A second, shorter "decode" pass feeds
the last --decode-tokens of each window one token at a time, so the FP8/INT8 cache is written as
in serving (per-block scales growing token by token).

Which calibrated method the 1.05x check applies to is chosen without the eval text:
`--select` quantizes with each method on the calibration text less its last --select-seqs
sequences and measures perplexity on those (the calibration file's own held-out tail); the
result goes into the JSON's "method_selection" (kept by later runs) and the check follows it.

Each method takes minutes to hours of CPU, so both modes can re-run only some methods:
`--select --methods a,b` measures those and keeps the other methods' held-out perplexities from
the previous selection (listed under "carried", with the revision that measured them);
`--carry awq,gptq` keeps those methods' rows (and quantize seconds) from the previous results file
instead of re-quantizing (marked "carried_from" in the row). The reference is always re-measured.

    .venv/bin/python bench/quant_quality.py --select   # method selection only (~10 min)
    .venv/bin/python bench/quant_quality.py            # writes bench/results/quant_quality.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tandem.model.gguf_loader import default_model_path  # noqa: E402
from tandem.model.llama import LlamaModel  # noqa: E402
from tandem.model.loader import load_model  # noqa: E402
from tandem.quant.checkpoint import save_quantized  # noqa: E402
from tandem.quant.cli import (  # noqa: E402
    calibration_batch,
    default_calibration_path,
    quantize_model,
)
from tandem.quant.eval import perplexity  # noqa: E402
from tandem.quant.format import QuantizedWeight  # noqa: E402
from tandem.quant.profile import profile_weights, suggest_recipe  # noqa: E402
from tandem.quant.recipe import LayerSpec, Recipe  # noqa: E402
from tandem.quant.weights import dequantize_weights, load_gguf_q4_1  # noqa: E402

CALIBRATED = ("awq", "gptq", "awq-gptq", "autoround", "awq-autoround")
INT4_TARGET, KV_FP8_TARGET = 1.05, 1.01


def row_name(method: str) -> str:
    return "int4_g128_" + method.replace("-", "_")


def select_method(
    loaded,
    recipe: Recipe,
    seqs: int,
    seq_len: int = 256,
    methods: tuple[str, ...] = ("rtn",) + CALIBRATED,
    previous: dict | None = None,
) -> dict:
    """Perplexity on the calibration file's last `seqs` sequences of each calibrated method,
    calibrated on the sequences before them; the lowest wins. The eval text is not read.
    Methods not in `methods` keep their perplexity from the `previous` selection."""
    cfg, tok = loaded.config, loaded.tokenizer
    calib, _ = calibration_batch(tok, default_calibration_path(), seq_len, 8192)
    n = calib.shape[0] - seqs
    held = calib[n:].reshape(-1).tolist()
    out: dict = {
        "held_out": f"the last {seqs} of the calibration file's {calib.shape[0]} sequences of "
        f"{seq_len} tokens ({len(held)} tokens); methods calibrated on the first {n}",
        "ppl": {},
        "seconds": {},
    }
    m = LlamaModel(
        cfg, dequantize_weights(loaded.weights, torch.float32), torch.float32, "cpu", seq_len
    )
    out["reference_ppl"] = perplexity(m, held, seq_len)["ppl"]
    print(f"select: reference  held-out calibration ppl {out['reference_ppl']:.4f}", flush=True)
    carried = {}
    for method in ("rtn",) + CALIBRATED:
        if method not in methods:
            if previous is None or method not in previous.get("ppl", {}):
                raise SystemExit(
                    f"no previous held-out perplexity of {method}: add it to --methods"
                )
            out["ppl"][method] = previous["ppl"][method]
            if method in previous.get("seconds", {}):
                out["seconds"][method] = previous["seconds"][method]
            carried[method] = previous.get("carried", {}).get(method, previous.get("git"))
            print(f"select: {method:10s} carried: {out['ppl'][method]:.4f}", flush=True)
            continue
        t0 = time.monotonic()
        w, _ = quantize_model(loaded, recipe, method, max_tokens=n * seq_len, log=lambda s: None)
        out["seconds"][method] = round(time.monotonic() - t0, 1)
        m = LlamaModel(cfg, dequantize_weights(w, torch.float32), torch.float32, "cpu", seq_len)
        out["ppl"][method] = perplexity(m, held, seq_len)["ppl"]
        print(
            f"select: {method:10s} held-out calibration ppl {out['ppl'][method]:.4f} "
            f"(quantized in {out['seconds'][method]}s)",
            flush=True,
        )
    if carried:
        out["carried"] = carried  # method -> git revision that measured it
    out["chosen"] = min(CALIBRATED, key=lambda m: out["ppl"][m])
    return out


def eval_text() -> tuple[str, str]:
    import pydoc_data.topics as topics

    keys = sorted(topics.topics)
    text = "\n\n".join(topics.topics[k] for k in keys)
    src = f"pydoc_data.topics of Python {platform.python_version()} ({len(keys)} topics, sorted)"
    return text, src


def git_rev() -> str:
    try:
        return (
            subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT)
            .decode()
            .strip()
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=16, help="prefill windows evaluated")
    ap.add_argument("--decode-windows", type=int, default=8)
    ap.add_argument("--decode-window", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--select", action="store_true", help="only choose the calibrated method")
    ap.add_argument("--select-seqs", type=int, default=4)
    ap.add_argument(
        "--methods",
        default=None,
        help="--select: comma-separated methods to measure (default all); the others are "
        "carried from the previous selection",
    )
    ap.add_argument(
        "--carry",
        default="",
        help="comma-separated calibrated methods whose rows are carried from the previous "
        "results instead of re-run",
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "quant_quality.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.monotonic()
    path = default_model_path()
    loaded = load_model(path, torch.float32)
    cfg, tok = loaded.config, loaded.tokenizer
    recipe = Recipe(LayerSpec(bits=4, group_size=128, zero_point=True))
    previous = {}
    if os.path.isfile(args.out):
        with open(args.out) as f:
            previous = json.load(f)
    if args.select:
        methods = tuple(args.methods.split(",")) if args.methods else ("rtn",) + CALIBRATED
        for m in methods:
            if m not in ("rtn",) + CALIBRATED:
                raise SystemExit(f"unknown method {m!r} in --methods")
        sel = select_method(
            loaded,
            recipe,
            args.select_seqs,
            methods=methods,
            previous=previous.get("method_selection"),
        )
        sel["command"] = "python " + " ".join(shlex.quote(a) for a in sys.argv)
        sel["date"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        sel["git"] = git_rev()
        previous["method_selection"] = sel
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(previous, f, indent=2)
        print(f"chosen: {sel['chosen']}; wrote method_selection into {args.out}")
        return 0
    selection = previous.get("method_selection")
    if selection is None:
        raise SystemExit("no method_selection in the results file: run with --select first")
    chosen = selection["chosen"]
    carry = tuple(m for m in args.carry.split(",") if m)
    for m in carry:
        if m not in CALIBRATED or m == chosen:
            raise SystemExit(
                f"--carry takes calibrated methods other than the chosen one, got {m!r}"
            )
    prev_rows = {r["name"]: r for r in previous.get("rows", [])}
    for m in carry:
        if row_name(m) not in prev_rows:
            raise SystemExit(f"no previous row {row_name(m)} to carry")
    text, text_src = eval_text()
    ids = tok.encode(text, add_special_tokens=False)
    n_pre = args.window * args.windows
    if len(ids) < n_pre:
        raise SystemExit(f"held-out text has {len(ids)} tokens, need {n_pre}")
    pre_ids = ids[:n_pre]
    # The decode pass reads text after the prefill pass's, so the two passes do not overlap.
    dec_ids = ids[n_pre : n_pre + args.decode_window * args.decode_windows]

    def model_of(weights) -> LlamaModel:
        return LlamaModel(cfg, weights, torch.float32, "cpu", max_positions=args.window)

    def evaluate(name: str, weights, kv_dtype=None, note: str = "") -> dict:
        t0 = time.monotonic()
        # On CPU the W4A16 path is the reference (dequantize, then matmul), so dequantizing once
        # up front computes exactly the same logits, without re-dequantizing at every step.
        m = model_of(dequantize_weights(weights, torch.float32))
        pre = perplexity(m, pre_ids, args.window, kv_dtype)
        dec = perplexity(m, dec_ids, args.decode_window, kv_dtype, decode_tokens=args.decode_tokens)
        q = [w for w in weights.values() if isinstance(w, QuantizedWeight)]
        row = {
            "name": name,
            "ppl": pre["ppl"],
            "nll": pre["nll"],
            "tokens": pre["tokens"],
            "decode_pass_ppl": dec["ppl"],
            "decode_pass_tokens": dec["tokens"],
            "kv_dtype": str(kv_dtype or torch.float32).removeprefix("torch."),
            "quantized_layers": len(q),
            "quantized_bytes": sum(w.nbytes for w in q),
            "seconds": round(time.monotonic() - t0, 1),
            "note": note,
        }
        print(
            f"{name:24s} ppl {row['ppl']:8.4f}   decode-pass ppl {row['decode_pass_ppl']:8.4f}"
            f"   ({row['seconds']}s)",
            flush=True,
        )
        return row

    rows = []
    ref_w = loaded.weights
    rows.append(evaluate("reference", ref_w, note="GGUF Q4_1 weights dequantized to float32"))
    native = dict(ref_w)
    native.update(load_gguf_q4_1(path, cfg))
    rows.append(evaluate("q4_1_native", native, note="Q4_1 loaded directly as INT4 g32"))
    del native

    tmp = tempfile.mkdtemp(prefix="tandem-quant-")
    quantized = {}
    infos = {}
    mixed = suggest_recipe(profile_weights(loaded.weights, cfg.num_layers, 128), 128)
    notes = {
        "rtn": "INT4 g128 RTN, no calibration",
        "awq": "INT4 g128 after AWQ-style scaling + clipping search on the calibration text",
        "gptq": "INT4 g128 GPTQ (act order within groups, clipping search) on the calibration text",
        "awq-gptq": "INT4 g128 GPTQ on AWQ-scaled weights, calibration text",
        "autoround": "INT4 g128 learned rounding + group ranges per decoder layer (block output "
        "reconstruction) on the calibration text",
        "awq-autoround": "INT4 g128 learned rounding + group ranges per decoder layer on "
        "AWQ-scaled weights, calibration text",
    }
    # The chosen method first, and each row evaluated as soon as it is quantized, so a run cut
    # short has the rows that matter most in its log.
    order = ["rtn", chosen] + [m for m in CALIBRATED if m != chosen]
    jobs = [(m, m, recipe) for m in order if m not in carry]
    jobs.append(("mixed", chosen, mixed))
    evaluated = {}
    for key, method, rec in jobs:
        t0 = time.monotonic()
        weights, info = quantize_model(loaded, rec, method, log=lambda s: print(s, flush=True))
        out = os.path.join(tmp, key)
        save_quantized(out, cfg, weights, tok, info)  # float16 non-quantized tensors, as the CLI
        back = load_model(out, torch.float32)
        quantized[key] = (back.weights, round(time.monotonic() - t0, 1))
        infos[key] = info
        print(f"quantized ({key}: {method}) in {quantized[key][1]}s -> {out}", flush=True)
        if key != "mixed":
            evaluated[key] = evaluate(row_name(key), back.weights, note=notes[key])
    quantize_seconds = {}
    for m in ("rtn",) + CALIBRATED:
        if m in carry:
            row = dict(prev_rows[row_name(m)])
            row.pop("ppl_ratio", None)
            row.pop("decode_pass_ppl_ratio", None)
            row.pop("bytes_vs_int4_g128", None)
            row.setdefault(
                "carried_from", {"git": previous.get("git"), "date": previous.get("date")}
            )
            rows.append(row)
            quantize_seconds[m] = previous.get("quantize_seconds", {}).get(m)
            print(f"{row['name']:24s} carried from {row['carried_from']}", flush=True)
            continue
        rows.append(evaluated[m])
        quantize_seconds[m] = quantized[m][1]
    n8 = sum(1 for spec in mixed.overrides if spec[1].bits == 8)
    mixed_name = "mixed_" + chosen.replace("-", "_") + "_profiler_recipe"
    rows.append(
        evaluate(
            mixed_name,
            quantized["mixed"][0],
            note=f"NOT pure INT4: {chosen} with the profiler's suggested recipe (INT4 g128, "
            f"{n8} layers INT8 g128, chosen from weight statistics alone)",
        )
    )
    rows[-1]["recipe"] = mixed.to_dict()
    rows.append(evaluate("kv_fp8", ref_w, torch.float8_e4m3fn, note="reference weights, FP8 KV"))
    rows.append(evaluate("kv_int8", ref_w, torch.int8, note="reference weights, INT8 KV"))
    rows.append(
        evaluate(
            row_name(chosen) + "_kv_fp8", quantized[chosen][0], torch.float8_e4m3fn, note="both"
        )
    )

    ref = rows[0]
    int4_bytes = next(r["quantized_bytes"] for r in rows if r["name"] == "int4_g128_rtn")
    for r in rows:
        r["ppl_ratio"] = r["ppl"] / ref["ppl"]
        r["decode_pass_ppl_ratio"] = r["decode_pass_ppl"] / ref["decode_pass_ppl"]
        if r["name"] != "q4_1_native" and r["quantized_bytes"]:
            r["bytes_vs_int4_g128"] = r["quantized_bytes"] / int4_bytes
    targets = {row_name(chosen): INT4_TARGET, "kv_fp8": KV_FP8_TARGET}
    checks = {
        name: {
            "target_ratio_max": t,
            "ppl_ratio": next(r["ppl_ratio"] for r in rows if r["name"] == name),
            "decode_pass_ppl_ratio": next(
                r["decode_pass_ppl_ratio"] for r in rows if r["name"] == name
            ),
        }
        for name, t in targets.items()
    }
    for c in checks.values():
        c["pass"] = c["ppl_ratio"] <= c["target_ratio_max"] and (
            c["decode_pass_ppl_ratio"] <= c["target_ratio_max"]
        )
    calib = default_calibration_path()
    checks[row_name(chosen)]["method_chosen_by"] = "method_selection (held-out calibration text)"
    result = {
        "benchmark": "quant_quality",
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "git": git_rev(),
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "model": os.path.basename(path),
        "reference_note": (
            "The default SmolLM2-135M-Instruct GGUF stores its linear layers as Q4_1 (INT4, "
            "group 32, scale + min) and the token embedding as Q8_0; no higher-precision SmolLM2 "
            "is on disk and nothing may be downloaded, so the 'unquantized' reference is the "
            "Q4_1 model dequantized to float32. INT4 g128 rows re-quantize that grid."
        ),
        "cpu_w4a16_note": (
            "On CPU a quantized layer runs the torch reference (dequantize to float32, then "
            "matmul); rows with quantized weights are evaluated with their weights dequantized "
            "once, which computes the same logits (tests/test_quant.py checks the engine's INT4 "
            "path gives the same tokens as a float engine holding the dequantized weights)."
        ),
        "eval_text": text_src,
        "eval_tokens": {"prefill_pass": len(pre_ids) - args.windows, "decode_pass": len(dec_ids)},
        "window": args.window,
        "decode_pass": {
            "window": args.decode_window,
            "windows": args.decode_windows,
            "decoded_tokens_per_window": args.decode_tokens,
        },
        "calibration_text": {
            "file": os.path.relpath(calib, ROOT),
            "source": "this project's README.md, DESIGN.md and CONVENTIONS.md",
            "tokens_used": quantized and 0,
        },
        "quantize_seconds": {**quantize_seconds, "mixed": quantized["mixed"][1]},
        "method_selection": selection,
        "rows": rows,
        "checks": checks,
        "seconds": round(time.monotonic() - t_start, 1),
    }
    # The calibration token count as the quantizer used it.
    with open(os.path.join(tmp, chosen, "quantization.json")) as f:
        result["calibration_text"]["tokens_used"] = json.load(f)["calibration"]["tokens"]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\n{'row':24s} {'ppl':>9s} {'ratio':>7s} {'dec ppl':>9s} {'ratio':>7s}")
    for r in rows:
        print(
            f"{r['name']:24s} {r['ppl']:9.4f} {r['ppl_ratio']:7.4f} "
            f"{r['decode_pass_ppl']:9.4f} {r['decode_pass_ppl_ratio']:7.4f}"
        )
    for name, c in checks.items():
        print(f"{name}: ratio {c['ppl_ratio']:.4f} (<= {c['target_ratio_max']}): {c['pass']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
