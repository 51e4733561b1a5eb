"""Decode speed of AWQ, GPTQ and compressed-tensors checkpoints against Tandem's own INT4 format.

One random INT4 g128 grid (codes, scales, zero points) per linear layer of a Llama-3-8B shape is
built on the GPU and written in each format's tensors (AutoAWQ GEMM, GPTQ without and with
act-order, compressed-tensors pack-quantized) and in Tandem's own (`tandem quantize`'s
QuantizedWeight). Each goes through the loader's repacking (`tandem.model.external_quant`, the same
function a checkpoint directory goes through after its safetensors are read; the tensors stay on
the GPU and nothing touches the disk), then one LLMEngine decodes a single stream. Nothing is
downloaded. Rows:
  format         what the tensors were written as
  tok/s          engine decode tokens/s (batch 1, CUDA graphs, async scheduling), median of runs
  step ms        GPU time of the captured batch-1 decode step replayed alone
  vs tandem      tok/s over Tandem's own format; "same" when within +-3 %

AWQ, GPTQ and compressed-tensors load as the very grid Tandem's format stores, so they run the
same kernels. Act-order layers read their input permuted, written so by the kernels that produce
it (see `tandem.model.external_quant`).

    python bench/external_quant.py          # writes bench/results/h200_external_quant.json
    python bench/external_quant.py --smoke  # tiny model; CPU or GPU, checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_random as lr  # noqa: E402

from tandem.formats.weight import QuantizedWeight, pack  # noqa: E402
from tandem.model.external_quant import load_external  # noqa: E402

GROUP = 128
TOLERANCE = 0.03
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FORMATS = ("tandem", "awq", "gptq", "gptq-act-order", "compressed-tensors")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def words(codes: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """4-bit codes [..., M] -> int32 [..., M / 8], code order[i] of each 8 at bits 4i."""
    c = codes.to(torch.int64).contiguous().view(*codes.shape[:-1], -1, 8)
    w = sum(c[..., o] << (4 * i) for i, o in enumerate(order))
    return (w - ((w >= 2**31).to(torch.int64) << 32)).to(torch.int32)


def random_grid(n: int, k: int, gen: torch.Generator, dev: str, sym: bool):
    """Codes [N, K], zero points [N, G] and scales [N, G] (bf16 values FP16 holds exactly)."""
    g = k // GROUP
    codes = torch.randint(0, 16, (n, k), generator=gen, device=dev, dtype=torch.int32)
    scales = (torch.rand(n, g, generator=gen, device=dev) * 2e-3 + 1e-3).to(torch.bfloat16)
    if sym:
        zeros = torch.full((n, g), 8, dtype=torch.int32, device=dev)
    else:
        zeros = torch.randint(0, 16, (n, g), generator=gen, device=dev, dtype=torch.int32)
    return codes, zeros, scales


def layer_tensors(fmt: str, codes, zeros, scales, g_idx) -> dict[str, torch.Tensor]:
    """One layer's tensors as format `fmt` stores them (see tandem.model.external_quant)."""
    if fmt == "awq":
        return {"qweight": words(codes.t(), AWQ_ORDER), "qzeros": words(zeros.t(), AWQ_ORDER),
                "scales": scales.t().half().contiguous()}  # fmt: skip
    if fmt.startswith("gptq"):
        # qweight [K / 8, N]: 8 consecutive input channels of one output column per word.
        return {"qweight": words(codes).t().contiguous(), "qzeros": words((zeros.t() - 1) & 15),
                "scales": scales.t().half().contiguous(), "g_idx": g_idx.int()}  # fmt: skip
    return {"weight_packed": words(codes), "weight_scale": scales,
            "weight_shape": torch.tensor(codes.shape)}  # fmt: skip


