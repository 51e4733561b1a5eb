"""Prefill / chunked-prefill / verification attention over the paged cache: Triton vs SDPA.

Two implementations of `paged_attention_varlen` (causal attention of packed multi-token queries
over the paged KV cache) side by side on the same inputs:
  triton  `paged_attention_varlen_triton`: one launch for the whole batch, reads the block table
  sdpa    `paged_attention_varlen_ref`: per sequence, gathers its KV into a contiguous tensor and
          calls torch's scaled_dot_product_attention (flash / memory-efficient kernels)
Llama-3-8B attention shape (32 query heads, 8 KV heads, head_dim 128), bf16. Times are wall
seconds with a device synchronize (what the forward pass pays, Python included), median of reps.
The runner's choice between the two (TANDEM_PREFILL_ATTENTION) should follow these figures.

    python bench/prefill_attention.py --out bench/results/h200_prefill_attention.json
    python bench/prefill_attention.py --smoke      # tiny, CPU (interpreter) or GPU
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

from tandem.kernels.paged_attention_ref import paged_attention_varlen_ref  # noqa: E402
from tandem.kernels.paged_attention_varlen import paged_attention_varlen_triton  # noqa: E402

# name: list of (context tokens, query tokens) per sequence
CASES = {
    "prefill 1x512": [(512, 512)],
    "prefill 1x2048": [(2048, 2048)],
    "prefill 1x8192": [(8192, 8192)],
    "prefill 16x512": [(512, 512)] * 16,
    "chunk 4x512 after 1536 cached": [(2048, 512)] * 4,
    "verify 64x5 at ctx 1024": [(1024, 5)] * 64,
}
SMOKE = {"prefill 2x40": [(40, 40)] * 2, "chunk 2x8 after 24": [(32, 8)] * 2}


def build(case, hq, hkv, d, bs, dtype, dev):
    lens = [c for c, _ in case]
    q_lens = [q for _, q in case]
    need = [(n + bs - 1) // bs for n in lens]
    nblocks = sum(need)
    kc = torch.randn(nblocks, bs, hkv, d, device=dev).to(dtype)
    vc = torch.randn(nblocks, bs, hkv, d, device=dev).to(dtype)
    perm = torch.randperm(nblocks, device=dev)
    table = torch.zeros(len(case), max(need), dtype=torch.int32, device=dev)
    used = 0
    for i, nb in enumerate(need):
        table[i, :nb] = perm[used : used + nb].int()
        used += nb
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], hq, d, device=dev).to(dtype)
    return q, kc, vc, table, starts, lens


def timed(fn, reps: int) -> float:
    fn()
    lr.sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        lr.sync()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    hq, hkv, d, bs = (32, 8, 128, 16) if not args.smoke else (4, 2, 32, 8)
    cases = SMOKE if args.smoke else CASES
    res = {"benchmark": "prefill_attention", **lr.run_info(sys.argv), "smoke": args.smoke,
           "shape": {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "block_size": bs,
                     "dtype": str(dtype)}, "rows": []}  # fmt: skip
    print(f"{'case':32} {'triton ms':>10} {'sdpa ms':>10} {'sdpa/triton':>11} {'max diff':>9}")
    for name, case in cases.items():
        q, kc, vc, table, starts, lens = build(case, hq, hkv, d, bs, dtype, dev)
        scale = d**-0.5
        a = paged_attention_varlen_triton(q, kc, vc, table, starts, lens, scale)
        b = paged_attention_varlen_ref(q, kc, vc, table, starts, lens, scale)
        diff = (a.float() - b.float()).abs().max().item()
        reps = 2 if args.smoke else args.reps
        inputs = (q, kc, vc, table, starts, lens, scale)
        tt = timed(lambda x=inputs: paged_attention_varlen_triton(*x), reps)
        ts = timed(lambda x=inputs: paged_attention_varlen_ref(*x), reps)
        # causal score + value FLOPs: 4 * D per (query, visible key) pair, per query head
        pairs = sum(sum(c - ql + i + 1 for i in range(ql)) for c, ql in case)
        flops = 4 * d * hq * pairs
        row = {"case": name, "triton_s": tt, "sdpa_s": ts, "sdpa_over_triton": ts / tt,
               "triton_TFLOPs": flops / tt / 1e12, "sdpa_TFLOPs": flops / ts / 1e12,
               "max_abs_diff": diff}  # fmt: skip
        res["rows"].append(row)
        print(f"{name:32} {tt * 1e3:10.3f} {ts * 1e3:10.3f} {ts / tt:11.2f} {diff:9.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
