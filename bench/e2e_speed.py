"""Steps per second of end-to-end tuning (QAT of the codes, `tandem.quant.e2e.e2e_tune`), eager
against one CUDA graph per step, side by side in one process, on a random model of SmolLM2-135M's
shape (the model `bench/quant_quality.py` tunes; no download, no checkpoint needed).

    python bench/e2e_speed.py [--steps 60] [--out bench/results/e2e_speed.json]

A row: `--steps` training steps at batch 8 x 256 tokens (RTN INT4 g128 start, codes trained,
TF32 matmuls as `bench/quant_quality_gpu.sh` runs them), the held-out evaluations the tuner does
every 100 steps included. The time is e2e_tune's own (report.seconds), so building the model is
not in it. Also the KL history of both, which should agree (the same arithmetic). --smoke: a
tiny model on the CPU (eager only), to check the script runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from llama_random import run_info  # noqa: E402

# SmolLM2-135M: hidden 576, 30 layers, 9 heads of 64, 3 KV heads, intermediate 1536, tied head.
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
SMOKE = dict(SMOLLM2_135M, vocab_size=256, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def build(shape: dict, device: str, seed: int = 0):
    """(float weights, RTN INT4 g128 weights, config) of a random Llama of `shape`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tandem.formats.weight import quantize_weights
    from tandem.model.config import ModelConfig
    from tandem.quant.recipe import Recipe, resolve_specs

    torch.manual_seed(seed)
    hf_cfg = LlamaConfig(**shape)
    model = LlamaForCausalLM(hf_cfg)
    cfg = ModelConfig.from_hf({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    w = {k: v.detach().float() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        w.pop("lm_head.weight", None)
    specs = resolve_specs(Recipe(), cfg.num_layers)  # the default: INT4 g128 with zero points
    q = quantize_weights(w, specs)
    return {k: v.to(device) for k, v in w.items()}, {k: v.to(device) for k, v in q.items()}, cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from tandem.quant.e2e import e2e_tune, tf32_matmuls

    device = "cpu" if args.smoke else "cuda"
    shape = SMOKE if args.smoke else SMOLLM2_135M
    float_w, q, cfg = build(shape, device)
    gen = torch.Generator().manual_seed(1)
    calib = torch.randint(0, cfg.vocab_size, (64 + 16, args.seq_len), generator=gen)
    modes = {"eager": False} if args.smoke else {"eager": False, "cuda_graph": True}
    rows = {}
    for name, graphed in modes.items():
        with tf32_matmuls(not args.smoke):
            _, rep = e2e_tune(
                float_w, q, cfg, calib, steps=args.steps, lr=3e-4, batch=args.batch,
                val_seqs=16, eval_every=100, codes=True, codes_lr=1e-2, cosine=True,
                cuda_graph=graphed,
            )  # fmt: skip
        rows[name] = {
            "seconds": rep.seconds,
            "steps_per_s": round(args.steps / rep.seconds, 2),
            "history": rep.history,
        }
    base = rows["eager"]["steps_per_s"]
    print(f"{'mode':<12}{'seconds':>10}{'steps/s':>10}{'x eager':>10}  held-out KL at the end")
    for name, r in rows.items():
        print(
            f"{name:<12}{r['seconds']:>10.1f}{r['steps_per_s']:>10.2f}"
            f"{r['steps_per_s'] / base:>10.2f}  {r['history'][-1][1]:.6f}"
        )
    result = {
        "benchmark": "e2e_speed",
        **run_info(sys.argv),
        "model": "random, SmolLM2-135M's shape" if not args.smoke else "smoke",
        "steps": args.steps,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
