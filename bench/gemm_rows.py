"""The decode-batch GEMM (`tandem.kernels.gemm_rows`) against cuBLAS (F.linear) on Llama-3-8B's
linear layers, bf16, M = 16 to 256 rows.

Per (layer, M): each implementation replayed from a CUDA graph of 32 calls (captured after
warm-up calls, the first of which runs the autotuner; best of 3 timings of 10 replays), the time
per call, the weight bytes read per second (N * K * 2 / time), cuBLAS's time over the kernel's,
the config the autotuner chose, and each one's largest difference from a float64 reference
relative to the reference's largest value. The 32 calls rotate over copies of the weight,
256 MiB or more in all, so that each call reads its weight from memory, not from L2 (50 MiB), as
a decode step does. The chain: 32 calls alternating o_proj and qkv, each taking the previous
call's output (the qkv output's first 4096 columns, a strided view), where programmatic
dependent launch lets a kernel's weight loads overlap the tail of the one before (cuBLAS kernels
do not take part).

    python bench/gemm_rows.py --out bench/results/h200_gemm_rows.json
    python bench/gemm_rows.py --layers o_proj,qkv --rows 64     # a subset
    python bench/gemm_rows.py --smoke      # tiny shapes, CPU (Triton interpreter): checks only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

if "--smoke" in sys.argv:  # the Triton interpreter, chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_random as lr  # noqa: E402

from tandem.kernels.gemm_rows import gemm_rows_config, gemm_rows_triton  # noqa: E402

# name: (N, K) of the weight
LAYERS = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
ROWS = (16, 32, 64, 128, 256)
# Non-multiples of the tiles; K of 256 splits in two under the interpreter.
SMOKE_LAYERS = {"qkv": (192, 128), "o_proj": (128, 128), "gate_up": (160, 64), "down": (128, 256),
                "lm_head": (100, 128)}  # fmt: skip
SMOKE_ROWS = (2, 5, 20)
CALLS = 32  # per graph, and in the chain
ROTATE_BYTES = 256 << 20
TOL = 1e-2  # bf16 output: relative 2**-9 per value, sums in float32


def timed(fn, reps: int, cuda: bool) -> float:
    """Seconds per call of fn (which makes CALLS calls): on CUDA the best of `reps` timings of
    10 replays of a graph of fn; else the median of `reps` runs of fn."""
    if not cuda:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2] / CALLS
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            graph.replay()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) / 1e3 / (10 * CALLS))
    del graph
    return best


def weights(n: int, k: int, dev: str, dtype: torch.dtype, rotate: bool) -> list[torch.Tensor]:
    """Copies of one random [n, k] weight (scaled so outputs stay near unit size): enough that
    CALLS calls rotating over them read ROTATE_BYTES or more (one copy when not rotating)."""
    w = (torch.randn(n, k, device=dev) * k**-0.5).to(dtype)
    copies = max(2, -(-ROTATE_BYTES // (n * k * w.element_size()))) if rotate else 1
    return [w] + [w.clone() for _ in range(min(copies, CALLS) - 1)]


def rel_diff(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def config_str(cfg: dict | None) -> str:
    if cfg is None:
        return "?"
    return (f"m{cfg['BLOCK_M']} n{cfg['BLOCK_N']} k{cfg['BLOCK_K']} s{cfg['SPLIT_K']} "
            f"w{cfg['num_warps']} st{cfg['num_stages']}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--layers", default=None, help="comma-separated subset of " + ",".join(LAYERS))
    ap.add_argument("--rows", default=None, help="comma-separated values of M")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16
    layers = SMOKE_LAYERS if args.smoke else LAYERS
    if args.layers:
        layers = {name: layers[name] for name in args.layers.split(",")}
    rows = SMOKE_ROWS if args.smoke else ROWS
    if args.rows:
        rows = tuple(int(m) for m in args.rows.split(","))
    reps = 1 if args.smoke else args.reps
    res = {"benchmark": "gemm_rows", **lr.run_info(sys.argv), "smoke": args.smoke,
           "dtype": str(dtype), "calls_per_graph": CALLS, "rows": [], "chain": []}  # fmt: skip
    if not cuda:
        print("(Triton interpreter on CPU: the times mean nothing, the differences do)")
    print(f"{'layer':9}{'N':>7}{'K':>7}{'M':>5}{'triton us':>10}{'cublas us':>10}{'triton GB/s':>12}"
          f"{'cublas GB/s':>12}{'speedup':>8}  {'config':27}{'diff':>9}{'cublas diff':>12}")  # fmt: skip
    torch.manual_seed(0)
    failed = []
    for name, (n, k) in layers.items():
        ws = weights(n, k, dev, dtype, rotate=cuda)
        w64 = ws[0].double()
        for m in rows:
            x = torch.randn(m, k, device=dev).to(dtype)
            ref = x.double() @ w64.T
            diff = rel_diff(gemm_rows_triton(x, ws[0]), ref)  # on CUDA the autotuner runs here
            diff_cublas = rel_diff(F.linear(x, ws[0]), ref)
            del ref

            def run_triton(x=x, ws=ws):
                for i in range(CALLS):
                    gemm_rows_triton(x, ws[i % len(ws)])

            def run_cublas(x=x, ws=ws):
                for i in range(CALLS):
                    F.linear(x, ws[i % len(ws)])

            t_tri, t_cub = timed(run_triton, reps, cuda), timed(run_cublas, reps, cuda)
            nbytes = n * k * ws[0].element_size()
            cfg = gemm_rows_config(x, ws[0])
            row = {"layer": name, "N": n, "K": k, "M": m, "triton_s": t_tri, "cublas_s": t_cub,
                   "triton_GBps": nbytes / t_tri / 1e9, "cublas_GBps": nbytes / t_cub / 1e9,
                   "speedup": t_cub / t_tri, "config": cfg, "max_rel_diff": diff,
                   "cublas_max_rel_diff": diff_cublas}  # fmt: skip
            res["rows"].append(row)
            print(f"{name:9}{n:>7}{k:>7}{m:>5}{t_tri * 1e6:>10.1f}{t_cub * 1e6:>10.1f}"
                  f"{row['triton_GBps']:>12.0f}{row['cublas_GBps']:>12.0f}{t_cub / t_tri:>8.2f}  "
                  f"{config_str(cfg):27}{diff:>9.1e}{diff_cublas:>12.1e}")  # fmt: skip
            if diff > TOL:
                failed.append(f"{name} M={m}: the kernel differs from the reference by {diff:.1e}")
        del ws, w64

    if "o_proj" in layers and "qkv" in layers:
        (n_o, k_o), (n_q, k_q) = layers["o_proj"], layers["qkv"]
        ws_o = weights(n_o, k_o, dev, dtype, rotate=cuda)
        ws_q = weights(n_q, k_q, dev, dtype, rotate=cuda)
        print(f"\nchain: {CALLS} calls alternating o_proj and qkv, each on the previous output")
        print(f"{'M':>5}{'triton us/call':>16}{'cublas us/call':>16}{'speedup':>8}{'out diff':>10}")
        for m in rows:
            x0 = torch.randn(m, k_o, device=dev).to(dtype)

            def chain(linear, x0=x0) -> torch.Tensor:
                h = x0
                for i in range(CALLS):
                    if i % 2 == 0:
                        h = linear(h, ws_o[i // 2 % len(ws_o)])
                    else:  # qkv's output, its first k_o columns (a strided view) for o_proj
                        h = linear(h, ws_q[i // 2 % len(ws_q)])[:, :k_o]
                return h

            # Both chains' last outputs, relative to cuBLAS's largest value (rounding compounds
            # over the calls: a check that the chained launches compute the same thing).
            a, b = chain(gemm_rows_triton), chain(F.linear)
            out_diff = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
            t_tri = timed(lambda: chain(gemm_rows_triton), reps, cuda)
            t_cub = timed(lambda: chain(F.linear), reps, cuda)
            res["chain"].append({"M": m, "triton_s": t_tri, "cublas_s": t_cub,
                                 "speedup": t_cub / t_tri, "out_rel_diff": out_diff})  # fmt: skip
            print(f"{m:>5}{t_tri * 1e6:>16.1f}{t_cub * 1e6:>16.1f}{t_cub / t_tri:>8.2f}"
                  f"{out_diff:>10.1e}")  # fmt: skip

    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")
    if failed:
        raise SystemExit("\n".join(failed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