def build_weights(fmt: str, shape: dict, dev: str, dtype: torch.dtype) -> dict:
    """Tandem weights of a random Llama of `shape` whose linear layers are stored as `fmt`."""
    gen = torch.Generator(device=dev).manual_seed(0)
    h, i_ = shape["hidden_size"], shape["intermediate_size"]
    hd = h // shape["num_attention_heads"]
    kvd = shape["num_key_value_heads"] * hd
    dims = {"q_proj": (h, h), "k_proj": (kvd, h), "v_proj": (kvd, h), "o_proj": (h, h),
            "gate_proj": (i_, h), "up_proj": (i_, h), "down_proj": (h, i_)}  # fmt: skip
    v = shape["vocab_size"]
    out: dict = {
        "model.embed_tokens.weight": torch.randn(v, h, generator=gen, device=dev, dtype=dtype),
        "lm_head.weight": torch.randn(v, h, generator=gen, device=dev, dtype=dtype) * 0.02,
        "model.norm.weight": torch.ones(h, device=dev, dtype=dtype),
    }
    tensors: dict[str, torch.Tensor] = {}
    sym = fmt in ("gptq", "gptq-act-order", "compressed-tensors")
    for li in range(shape["num_hidden_layers"]):
        p = f"model.layers.{li}."
        out[p + "input_layernorm.weight"] = torch.ones(h, device=dev, dtype=dtype)
        out[p + "post_attention_layernorm.weight"] = torch.ones(h, device=dev, dtype=dtype)
        orders: dict[str, torch.Tensor] = {}  # act-order: one order per shared input
        for name in LINEARS:
            n, k = dims[name.split(".")[1]]
            codes, zeros, scales = random_grid(n, k, gen, dev, sym)
            g_idx = torch.arange(k, device=dev) // GROUP
            if fmt == "gptq-act-order":
                key = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu",
                       "up_proj": "gu"}.get(name.split(".")[1], name)  # fmt: skip
                if key not in orders:
                    perm = torch.randperm(k, generator=gen, device=dev)
                    orders[key] = torch.empty_like(perm)
                    orders[key][perm] = torch.arange(k, device=dev) // GROUP
                g_idx = orders[key]
            if fmt == "tandem":
                mins = (-zeros.float() * scales.float()).half()
                out[p + name + ".weight"] = QuantizedWeight(
                    pack(codes, 4), scales.half(), mins, 4, GROUP, k, True
                )
            else:
                for part, t in layer_tensors(fmt, codes, zeros, scales, g_idx).items():
                    tensors[f"{p}{name}.{part}"] = t
    if fmt == "tandem":
        return out
    qc = {
        "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                "version": "gemm"},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                 "sym": True},
        "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                           "desc_act": True, "sym": True},
        "compressed-tensors": {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                "group_size": GROUP}}},
            "ignore": ["lm_head"]},
    }[fmt]  # fmt: skip
    loaded = load_external({**out, **tensors}, qc, f"random-{fmt}", dtype)
    return loaded


def engine_for(weights: dict, shape: dict, **options):
    from tandem.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.model.config import ModelConfig
    from tandem.model.loader import LoadedModel

    cfg = ModelConfig.from_hf({"model_type": "llama", **shape}, name="random-llama")
    config = EngineConfig(**options)
    config.validate()
    return LLMEngine(LoadedModel(cfg, weights, lr._NoTokenizer(), "random-llama"), config)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=256, help="generated tokens")
    ap.add_argument("--runs", type=int, default=3, help="timed generations per format")
    ap.add_argument("--smoke", action="store_true", help="tiny model; runs on CPU too")
    ap.add_argument(
        "--out", default=os.path.join(lr.ROOT, "bench", "results", "h200_external_quant.json")
    )
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    shape = dict(lr.SMOKE, hidden_size=256, intermediate_size=512) if args.smoke else lr.LLAMA3_8B
    dtype = torch.bfloat16 if cuda else torch.float32
    res: dict = {"benchmark": "external_quant", **lr.run_info(sys.argv), "smoke": args.smoke}
    res["workload"] = {"batch": 1, "prompt_tokens": args.prompt, "new_tokens": args.new_tokens,
                       "runs": args.runs, "group_size": GROUP, "shape": shape}  # fmt: skip
    t0 = time.perf_counter()
    options = dict(device=dev, dtype="bfloat16" if cuda else "float32", max_model_len=2048,
                   kv_cache_memory_gb=1.0, max_num_seqs=1, cuda_graphs=cuda,
                   async_scheduling=cuda)  # fmt: skip
    prompt = lr.random_prompts(1, args.prompt, shape["vocab_size"])
    rows = []
    for fmt in FORMATS:
        t1 = time.perf_counter()
        weights = build_weights(fmt, shape, dev, dtype)
        load_s = time.perf_counter() - t1
        engine = engine_for(weights, shape, **options)
        del weights
        lr.run_engine(engine, prompt, 8)  # warm-up: compiles kernels, captures the graph
        rates = []
        for _ in range(args.runs):
            run = lr.run_engine(engine, prompt, args.new_tokens)
            rates.append(run.decode_tokens / run.decode_s)
        row = {"format": fmt, "decode_tokens_per_s": statistics.median(rates),
               "runs_tokens_per_s": rates, "build_and_repack_s": load_s}  # fmt: skip
        if cuda and engine.runner.graphs is not None and 1 in engine.runner.graphs.graphs:
            from decode_roofline import replay_time_s

            row["step_s"] = replay_time_s(engine.runner.graphs.graphs[1])
        rows.append(row)
        print(row, flush=True)
        del engine
        if cuda:
            torch.cuda.empty_cache()
    base = rows[0]["decode_tokens_per_s"]
    for r in rows:
        r["vs_tandem"] = r["decode_tokens_per_s"] / base
        r["within_3pct"] = abs(r["vs_tandem"] - 1) <= TOLERANCE
    res["rows"] = rows
    res["seconds"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"\n{'format':<22}{'tok/s':>9}{'step ms':>9}{'vs tandem':>11}")
    for r in rows:
        step = f"{r['step_s'] * 1e3:.3f}" if "step_s" in r else "-"
        same = "same" if r["within_3pct"] else "DIFFERS"
        print(f"{r['format']:<22}{r['decode_tokens_per_s']:>9.1f}{step:>9}"
              f"{r['vs_tandem']:>8.3f} {same}")  # fmt: skip
    print(f"{res['seconds']:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
