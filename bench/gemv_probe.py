"""W4A16 GEMV variants on one shape: times side by side, and the compiled code for reading.

Builds an INT4 g128 weight stored N-major (as the GPU model stores it) and a bf16 x, and for
each `--config` (block_n,num_warps,split_k; `h2:` the same for the packed-fp16 kernel, `h2x:`
that kernel reading x in its producer-written GemvX form; either with `:key=value,...` options,
see below) prints the median time of one call
over 16 rotating weight copies (CUDA graph replay) and the error against float64. `--dump`
writes each variant's cubin (read it with nvdisasm where there is no GPU) and register counts.
`--iters` plain launches of the first config come first, for `ncu`.

    python bench/gemv_probe.py --shape 14336 4096 --config 32,1,8 64,1,16
    ncu --clock-control none -k regex:gemv_nmajor -c 1 python bench/gemv_probe.py ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tandem.formats.weight import QuantizedWeight, quantize_rtn  # noqa: E402
from tandem.kernels import w4a16 as wk  # noqa: E402

COPIES = 16


def timed(fn) -> float:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(COPIES):
            fn(i)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / COPIES)
    times.sort()
    return times[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=int, nargs=2, default=[14336, 4096], metavar=("N", "K"))
    ap.add_argument("--config", nargs="+", default=["32,1,8"])
    ap.add_argument("--iters", type=int, default=0)
    ap.add_argument("--m", type=int, default=1, help="rows of x")
    ap.add_argument("--dump", default=None, help="folder for cubins")
    args = ap.parse_args()
    n, k = args.shape
    dev = "cuda"
    w = wk.n_major(quantize_rtn(torch.randn(n, k, device=dev) * 0.02, 4, 128))
    ws = [w] + [
        wk.n_major(QuantizedWeight(w.qweight.clone(), w.scales.clone(), w.mins.clone(), 4, 128, k))
        for _ in range(COPIES - 1)
    ]
    x = torch.randn(args.m, k, device=dev, dtype=torch.bfloat16)
    ref = x.double() @ w.dequantize(torch.float64).T
    rows = []
    for spec in args.config:
        if spec.startswith(
            "tc:"
        ):  # tensor cores: tc:block_n,num_warps,split_k,num_stages[,block_m]
            bn, nw, sk, st, *bm = (int(v) for v in spec[3:].split(","))
            cfg = wk.GemvTCConfig(bn, sk, nw, st, *bm)
            launch = wk.launch_gemv_tc
        elif spec.startswith(("h2:", "h2x:")):
            # packed fp16: h2:block_n,num_warps,split_k[:key=value,...] with keys ahead
            # (GemvH2Config.ahead, 0 or 1) and atomic (see below)
            parts = spec.split(":")
            bn, nw, sk = (int(v) for v in parts[1].split(","))
            opts = dict(kv.split("=") for kv in parts[2].split(",")) if len(parts) > 2 else {}
            unknown = set(opts) - {"ahead", "atomic"}
            if unknown:
                raise SystemExit(f"{spec}: unknown option(s) {', '.join(sorted(unknown))}")
            cfg = wk.GemvH2Config(bn, sk, nw, ahead=bool(int(opts.get("ahead", 0))))
            xq_of_x = wk.gemv_x_ref(x, 128) if spec.startswith("h2x:") else None

            atomic = int(opts.get("atomic", 0))
            # atomic=1: the programs add into a float32 row with float atomics (`accumulate`),
            # one zeroed row per weight copy, never re-zeroed while timing (the sums grow; the
            # time is the kernel's); atomic=2: the same with each row zeroed by its own launch
            # before each call (what a caller without a fused zeroing pays).
            accs = {id(c): torch.zeros(args.m, n, device=dev) for c in ws} if atomic else {}
            fresh = [True]

            def launch(x, w, cfg, xq=xq_of_x, atomic=atomic, accs=accs, fresh=fresh):
                if not atomic:  # x as its producer writes it (GemvX, h2x:)
                    return wk.launch_gemv_h2(x, w, cfg, xq)
                acc = accs[id(w)]
                if atomic == 2 or fresh[0]:
                    acc.zero_()
                    fresh[0] = False
                return wk.launch_gemv_h2(x, w, cfg, xq, accumulate=acc)

        elif spec.startswith("gemm:"):  # tl.dot kernel: gemm:bm,bn,bk,split_k,num_warps,stages
            cfg = wk.GemmConfig(*(int(v) for v in spec[5:].split(",")))

            def launch(x, w, cfg):
                return wk.w4a16_matmul_triton(x, w, cfg), None

        else:
            bn, nw, sk = (int(v) for v in spec.split(","))
            cfg = wk.GemvNConfig(bn, sk, nw, 1)
            launch = wk.launch_gemv_nmajor
        try:
            y, kern = launch(x, w, cfg)
            y = y.clone()  # an `atomic` row goes on accumulating while timed
            for i in range(args.iters if not rows else 0):
                launch(x, ws[i % COPIES], cfg)
            torch.cuda.synchronize()
            us = timed(lambda i, cfg=cfg, launch=launch: launch(x, ws[i], cfg))
        except Exception as e:  # noqa: BLE001 - one failing variant does not end the sweep
            print(json.dumps({"N": n, "K": k, "variant": spec, "error": repr(e)[:300]}), flush=True)
            continue
        row = {"N": n, "K": k, "variant": spec, "us": us, "bytes": w.nbytes,
               "GBps": w.nbytes / us / 1e3, "M": args.m,
               "n_regs": getattr(kern, "n_regs", None), "n_spills": getattr(kern, "n_spills", None),
               "rel_err": ((y.double() - ref).norm() / ref.norm()).item()}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.dump and kern is not None:
            os.makedirs(args.dump, exist_ok=True)
            tag = f"{n}x{k}_" + spec.replace(",", "_")
            with open(os.path.join(args.dump, f"{tag}.cubin"), "wb") as f:
                f.write(kern.asm["cubin"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
