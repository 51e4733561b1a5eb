"""Decode attention over the paged cache, the kernel alone: as a captured step launches it, and
with a grid sized for the batch's own longest context.

A captured decode step (CUDA graphs) fixes the kernel's grid at capture for the longest context
the model takes (`max_model_len`), so a batch of short contexts launches programs for partitions
that hold no tokens; they return at once, but each takes a program slot. Per case: the
`captured` launch (block tables as wide as max_model_len, the engine's partition size for the
batch), the `fitted` launch (the same call with max_context_len = the batch's longest context
rounded up to a partition), both replayed from a CUDA graph of 32 calls (best of 3 replays), the
KV bytes read per microsecond, and the largest difference from the torch reference.
Llama-3-8B heads (32 query, 8 KV, head_dim 128), bf16, random K/V and block tables.

    python bench/decode_attention.py --out bench/results/h200_decode_attention.json
    python bench/decode_attention.py --smoke      # tiny, CPU (Triton interpreter)
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_random as lr  # noqa: E402

from tandem.kernels.paged_attention import paged_attention_decode_triton  # noqa: E402
from tandem.kernels.paged_attention_ref import paged_attention_decode_ref  # noqa: E402
from tandem.layers.attention import decode_partition_size  # noqa: E402


def mixed(batch: int, seed: int = 1, hi: int = 4000) -> list[int]:
    """Context lengths of a mixed batch: log-normal (median 245 tokens), clipped to [16, hi]."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(batch, generator=g) + 5.5).clamp(16, hi).long().tolist()


CASES = {
    "b1 ctx 150": [150],
    "b1 ctx 4000": [4000],
    "b64 ctx 150": [150] * 64,
    "b64 ctx 1000": [1000] * 64,
    "b64 mixed": mixed(64),
    "b256 ctx 150": [150] * 256,
    "b256 ctx 1000": [1000] * 256,
    "b256 mixed": mixed(256),
    "b256 4x4000 + 252x150": [4000] * 4 + [150] * 252,
}
SMOKE = {"b2 ctx 5, 40": [5, 40], "b3 ctx 7, 70, 100": [7, 70, 100]}


def timed(fn, reps: int, cuda: bool) -> float:
    """Seconds per call: on CUDA the best of `reps` replays of a graph of 32 calls; else the
    median of `reps` calls."""
    if not cuda:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(32):
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
        best = min(best, e0.elapsed_time(e1) / 1e3 / 320)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    hq, hkv, d, bs = (32, 8, 128, 16) if not args.smoke else (4, 2, 32, 8)
    max_len = args.max_model_len if not args.smoke else 128
    cases = SMOKE if args.smoke else CASES
    scale = d**-0.5
    width = max_len // bs
    pool = max(sum(-(-c // bs) for c in lens) for lens in cases.values())
    torch.manual_seed(0)
    kc = torch.randn(pool, bs, hkv, d, device=dev).to(dtype)
    vc = torch.randn(pool, bs, hkv, d, device=dev).to(dtype)
    res = {"benchmark": "decode_attention", **lr.run_info(sys.argv), "smoke": args.smoke,
           "shape": {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "block_size": bs,
                     "dtype": str(dtype), "max_model_len": max_len}, "rows": []}  # fmt: skip
    print(f"{'case':24}{'mean ctx':>9}{'parts':>6}{'captured us':>12}{'fitted us':>10}"
          f"{'ratio':>7}{'GB/s':>8}{'max diff':>10}")  # fmt: skip
    for name, lens in cases.items():
        b = len(lens)
        q = torch.randn(b, hq, d, device=dev).to(dtype)
        # Each sequence's blocks: distinct pool blocks in a random order; the rest of the row 0.
        perm = torch.randperm(pool, device=dev).to(torch.int32)
        table = torch.zeros(b, width, dtype=torch.int32, device=dev)
        used = 0
        for i, c in enumerate(lens):
            nb = -(-c // bs)
            table[i, :nb] = perm[used : used + nb]
            used += nb
        ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
        ps = decode_partition_size(b, hkv)
        fitted_len = -(-max(lens) // ps) * ps

        def captured(q=q, table=table, ctx=ctx, ps=ps):
            return paged_attention_decode_triton(q, kc, vc, table, ctx, scale, partition_size=ps)

        def fitted(q=q, table=table, ctx=ctx, ps=ps, n=fitted_len):
            return paged_attention_decode_triton(
                q, kc, vc, table, ctx, scale, partition_size=ps, max_context_len=n
            )

        ref = paged_attention_decode_ref(q.float(), kc.float(), vc.float(), table, ctx, scale)
        diff = max((f().float() - ref).abs().max().item() for f in (captured, fitted))
        reps = 2 if args.smoke else args.reps
        t_cap, t_fit = timed(captured, reps, cuda), timed(fitted, reps, cuda)
        kv_bytes = sum(lens) * hkv * d * 2 * kc.element_size()
        row = {"case": name, "batch": b, "context_lens_mean": sum(lens) / b,
               "context_lens_max": max(lens), "partition_size": ps,
               "captured_partitions": -(-max_len // ps), "fitted_partitions": fitted_len // ps,
               "captured_s": t_cap, "fitted_s": t_fit, "captured_over_fitted": t_cap / t_fit,
               "captured_GBps": kv_bytes / t_cap / 1e9, "max_abs_diff": diff}  # fmt: skip
        res["rows"].append(row)
        print(f"{name:24}{row['context_lens_mean']:>9.0f}{row['captured_partitions']:>6}"
              f"{t_cap * 1e6:>12.1f}{t_fit * 1e6:>10.1f}{t_cap / t_fit:>7.2f}"
              f"{row['captured_GBps']:>8.0f}{diff:>10.2e}")  # fmt: skip
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        if diff > tol:
            raise SystemExit(f"{name}: the kernel differs from the reference by {diff:.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
