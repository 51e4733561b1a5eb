"""Where a decode step's GPU time goes: per-kernel times of the engine's captured decode step.

Llama-3-8B shape, random bf16 weights built on the GPU. For each batch size the engine generates
until every sequence has its first token, then the profiler records `--steps` decode steps and
the kernels are grouped by name: GPU microseconds per step, launches per step, and the share of
the step. Beside it, the roofline of that step (weights + live KV over the copy bandwidth).

`--prefill N` also profiles prompt steps of N tokens (N / --prompt prompts at once, the size of
the steps a burst of requests begins with): the kernels of the steps that give every prompt its
first token, and the model FLOP/s they reach (matmul FLOPs: 2 x the layers' parameters a token,
the LM head once a prompt, causal attention).

    python bench/profile_decode.py --batch 1 64 --out bench/results/h200_profile_decode.json
    python bench/profile_decode.py --batch 32 512 --prompt 256 --prefill 16384
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_random as lr  # noqa: E402

from tandem.api.sampling_params import SamplingParams  # noqa: E402
from tandem.config import EngineConfig  # noqa: E402


def int4_engine(hf, **opts):
    """The engine over the same weights, every linear layer RTN-quantized to INT4 g128."""
    from tandem.engine.llm_engine import LLMEngine
    from tandem.formats.weight import LayerSpec, quantize_weights
    from tandem.model.config import ModelConfig
    from tandem.model.layer_names import linear_layer_names
    from tandem.model.loader import LoadedModel

    cfg = ModelConfig.from_hf(hf.config.to_dict(), name="random-llama-int4")
    specs = {n: LayerSpec(4, 128, True) for n in linear_layer_names(cfg.num_layers)}
    weights = quantize_weights(dict(hf.state_dict()), specs)
    loaded = LoadedModel(cfg, weights, lr._NoTokenizer(), "random-llama-int4")
    config = EngineConfig(**opts)
    config.validate()
    return LLMEngine(loaded, config)


BLOCK_SIZE = EngineConfig.block_size  # the engines' KV block (the default)
# Every profiled engine's settings: bf16 on the GPU, CUDA graphs, asynchronous scheduling.
ENGINE = dict(device="cuda", dtype="bfloat16", max_model_len=4096, cuda_graphs=True,
              async_scheduling=True)  # fmt: skip


def print_kernels(kernels: list[dict], unit: str = "us/step") -> None:
    """The longest kernels of a profile, a line each."""
    print(f"{unit:>9} {'n':>5} {'share':>6}  kernel")
    for k in kernels[:14]:
        print(f"{k['us_per_step']:9.1f} {k['launches_per_step']:5.0f} {k['share']:6.3f}  "
              f"{k['kernel'][:90]}")  # fmt: skip


def kernel_table(prof, steps: int) -> tuple[float, float, list[dict]]:
    """(GPU us per step, launches per step, kernels grouped by name, longest first)."""
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += ev.device_time
            per[ev.name][1] += 1
    total = sum(v[0] for v in per.values()) / steps
    kernels = sorted(
        (
            {
                "kernel": name[:120],
                "us_per_step": t / steps,
                "launches_per_step": n / steps,
                "share": t / steps / total,
            }
            for name, (t, n) in per.items()
        ),
        key=lambda r: -r["us_per_step"],
    )
    return total, sum(v[1] for v in per.values()) / steps, kernels


def profile_prefill(hf, tokens: int, prompt: int) -> dict:
    """The prompt steps of `tokens // prompt` prompts of `prompt` tokens, all admitted at once
    with a token budget of `tokens`."""
    n = tokens // prompt
    engine = lr.tandem_engine(hf, **ENGINE, kv_cache_memory_gb=16.0, max_num_seqs=max(8, n),
                              max_num_batched_tokens=tokens)  # fmt: skip
    vocab = hf.config.vocab_size
    lr.run_engine(engine, lr.random_prompts(n, prompt, vocab), 2)  # compiles, tunes
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    lr.sync()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    steps = 0
    with torch.profiler.profile(activities=acts) as prof:
        # New prompts: the prefix cache holds the warm-up's.
        seqs = [engine.add_request(p, sp) for p in lr.random_prompts(n, prompt, vocab, seed=1)]
        while not all(s.output_token_ids for s in seqs):
            engine.step()
            steps += 1
        lr.sync()
    while engine.has_unfinished():
        engine.step()
    gpu_us, launches, kernels = kernel_table(prof, 1)
    c = hf.config
    layer_params = sum(p.numel() for p in hf.model.layers.parameters())
    head = c.vocab_size * c.hidden_size
    attention = 2 * c.num_hidden_layers * c.hidden_size * prompt * prompt  # QK^T and PV, causal
    flops = 2 * layer_params * n * prompt + 2 * head * n + attention * n
    del engine
    torch.cuda.empty_cache()
    return {
        "prefill_tokens": n * prompt,
        "prompts": n,
        "prompt": prompt,
        "engine_steps": steps,
        "gpu_us": gpu_us,
        "launches": launches,
        "model_tflops": flops / 1e12,
        "model_tflop_per_s": flops / (gpu_us / 1e6) / 1e12,
        "kernels": kernels,
    }


def pool_blocks(batch: int, tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """KV blocks for `batch` sequences of `tokens` tokens each, all at once."""
    return batch * -(-tokens // block_size)


def profile_batch(
    hf, batch: int, prompt: int, steps: int, bw: float, int4: bool = False, kv_dtype: str = "auto"
) -> dict:
    make = int4_engine if int4 else lr.tandem_engine
    max_tokens = steps + 40
    # A pool that holds the whole batch at its longest: the profiled steps decode every sequence.
    engine = make(hf, **ENGINE, kv_dtype=kv_dtype, num_blocks=pool_blocks(batch, prompt + max_tokens),
                  max_num_seqs=max(8, batch))  # fmt: skip
    prompts = lr.random_prompts(batch, prompt, hf.config.vocab_size)
    lr.run_engine(engine, prompts, 8)  # warm-up: compiles, captures the bucket's graph
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, sp) for p in prompts]
    while not all(s.output_token_ids for s in seqs):
        engine.step()
    for _ in range(10):
        engine.step()
    lr.sync()
    sched = engine.scheduler
    preempted = sched.num_preemptions
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
            if len(sched.running) != batch:
                raise RuntimeError(f"{len(sched.running)} of {batch} sequences ran a profiled step")
        lr.sync()
    if sched.num_preemptions != preempted:
        raise RuntimeError(f"{sched.num_preemptions - preempted} sequences were preempted")
    while engine.has_unfinished():
        engine.step()
    total, launches, kernels = kernel_table(prof, steps)
    ctx = prompt + 10 + steps // 2
    wb = lr.weight_bytes_per_step(engine)
    kvb = lr.kv_bytes_per_token(engine) * ctx * batch
    return {
        "batch": batch,
        "weights": "int4" if int4 else "bf16",
        "kv_dtype": kv_dtype,
        "prompt": prompt,
        "context_tokens_mid": ctx,
        "gpu_us_per_step": total,
        "launches_per_step": launches,
        "roofline_us_per_step": (wb + kvb) / bw * 1e6,
        "fraction_of_roofline": (wb + kvb) / bw * 1e6 / total,
        "kernels": kernels,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--int4", action="store_true", help="also profile INT4 g128 weights")
    ap.add_argument("--kv-fp8", action="store_true", help="also profile an FP8 KV cache")
    ap.add_argument(
        "--prefill", type=int, nargs="*", default=[], help="also profile prompt steps of N tokens"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = {"benchmark": "profile_decode", **lr.run_info(sys.argv)}
    bw = lr.copy_bandwidth()
    res["copy_bandwidth_Bps"] = bw
    hf = lr.build_hf_model(lr.LLAMA3_8B, "cuda", torch.bfloat16)
    res["rows"] = []
    cases = [(b, False, "auto") for b in args.batch]
    if args.int4:
        cases += [(b, True, "auto") for b in args.batch]
    if args.kv_fp8:
        cases += [(b, False, "fp8") for b in args.batch]
    for b, int4, kvd in cases:
        row = profile_batch(hf, b, args.prompt, args.steps, bw, int4, kvd)
        res["rows"].append(row)
        print(f"\nbatch {b} {row['weights']} kv {kvd}: {row['gpu_us_per_step']:.0f} us/step GPU, "
              f"{row['launches_per_step']:.0f} launches, roofline {row['roofline_us_per_step']:.0f}"
              f" us ({row['fraction_of_roofline']:.3f})")  # fmt: skip
        print_kernels(row["kernels"])
    res["prefill_rows"] = []
    for tokens in args.prefill:
        row = profile_prefill(hf, tokens, args.prompt)
        res["prefill_rows"].append(row)
        print(f"\nprefill {row['prefill_tokens']} tokens ({row['prompts']} x {row['prompt']}) in "
              f"{row['engine_steps']} steps: {row['gpu_us'] / 1e3:.1f} ms GPU, "
              f"{row['model_tflop_per_s']:.0f} model TFLOP/s")  # fmt: skip
        print_kernels(row["kernels"], "us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
