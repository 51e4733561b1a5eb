"""Single-stream decode speed of the Tandem engine against the memory roofline (Llama-3-8B shape).

Decode is memory-bound: each step reads every weight and the live KV once, so the fewest seconds a
step can take is (weight bytes + KV bytes) / bandwidth, with the bandwidth measured in the same run
(a device-to-device copy, bytes read + written). Random bf16 weights are built on the GPU in
seconds; nothing is downloaded. Rows:
  engine           tokens/s of LLMEngine.step after the first token: the default (CUDA graphs,
                   asynchronous scheduling, Triton GEMV), then without asynchronous
                   scheduling, and eager (no graphs)
  step alone       GPU time of one captured decode step replayed alone (no Python between steps)
  linears alone    GPU time of the step's matrix-vector products alone (what the non-linear
                   parts of the step cost is the difference)

    python bench/decode_roofline.py            # writes bench/results/h200_decode_roofline.json
    python bench/decode_roofline.py --smoke    # tiny model, CPU or GPU, checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_random as lr  # noqa: E402

from tandem.kernels import gemv  # noqa: E402


def replay_time_s(g: torch.cuda.CUDAGraph, reps: int = 50) -> float:
    """Median GPU seconds of one replay of a captured graph."""
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]


def graph_time_s(fn) -> float:
    """Median GPU seconds of `fn` captured in a CUDA graph (warmed up on a side stream)."""
    return replay_time_s(lr.captured(fn))


def linears_only_s(engine, matvec) -> float:
    """One decode step's matrix-vector products at batch 1, nothing else, in a CUDA graph."""
    m = engine.model
    x = torch.randn(1, m.cfg.hidden_size, device="cuda", dtype=m.dtype)
    xo = torch.randn(1, m.layers[0].o.in_features, device="cuda", dtype=m.dtype)
    xd = torch.randn(1, m.layers[0].down.in_features, device="cuda", dtype=m.dtype)

    def step() -> None:
        for lw in m.layers:
            matvec(x, lw.qkv.weight)
            matvec(xo, lw.o.weight)
            matvec(x, lw.gate_up.weight)
            matvec(xd, lw.down.weight)
        matvec(x, m.lm_head.weight)

    return graph_time_s(step)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=256, help="generated tokens")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--smoke", action="store_true", help="tiny model; runs on CPU too")
    ap.add_argument(
        "--out", default=os.path.join(lr.ROOT, "bench", "results", "h200_decode_roofline.json")
    )
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    shape = lr.SMOKE if args.smoke else lr.LLAMA3_8B
    res: dict = {"benchmark": "decode_roofline", **lr.run_info(sys.argv), "smoke": args.smoke}
    res["workload"] = {"batch": 1, "prompt_tokens": args.prompt, "new_tokens": args.new_tokens,
                       "max_model_len": args.max_model_len, "shape": shape}  # fmt: skip
    t0 = time.perf_counter()
    bw = lr.copy_bandwidth() if cuda else 1e11
    res["copy_bandwidth_Bps"] = bw
    dtype = torch.bfloat16 if cuda else torch.float32
    hf = lr.build_hf_model(shape, dev, dtype)
    res["build_s"] = time.perf_counter() - t0
    prompt = lr.random_prompts(1, args.prompt, shape["vocab_size"])
    base = dict(
        device=dev,
        dtype="bfloat16" if cuda else "float32",
        max_model_len=args.max_model_len,
        kv_cache_memory_gb=2.0,
        max_num_seqs=8,
    )
    # Engine options: the default first, then what each part is worth (no overlap of Python
    # with the GPU; no graphs).
    modes = {
        "graphs+async": dict(cuda_graphs=True, async_scheduling=True),
        "graphs": dict(cuda_graphs=True, async_scheduling=False),
        "eager": dict(cuda_graphs=False, async_scheduling=False),
    }
    rows = []
    ctx = args.prompt + args.new_tokens
    for name, opts in modes.items():
        engine = lr.tandem_engine(hf, **base, **opts)
        lr.run_engine(engine, prompt, 8)  # warm-up: compiles kernels, captures the graph
        run = lr.run_engine(engine, prompt, args.new_tokens)
        wb = lr.weight_bytes_per_step(engine)
        kvt = lr.kv_bytes_per_token(engine)
        roof = lr.decode_roofline_s(wb, kvt, 1, args.prompt, args.new_tokens, bw)
        row = {"mode": name,
               "decode_tokens_per_s": run.decode_tokens / run.decode_s,
               "roofline_tokens_per_s": run.decode_tokens / roof,
               "fraction_of_roofline": roof / run.decode_s, "decode_s": run.decode_s,
               "e2e_s": run.e2e_s, "steps": run.steps}  # fmt: skip
        if cuda and not args.smoke and opts["cuda_graphs"]:
            # GPU time of the batch-1 step alone, replayed with the engine's last inputs
            # (context prompt + new tokens), and of its linear layers alone.
            step = replay_time_s(engine.runner.graphs.graphs[1])
            row["graph_replay"] = {"context": ctx, "step_s": step,
                                   "fraction_of_roofline": (wb + ctx * kvt) / bw / step}  # fmt: skip
            lin = linears_only_s(engine, gemv.linear_rows)
            row["linears_only"] = {"step_s": lin, "weight_GBps": wb / lin / 1e9,
                                   "fraction_of_copy_bw": wb / lin / bw}  # fmt: skip
        rows.append(row)
        print(row, flush=True)
        res["weight_bytes_per_step"], res["kv_bytes_per_token"] = wb, kvt
        del engine
        if cuda:
            torch.cuda.empty_cache()
    res["engine"] = rows
    res["seconds"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s; weights {res['weight_bytes_per_step'] / 1e9:.2f}"
          f" GB/step; KV {res['kv_bytes_per_token'] / 1e3:.0f} kB/token")  # fmt: skip
    print(f"{'mode':<22}{'tok/s':>9}{'roofline':>10}{'fraction':>10}")
    for r in rows:
        print(f"{r['mode']:<22}{r['decode_tokens_per_s']:>9.1f}{r['roofline_tokens_per_s']:>10.1f}"
              f"{r['fraction_of_roofline']:>10.3f}")  # fmt: skip
    for r in rows:
        if "graph_replay" in r:
            gr, li = r["graph_replay"], r["linears_only"]
            print(f"{r['mode']}: step alone {gr['step_s'] * 1e3:.3f} ms "
                  f"({gr['fraction_of_roofline']:.3f} of roofline); linears alone "
                  f"{li['step_s'] * 1e3:.3f} ms ({li['fraction_of_copy_bw']:.3f} of copy bw)")  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
