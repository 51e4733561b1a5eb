"""Decode attention over the paged cache, the kernel alone: as a captured step launches it, and
with a grid sized for the batch's own longest context.

Each launch takes the engine's partition size and L2 prefetch for the batch. A captured decode
step (CUDA graphs) fixes the kernel's grid at capture for the longest context the model takes
(`max_model_len`), so a batch of short contexts launches programs for partitions
that hold no tokens; they return at once, but each takes a program slot. Per case: the
`captured` launch (block tables as wide as max_model_len, the engine's partition size for the
batch), the `fitted` launch (the same call with max_context_len = the batch's longest context
rounded up to a partition), both replayed from a CUDA graph of 32 calls (best of 3 replays), the
KV bytes read per microsecond, and the largest difference from the torch reference.
Llama-3-8B heads (32 query, 8 KV, head_dim 128), bf16, random K/V and block tables.

    python bench/decode_attention.py --out bench/results/h200_decode_attention.json
    python bench/decode_attention.py --smoke      # tiny, CPU (Triton interpreter)

`--sweep` times stage 1's tilings instead (tokens per inner iteration, warps, pipeline stages,
the L2 prefetch before the PDL wait, the partition size) on the large-batch cases, each checked
against the reference, and prints the GB/s of every tiling and the best per case; `--kv-fp8`
(`--kv-int8`) over an FP8 (INT8) cache with per-(block, head) scales.

    python bench/decode_attention.py --sweep --out bench/results/h100_decode_tiling.json
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
from tandem.layers.attention import (  # noqa: E402
    decode_prefetch,
    decode_tiling,
)


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
SWEEP_CASES = {
    "b1 ctx 4000": [4000],
    "b8 ctx 1000": [1000] * 8,
    "b32 ctx 512": [512] * 32,
    "b64 ctx 512": [512] * 64,
    "b256 ctx 512": [512] * 256,
    "b512 ctx 512": [512] * 512,
    "b256 mixed": mixed(256),
    "b1024 ctx 400": [400] * 1024,
}
# (block_n, num_warps, num_stages or None for Triton's default, prefetch)
TILINGS = [(n, w, st, pf) for n in (32, 64, 128) for w in (4, 8)
           for st, pf in ((None, True), (None, False), (2, True), (4, True))]  # fmt: skip
SMOKE_TILINGS = [(64, 4, None, True), (32, 4, 2, False)]  # the engine's first


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


def make_case(lens, pool, width, bs, hq, d, dev, dtype):
    """Query and block table of a batch with context lengths `lens`: each sequence's blocks are
    distinct pool blocks in a random order; the rest of its row 0."""
    b = len(lens)
    q = torch.randn(b, hq, d, device=dev).to(dtype)
    perm = torch.randperm(pool, device=dev).to(torch.int32)
    table = torch.zeros(b, width, dtype=torch.int32, device=dev)
    used = 0
    for i, c in enumerate(lens):
        nb = -(-c // bs)
        table[i, :nb] = perm[used : used + nb]
        used += nb
    return q, table, torch.tensor(lens, dtype=torch.int32, device=dev)


def random_pool(args, cases: dict, dev: str, dtype: torch.dtype):
    """Llama-3-8B heads (the smoke run's tiny ones), max_model_len, and a pool of random K/V with
    room for the largest case: (hq, hkv, d, bs, max_len, kc, vc)."""
    hq, hkv, d, bs = (32, 8, 128, 16) if not args.smoke else (4, 2, 32, 8)
    max_len = args.max_model_len if not args.smoke else 128
    pool = max(sum(-(-c // bs) for c in lens) for lens in cases.values())
    torch.manual_seed(0)
    kc = torch.randn(pool, bs, hkv, d, device=dev).to(dtype)
    vc = torch.randn(pool, bs, hkv, d, device=dev).to(dtype)
    return hq, hkv, d, bs, max_len, kc, vc


def sweep(args, cuda: bool, dev: str, dtype: torch.dtype) -> int:
    """Every tiling of TILINGS (and partition sizes) on SWEEP_CASES: GB/s, best per case."""
    cases = SMOKE if args.smoke else SWEEP_CASES
    if args.cases:
        cases = {k: v for k, v in cases.items() if k in args.cases}
    tilings = SMOKE_TILINGS if args.smoke else TILINGS
    hq, hkv, d, bs, max_len, kc, vc = random_pool(args, cases, dev, dtype)
    scale = d**-0.5
    width = max_len // bs
    pool = kc.shape[0]
    ks = vs = None
    if args.kv_fp8 or args.kv_int8:  # codes, each (block, head) scaled to the codes' range
        top, code = (448, torch.float8_e4m3fn) if args.kv_fp8 else (127, torch.int8)
        ks = kc.float().abs().amax(dim=(1, 3)).contiguous() / top + 1e-6
        vs = vc.float().abs().amax(dim=(1, 3)).contiguous() / top + 1e-6
        kc, vc = (kc.float() / ks[:, None, :, None], vc.float() / vs[:, None, :, None])
        if code == torch.int8:
            kc, vc = kc.round().clamp(-127, 127), vc.round().clamp(-127, 127)
        kc, vc = kc.to(code), vc.to(code)
    res = {"benchmark": "decode_attention_tiling", **lr.run_info(sys.argv), "smoke": args.smoke,
           "shape": {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "block_size": bs,
                     "dtype": str(dtype), "kv_dtype": str(kc.dtype), "max_model_len": max_len},
           "cases": {}}  # fmt: skip
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for name, lens in cases.items():
        q, table, ctx = make_case(lens, pool, width, bs, hq, d, dev, dtype)
        kf, vf = (kc.float(), vc.float()) if ks is None else (kc, vc)
        ref = torch.cat([paged_attention_decode_ref(q[i : i + 64].float(), kf, vf,
                                                    table[i : i + 64], ctx[i : i + 64], scale,
                                                    ks, vs)
                         for i in range(0, len(lens), 64)])  # fmt: skip
        del kf, vf
        kv_bytes = sum(lens) * hkv * d * 2 * kc.element_size()
        engine_ps, engine_n = decode_tiling(len(lens), hkv, kc.dtype)
        rows = []
        for ps in sorted({engine_ps, 512, 1024} if cuda else {engine_ps}):
            for n, w, st, pf in tilings:
                if n > ps:
                    continue

                def call(q=q, table=table, ctx=ctx, ps=ps, n=n, w=w, st=st, pf=pf):
                    return paged_attention_decode_triton(
                        q, kc, vc, table, ctx, scale, partition_size=ps, block_n=n,
                        num_warps=w, num_stages=st, prefetch=pf, k_scale=ks, v_scale=vs,
                    )  # fmt: skip

                try:
                    diff = (call().float() - ref).abs().max().item()
                except Exception as e:  # a tiling that does not fit the device (shared memory)
                    print(f"   ps {ps} {n, w, st, pf}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                if diff > tol:
                    raise SystemExit(f"{name} {ps, n, w, st, pf}: differs by {diff:.2e}")
                t = timed(call, 2 if args.smoke else args.reps, cuda)
                rows.append({"partition_size": ps, "block_n": n, "num_warps": w,
                             "num_stages": st, "prefetch": pf, "s": t,
                             "GBps": kv_bytes / t / 1e9})  # fmt: skip
        # The engine's tiling: its partition size and tokens an iteration, 4 warps, Triton's
        # stages, and the prefetch as decode_prefetch chooses it for this batch.
        engine = (engine_ps, engine_n, 4, None, decode_prefetch(len(lens), hkv))
        now = next(r for r in rows if (r["partition_size"], r["block_n"], r["num_warps"],
                                       r["num_stages"], r["prefetch"]) == engine)  # fmt: skip
        rows.sort(key=lambda r: r["s"])
        res["cases"][name] = {"batch": len(lens), "context_lens_mean": sum(lens) / len(lens),
                              "engine_default": now, "tilings": rows}  # fmt: skip
        print(f"{name}: engine's tiling {now['GBps']:.0f} GB/s ({now['s'] * 1e6:.1f} us); best:")
        for r in rows[:6]:
            print(f"   ps {r['partition_size']:5} n {r['block_n']:4} warps {r['num_warps']} "
                  f"stages {r['num_stages']} prefetch {r['prefetch']!s:5} "
                  f"{r['s'] * 1e6:8.1f} us {r['GBps']:6.0f} GB/s {now['s'] / r['s']:5.2f}x")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="time stage 1's tilings")
    ap.add_argument("--cases", nargs="+", default=None, help="--sweep: only these cases")
    kv = ap.add_mutually_exclusive_group()
    kv.add_argument("--kv-fp8", action="store_true", help="--sweep: an FP8 cache with scales")
    kv.add_argument("--kv-int8", action="store_true", help="--sweep: an INT8 cache with scales")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.sweep:
        return sweep(args, cuda, dev, dtype)
    cases = SMOKE if args.smoke else CASES
    hq, hkv, d, bs, max_len, kc, vc = random_pool(args, cases, dev, dtype)
    scale = d**-0.5
    width = max_len // bs
    pool = kc.shape[0]
    res = {"benchmark": "decode_attention", **lr.run_info(sys.argv), "smoke": args.smoke,
           "shape": {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "block_size": bs,
                     "dtype": str(dtype), "max_model_len": max_len}, "rows": []}  # fmt: skip
    print(f"{'case':24}{'mean ctx':>9}{'parts':>6}{'captured us':>12}{'fitted us':>10}"
          f"{'ratio':>7}{'GB/s':>8}{'max diff':>10}")  # fmt: skip
    for name, lens in cases.items():
        b = len(lens)
        q, table, ctx = make_case(lens, pool, width, bs, hq, d, dev, dtype)
        ps, _ = decode_tiling(b, hkv, kc.dtype)
        fitted_len = -(-max(lens) // ps) * ps

        pf = decode_prefetch(b, hkv)

        def captured(q=q, table=table, ctx=ctx, ps=ps, pf=pf):
            return paged_attention_decode_triton(
                q, kc, vc, table, ctx, scale, partition_size=ps, prefetch=pf
            )

        def fitted(q=q, table=table, ctx=ctx, ps=ps, n=fitted_len, pf=pf):
            return paged_attention_decode_triton(
                q, kc, vc, table, ctx, scale, partition_size=ps, max_context_len=n, prefetch=pf
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
