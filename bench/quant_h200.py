"""W4A16 and FP8-KV speed on one GPU (written for the H200): kernels, decode, memory, admission.

Everything is built on the device from random weights (Llama-3-8B shapes); nothing is downloaded
and the gguf package is not needed. Sections, each timed with CUDA graphs (so Python launch cost
is not measured) and with enough distinct weight copies that the L2 cache (60 MB) cannot serve
them:
  copy       device-to-device copy bandwidth, (bytes read + bytes written) / time
  gemm       for (N, K) in 14336x4096 and 4096x14336 and M in 1, 8, 32, 128: Tandem's W4A16
             Triton kernel (INT4 g128, default config and the best of a small sweep), torch's
             `aten._weight_int4pack_mm` (tinygemm, same grid), and the bf16 cuBLAS matmul
  decode     one decode step (batch 1, 1024 cached tokens) of a Llama-3-8B-shaped LlamaModel
             captured in a CUDA graph: bf16 weights vs INT4 g128 decoder linears (LM head and
             embedding bf16) vs "int4_all" (also the LM head INT4 g128, the embedding INT8
             g128); bf16 KV vs FP8 KV; programmatic dependent launch on and off. Beside the
             bf16-KV rows, the step's GPU time by kernel (torch.profiler, eager launches).
  memory     weight bytes of each, vs bf16
  e2e        single-stream decode tokens/s through the engine (scheduler, graph, sampling, the
             token to the host), bf16 vs int4_all, with and without async scheduling
  argmax     the greedy sampler's argmax over 128256 logits: torch's against two stages
  admission  2k-token sequences the engine's pool sizing admits at one memory budget, FP8 vs bf16

    python bench/quant_h200.py            # writes bench/results/h200_quant.json
    python bench/quant_h200.py --smoke    # tiny shapes; also runs on CPU (Triton interpreter)
"""

# The timing lambdas below close over loop variables on purpose: each is called at once.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "bench")):  # tandem, and llama_random beside this file
    if path not in sys.path:
        sys.path.insert(0, path)

import llama_random as lr  # noqa: E402

from tandem import config  # noqa: E402
from tandem.formats.weight import QuantizedWeight, quantize_rtn  # noqa: E402
from tandem.kernels.w4a16 import (  # noqa: E402
    GemmConfig,
    GemvConfig,
    GemvH2Config,
    GemvNConfig,
    default_config,
    gemv_x_ref,
    n_major,
    w4a16_matmul_triton,
)

L2_BYTES = 60 * 2**20
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
)
GEMV_SWEEP = [
    GemvConfig(block_n=bn, block_w=bw, split_k=sk, num_warps=nw)
    for bn, bw, sk, nw in [
        (4, 256, 1, 4),
        (8, 128, 1, 4),
        (8, 256, 1, 4),
        (16, 64, 1, 4),
        (16, 128, 1, 4),
        (32, 64, 1, 8),
        (8, 128, 2, 4),
    ]
]
# The N-major INT4 GEMV (`_gemv_nmajor_kernel`): tile widths, groups per step, warps, K splits.
GEMVN_SWEEP = [
    GemvNConfig(block_n=bn, split_k=sk, num_warps=nw, num_stages=1)
    for bn, nw in ((32, 1), (64, 1), (64, 2), (128, 1), (128, 2), (128, 4), (256, 2))
    for sk in (1, 2, 4, 8, 16, 32)
]
# The packed-fp16 INT4 GEMV (`_gemv_h2_kernel`, the M = 1 default): the same dimensions.
GEMVH2_SWEEP = [
    GemvH2Config(block_n=bn, split_k=sk, num_warps=nw)
    for bn, nw in ((32, 1), (64, 1), (128, 1), (128, 2), (256, 2))
    for sk in (2, 4, 8, 16, 32)
]
GEMM_SWEEP = {
    8: [GemmConfig(16, 64, 128, 2, 4, 3), GemmConfig(16, 32, 128, 1, 4, 4),
        GemmConfig(16, 64, 256, 4, 4, 3)],
    32: [GemmConfig(32, 64, 128, 2, 4, 3), GemmConfig(32, 128, 64, 1, 4, 4),
         GemmConfig(32, 64, 256, 4, 4, 3)],
    128: [GemmConfig(64, 128, 64, 1, 8, 3), GemmConfig(128, 128, 64, 1, 8, 3),
          GemmConfig(64, 128, 128, 1, 8, 4)],
}  # fmt: skip


def timed(fn: Callable[[int], object], copies: int, reps: int = 20) -> float:
    """Seconds per call of fn(i) (i cycling over the weight copies), GPU time."""
    if torch.cuda.is_available():

        def calls() -> None:
            for i in range(copies):
                fn(i)

        g = lr.captured(calls)
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / copies)
        del g
        times.sort()
        return times[len(times) // 2]
    t0 = time.perf_counter()
    for i in range(copies):
        fn(i)
    return (time.perf_counter() - t0) / copies


def copy_bandwidth(dev: str, smoke: bool) -> dict:
    n = (1 << 20) if smoke else (4 << 30)  # bytes
    if dev == "cuda" and not smoke:
        # The same measurement as every other H200 benchmark (bench/llama_random.py).
        bw = lr.copy_bandwidth(n)
        return {"bytes": n, "seconds": 2 * n / bw, "bytes_per_s": bw,
                "counts": "bytes read + written"}  # fmt: skip
    src = torch.randn(n // 4, device=dev)
    dst = torch.empty_like(src)
    t = timed(lambda i: dst.copy_(src), 1, reps=10 if not smoke else 2)
    return {"bytes": n, "seconds": t, "bytes_per_s": 2 * n / t, "counts": "bytes read + written"}


def int4pack(w_codes: torch.Tensor, qw: QuantizedWeight):
    """torch's tinygemm layout of the same grid: w = (q - 8) * scale + zero."""
    n, k = qw.shape
    packed_u8 = (w_codes[:, ::2] << 4 | w_codes[:, 1::2]).to(torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
    scale = qw.scales.to(torch.bfloat16)
    zero = (qw.mins.float() + 8 * qw.scales.float()).to(torch.bfloat16)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/G, N, 2]
    return packed, sz


def gemm_section(dev: str, smoke: bool, copy_bw: float, results: dict, save=None) -> None:
    """The issue's two shapes at every M, then the decode model's other INT4 shapes (fused
    q/k/v, o, fused gate/up) at M = 1. Row-major and N-major code storage side by side.
    QUANT_H200_GEMM_SHAPES="NxK ..." keeps only those shapes; QUANT_H200_GEMM_SWEEP=0 skips
    the config sweeps (the defaults, int4pack and cuBLAS only)."""
    if smoke:
        plan = [(256, 512, [1, 8]), (512, 256, [1, 8])]
    else:
        plan = [(14336, 4096, [1, 8, 32, 128]), (4096, 14336, [1, 8, 32, 128]),
                (6144, 4096, [1]), (4096, 4096, [1]), (28672, 4096, [1])]  # fmt: skip
    if os.environ.get("QUANT_H200_GEMM_SHAPES"):
        keep = {
            tuple(int(v) for v in s.split("x"))
            for s in os.environ["QUANT_H200_GEMM_SHAPES"].split()
        }
        plan = [p for p in plan if (p[0], p[1]) in keep]
    for n, k, ms in plan:
        _gemm_shape(dev, smoke, copy_bw, results, save, n, k, ms)


def _gemm_shape(dev, smoke, copy_bw, results, save, n: int, k: int, ms: list[int]) -> None:
    group = 128
    dtype = torch.bfloat16
    out = results.setdefault("gemm", [])
    w_float = torch.randn(n, k, device=dev, dtype=dtype) * 0.02
    qw0 = quantize_rtn(w_float, 4, group)
    q_bytes = qw0.nbytes
    copies = 1 if smoke else max(2, int(8 * L2_BYTES / q_bytes) + 1)
    qws = [qw0] + [
        QuantizedWeight(qw0.qweight.clone(), qw0.scales.clone(), qw0.mins.clone(), 4, group, k)
        for _ in range(copies - 1)
    ]
    qwn = [n_major(q) for q in qws]  # the layout the GPU model stores
    bf_copies = 1 if smoke else max(2, int(8 * L2_BYTES / (n * k * 2)) + 1)
    wbf = [w_float] + [w_float.clone() for _ in range(bf_copies - 1)]
    tiny = None
    tinys = []
    if dev == "cuda":
        try:
            codes = qw0.codes()[:, :k]
            tiny = int4pack(codes, qw0)
            tinys = [tiny] + [(tiny[0].clone(), tiny[1].clone()) for _ in range(copies - 1)]
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            tiny = None
            results.setdefault("errors", []).append(f"int4pack setup {n}x{k}: {e!r}")
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=dtype)
        ref = x.double() @ qw0.dequantize(torch.float64).T
        row = {"N": n, "K": k, "M": m, "group_size": group, "int4_weight_bytes": q_bytes,
               "bf16_weight_bytes": n * k * 2, "copies": copies}  # fmt: skip

        def rec(name: str, t: float, nbytes: int, y: torch.Tensor | None = None, **extra):
            e = {"us": t * 1e6, "weight_GBps": nbytes / t / 1e9,
                 "frac_of_copy_bw": nbytes / t / copy_bw, "TFLOPs": 2 * m * n * k / t / 1e12}  # fmt: skip
            if y is not None:
                e["rel_err_vs_f64"] = ((y.double() - ref).norm() / ref.norm()).item()
            e.update(extra)
            row[name] = e

        for tag, ws in (("", qws), ("_nmajor", qwn)):
            cfg = default_config(m, n, k, torch.device(dev), ws[0], dtype)
            y = w4a16_matmul_triton(x, ws[0], cfg)
            t = timed(lambda i, cfg=cfg, ws=ws: w4a16_matmul_triton(x, ws[i % copies], cfg),
                      copies)  # fmt: skip
            rec(f"tandem_w4a16{tag}_default", t, q_bytes, y, config=repr(cfg))
            if tag and m == 1 and dev == "cuda":  # the same launches without PDL, side by side
                with _kernels(pdl=False):
                    t = timed(lambda i, cfg=cfg, ws=ws: w4a16_matmul_triton(x, ws[i % copies], cfg),
                              copies)  # fmt: skip
                rec(f"tandem_w4a16{tag}_default_no_pdl", t, q_bytes, None, config=repr(cfg))
            if tag and m == 1 and dev == "cuda":
                # As the decode step runs it: x in the GemvX form its producer writes, then also
                # the K split added with float atomics into a float32 row (the decode step's
                # launch config). That row is not re-zeroed while timed: in the decode step its
                # reader zeroes it, and the decode rows include that cost.
                xq = gemv_x_ref(x, group)
                y = w4a16_matmul_triton(x, ws[0], cfg, xq=xq)
                t = timed(lambda i, cfg=cfg, ws=ws: w4a16_matmul_triton(x, ws[i % copies], cfg,
                                                                         xq=xq), copies)  # fmt: skip
                rec("tandem_w4a16_nmajor_gemv_x", t, q_bytes, y, config=repr(cfg))
                ca = default_config(m, n, k, torch.device(dev), ws[0], dtype, True)
                acc_row = torch.zeros(1, n, device=dev, dtype=torch.float32)
                y = w4a16_matmul_triton(x, ws[0], ca, xq=xq, accumulate=acc_row).clone()
                t = timed(lambda i, ws=ws: w4a16_matmul_triton(x, ws[i % copies], ca, xq=xq,
                                                                accumulate=acc_row), copies)  # fmt: skip
                rec("tandem_w4a16_nmajor_decode_atomic", t, q_bytes, y, config=repr(ca),
                    note="GemvX x, float atomics into a float32 row not re-zeroed while timed")  # fmt: skip
            if m == 1:
                sweep = GEMVN_SWEEP + GEMVH2_SWEEP if tag else GEMV_SWEEP
            else:
                sweep = GEMM_SWEEP.get(m, [])
            if smoke:
                sweep = sweep[:2]
            if os.environ.get("QUANT_H200_GEMM_SWEEP") == "0":
                sweep = []
            best = None
            tried = []
            for c in sweep:
                try:
                    tc = timed(
                        lambda i, c=c, ws=ws: w4a16_matmul_triton(x, ws[i % copies], c), copies
                    )
                except Exception as e:  # noqa: BLE001
                    tried.append({"config": repr(c), "error": repr(e)[:200]})
                    continue
                tried.append({"config": repr(c), "us": tc * 1e6})
                if best is None or tc < best[0]:
                    best = (tc, c)
            if best is not None:
                yb = w4a16_matmul_triton(x, ws[0], best[1])
                rec(f"tandem_w4a16{tag}_best", best[0], q_bytes, yb, config=repr(best[1]))
            row[f"sweep{tag}"] = tried
        if tiny is not None:
            try:
                yt = torch.ops.aten._weight_int4pack_mm(x, tiny[0], group, tiny[1])
                t = timed(
                    lambda i: torch.ops.aten._weight_int4pack_mm(
                        x, tinys[i % copies][0], group, tinys[i % copies][1]
                    ),
                    copies,
                )
                rec("torch_int4pack_mm", t, q_bytes, yt)
            except Exception as e:  # noqa: BLE001
                row["torch_int4pack_mm"] = {"error": repr(e)[:300]}
        yb = x @ w_float.T
        t = timed(lambda i: x @ wbf[i % bf_copies].T, bf_copies)
        rec("bf16_cublas", t, n * k * 2, None,
            rel_err_vs_f64_of_bf16_weight=((yb.double() - x.double() @ w_float.double().T).norm()
                                           / (x.double() @ w_float.double().T).norm()).item())  # fmt: skip
        if m == 1 and dev == "cuda" and not smoke:
            # What cuBLAS reaches reading as many bytes as the INT4 weight (a bf16 [N, K'] weight
            # of the same size): the fraction of copy bandwidth one call of this size can get.
            kb = max(64, round(q_bytes / (2 * n) / 64) * 64)
            same = [torch.randn(n, kb, device=dev, dtype=dtype) for _ in range(copies)]
            xs = torch.randn(1, kb, device=dev, dtype=dtype)
            t = timed(lambda i: xs @ same[i % copies].T, copies)
            rec("bf16_cublas_same_bytes", t, n * kb * 2, None, shape=[n, kb])
            del same
        out.append(row)
        if save is not None:
            save()  # partial results survive a time limit
        d = row.get("tandem_w4a16_best", row["tandem_w4a16_default"])
        dn = row.get("tandem_w4a16_nmajor_best", row["tandem_w4a16_nmajor_default"])
        print(
            f"gemm N={n} K={k} M={m}: w4a16 {row['tandem_w4a16_default']['us']:.1f} us "
            f"(best {d['us']:.1f} us, {d['frac_of_copy_bw']:.2f} of copy bw), "
            f"n-major {row['tandem_w4a16_nmajor_default']['us']:.1f} us "
            f"(best {dn['us']:.1f} us {dn['frac_of_copy_bw']:.2f} {dn['config']}), "
            f"int4pack {row.get('torch_int4pack_mm', {}).get('us', float('nan')):.1f} us, "
            f"bf16 {row['bf16_cublas']['us']:.1f} us",
            flush=True,
        )
    qws, qwn, wbf, tinys = [], [], [], []  # free this shape's copies before the next
    if dev == "cuda":
        torch.cuda.empty_cache()


def llama_config(smoke: bool):
    from tandem.model.config import ModelConfig

    shape = dict(LLAMA3_8B)
    if smoke:
        shape.update(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=32)  # fmt: skip
    return ModelConfig(model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
                       max_position_embeddings=8192, tie_word_embeddings=False,
                       eos_token_ids=[1], **shape)  # fmt: skip


def random_weights(cfg, dev: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from tandem.model.synthetic import random_llama_weights

    return random_llama_weights(cfg, dev, dtype, std=0.02)


def model_bytes(model) -> dict:
    def nb(t) -> int:
        return t.nbytes if isinstance(t, QuantizedWeight) else t.numel() * t.element_size()

    linear = sum(
        nb(getattr(lw, f).weight) for lw in model.layers for f in ("qkv", "o", "gate_up", "down")
    )
    other = sum(nb(lw.input_norm.weight) + nb(lw.post_norm.weight) for lw in model.layers)
    other += nb(model.embed.weight) + nb(model.norm.weight)
    head = 0 if model.lm_head.weight is model.embed.weight else nb(model.lm_head.weight)
    return {"linear": linear, "embed_norms": other, "lm_head": head, "total": linear + other + head}


def kernel_profile(step: Callable[[], object], steps: int = 5, layers: int = 0) -> list[dict]:
    """GPU time per decode step by kernel name (eager launches under torch.profiler); with
    `layers`, the M = 1 GEMV's time also by the linear layer it computes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows: dict[str, list] = {}
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        r = rows.setdefault(ev.name[:80], [0.0, 0])
        r[0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        r[1] += 1
    out = [{"kernel": k, "us_per_step": v[0] / steps, "launches_per_step": v[1] / steps}
           for k, v in rows.items()]  # fmt: skip
    out.sort(key=lambda r: -r["us_per_step"])
    if layers:
        # The M = 1 GEMV's launches in step order are q/k/v, o, gate/up, down per layer, then
        # the LM head: the time of each, which the by-name sum above adds together.
        gemv = sorted((ev.time_range.start, ev.device_time_total if hasattr(ev, "device_time_total")
                       else ev.cuda_time_total) for ev in prof.events()
                      if ev.device_type.name == "CUDA" and "_gemv_h2_kernel" in ev.name)  # fmt: skip
        per = 4 * layers + 1
        if gemv and len(gemv) == per * steps:
            names = ["qkv", "o", "gate_up", "down"]
            by = {n: 0.0 for n in names + ["lm_head"]}
            for i, (_, us) in enumerate(gemv):
                j = i % per
                by["lm_head" if j == per - 1 else names[j % 4]] += us / steps
            for r in out:
                if "_gemv_h2_kernel" in r["kernel"]:
                    r["us_per_step_by_layer"] = by  # summed over layers; lm_head once
    return out


def graph_timeline(step: Callable[[], object], replays: int = 3) -> dict:
    """Where a step's time goes when it runs as it is timed: captured in a CUDA graph (with
    PDL, kernels overlap), replayed under torch.profiler. For one replay (the middle), by
    kernel name: launches, summed duration, and the exposed time (how far each kernel moves the
    latest finish of the kernels before it: the exposed times add up to the replay's span)."""
    from torch.profiler import ProfilerActivity, profile

    g = lr.captured(step)
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
            torch.cuda.synchronize()  # replays apart, so they split by time
    del g
    evs = device_events(prof)
    if len(evs) < replays:
        return {"error": f"{len(evs)} kernel events under the profiler (graph kernels not traced?)"}
    per = len(evs) // replays
    one = evs[per * (replays // 2) : per * (replays // 2 + 1)]
    rows, overlap = exposed_by_name(one, one[0][0])
    return {"span_us": one[-1][1] - one[0][0] if one else 0.0, "kernels_per_replay": per,
            "overlap_us": overlap, "by_kernel": rows}  # fmt: skip


def device_events(prof) -> list[tuple[float, float, str]]:
    """A torch.profiler run's device events (kernels, copies) as (start, end, name), by start."""
    return sorted((ev.time_range.start, ev.time_range.end, ev.name[:60]) for ev in prof.events()
                  if ev.device_type.name == "CUDA" and ev.time_range.end > ev.time_range.start)  # fmt: skip


def exposed_by_name(events: list[tuple[float, float, str]], t0: float) -> tuple[list[dict], float]:
    """Device events (start, end, name), sorted by start, from time t0: by name, launches,
    summed duration and exposed time (how far each event moves the latest finish so far: with
    the idle time, the exposed times add up to the span), most exposed first; and the summed
    overlap."""
    by: dict[str, list] = {}
    last_end = t0
    overlap = 0.0
    for start, end, name in events:
        r = by.setdefault(name, [0, 0.0, 0.0])
        r[0] += 1
        r[1] += end - start
        r[2] += max(0.0, end - max(last_end, start))  # the frontier's advance (us)
        overlap += max(0.0, last_end - start)
        last_end = max(last_end, end)
    rows = [{"kernel": k, "launches": v[0], "sum_us": v[1], "exposed_us": v[2]}
            for k, v in by.items()]  # fmt: skip
    rows.sort(key=lambda r: -r["exposed_us"])
    return rows, overlap


def engine_timeline(engine, prompt: list[int], new: int, skip: int = 8) -> dict:
    """Where a decode step's time goes inside the engine's loop: `new` tokens generated under
    torch.profiler; the decode steps after the first `skip`, each from the copy of its inputs
    from pinned memory (a step copies its inputs in, replays its graph, samples, copies the
    token out), but the last; per step, by name (graph kernels, copies, sampling), launches and exposed time
    (`exposed_by_name`), and the idle time: the device waiting with nothing to run."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        lr.run_engine(engine, prompt, new)
    evs = device_events(prof)
    # A graph step's inputs come in one copy from pinned memory; the sampler's small tensors
    # come from pageable memory (counting those too would split each step in two).
    starts = [i for i, (_, _, name) in enumerate(evs) if "HtoD (Pinned" in name]
    steps = list(zip(starts[skip:-1], starts[skip + 1 :], strict=False))
    if not steps:
        return {"error": f"{len(starts)} steps found under the profiler, need > {skip + 1}"}
    by: dict[str, list] = {}
    gaps: dict[str, float] = {}
    periods, idles = [], []
    for a, b in steps:
        rows, _ = exposed_by_name(evs[a:b], evs[a][0])
        period = evs[b][0] - evs[a][0]
        periods.append(period)
        idles.append(period - sum(r["exposed_us"] for r in rows))
        for r in rows:
            acc = by.setdefault(r["kernel"], [0.0, 0.0])
            acc[0] += r["launches"] / len(steps)
            acc[1] += r["exposed_us"] / len(steps)
        # Where the idle time sits: each gap in the frontier, by the events on either side.
        last_end, last_name = evs[a][0], "step start"
        for start, end, name in evs[a : b + 1]:
            if start > last_end:
                key = f"{last_name[:40]} -> {name[:40]}"
                gaps[key] = gaps.get(key, 0.0) + (start - last_end) / len(steps)
            if end > last_end:
                last_end, last_name = end, name
    rows = [{"kernel": k, "launches": v[0], "exposed_us": v[1]} for k, v in by.items()]
    rows.sort(key=lambda r: -r["exposed_us"])
    idle_at = sorted(({"between": k, "us": v} for k, v in gaps.items()), key=lambda r: -r["us"])
    return {"steps": len(steps), "period_us": statistics.median(periods),
            "idle_us": statistics.median(idles), "by_name": rows, "idle_at": idle_at[:12]}  # fmt: skip


def decode_section(dev: str, smoke: bool, results: dict) -> None:
    """Rows: weights (bf16; int4 = every decoder linear INT4 g128, LM head and embedding bf16;
    int4_all = also the LM head INT4 g128 and the embedding INT8 g128) x KV dtype x PDL on/off.
    The PDL rows differ only in the `pdl` kernel setting (same weights, same run)."""
    from tandem.formats.weight import LayerSpec, quantize_weights
    from tandem.kernels import pdl
    from tandem.kv.cache import KVCache
    from tandem.model.layer_names import linear_layer_names
    from tandem.model.llama import AttentionMetadata, LlamaModel

    cfg = llama_config(smoke)
    dtype = torch.bfloat16
    ctx = 64 if smoke else 1024
    bs = 16
    nb = ctx // bs + 1
    out = results.setdefault("decode", {"batch": 1, "context_tokens": ctx, "rows": []})
    weights = random_weights(cfg, dev, dtype)
    models = {"bf16": LlamaModel(cfg, weights, dtype, dev, max_positions=ctx + 8)}
    specs = {n: LayerSpec(4, 128, True) for n in linear_layer_names(cfg.num_layers)}
    models["int4"] = LlamaModel(cfg, quantize_weights(weights, specs), dtype, dev, ctx + 8)
    specs["lm_head"] = LayerSpec(4, 128, True)
    specs["model.embed_tokens"] = LayerSpec(8, 128, True)
    models["int4_all"] = LlamaModel(cfg, quantize_weights(weights, specs), dtype, dev, ctx + 8)
    del weights
    if dev == "cuda":
        torch.cuda.empty_cache()
    mem = {name: model_bytes(m) for name, m in models.items()}
    mem["ratio_linear"] = mem["int4"]["linear"] / mem["bf16"]["linear"]
    mem["ratio_total_int4"] = mem["int4"]["total"] / mem["bf16"]["total"]
    mem["ratio_total_int4_all"] = mem["int4_all"]["total"] / mem["bf16"]["total"]
    results["memory"] = mem
    print(f"weights vs bf16: linear {mem['ratio_linear']:.3f}, int4 total "
          f"{mem['ratio_total_int4']:.3f}, int4_all total {mem['ratio_total_int4_all']:.3f}")  # fmt: skip

    meta = AttentionMetadata(
        slot_mapping=torch.tensor([ctx - 1], device=dev),
        block_tables=torch.arange(nb, device=dev)[None],
        context_lens=torch.tensor([ctx], device=dev),
        context_lens_list=[ctx],
        query_start_loc=[0, 1],
        decode_only=True,
    )
    ids = torch.tensor([7], device=dev)
    pos = torch.tensor([ctx - 1], device=dev)
    pdl_modes = (True, False) if dev == "cuda" and pdl.HAVE_PDL else (False,)
    for name, model in models.items():
        for kvd in (dtype, torch.float8_e4m3fn):
            kv = KVCache.allocate(cfg.num_layers, nb, bs, cfg.num_kv_heads, cfg.head_dim, kvd, dev)
            kv.data.view(torch.uint8).random_(0, 64)  # finite codes (fp8 bit patterns < 0x40)
            if kv.scales is not None:
                kv.scales.fill_(0.01)

            def step(i=0, model=model, kv=kv):
                return model.logits(model.forward(ids, pos, kv, meta))

            for use in pdl_modes:
                kernels = _kernels(pdl=use)
                kernels.__enter__()
                try:
                    with torch.inference_mode():
                        t = timed(step, 1, reps=5 if smoke else 30)
                    row = {"weights": name, "kv_dtype": str(kvd).removeprefix("torch."),
                           "pdl": use, "step_ms": t * 1e3, "tokens_per_s": 1 / t}  # fmt: skip
                    if dev == "cuda" and kvd == dtype and not smoke:
                        with torch.inference_mode():
                            row["kernels"] = kernel_profile(step)[:14]
                except Exception as e:  # noqa: BLE001
                    row = {
                        "weights": name,
                        "kv_dtype": str(kvd),
                        "pdl": use,
                        "error": repr(e)[:400],
                    }
                    traceback.print_exc()
                kernels.__exit__(None, None, None)
                out["rows"].append(row)
                print(f"decode { ({k: v for k, v in row.items() if k != 'kernels'}) }", flush=True)
            del kv
    tps = {(r["weights"], r["kv_dtype"], r["pdl"]): r.get("tokens_per_s") for r in out["rows"]}
    speedups = {}
    for use in pdl_modes:
        base = tps.get(("bf16", "bfloat16", use))
        for name in ("int4", "int4_all"):
            for kvd in ("bfloat16", "float8_e4m3fn"):
                got = tps.get((name, kvd, use))
                if base and got:
                    speedups[f"{name}/{kvd}/pdl={use}"] = got / base
    out["speedup_vs_bf16_same_pdl"] = speedups
    print(f"speedups vs bf16 (bf16 KV, same PDL setting): {speedups}")

    # Batch 1, bf16 KV, PDL, one row after another, same weights. "default": as the engine runs
    # (INT4: the M = 1 packed-fp16 GEMV reading x as RMSNorm and silu*up wrote it (GemvX), the
    # attention's partitions merged by a kernel of their own; bf16: by the last partition; both:
    # the attention's L2 prefetch before its PDL wait). "deterministic": the GEMVs' K split
    # summed by the arrival counter, not added into float32 rows (TANDEM_DETERMINISTIC=1).
    # QUANT_H200_M1_ROWS="weights/mode weights/mode ..." runs only those rows (quick comparisons);
    # QUANT_H200_MODES='{"name": {"VAR": "value"}}' adds modes of environment settings;
    # QUANT_H200_TIMELINE="weights/mode ..." adds those rows' `graph_timeline`.
    kv = KVCache.allocate(cfg.num_layers, nb, bs, cfg.num_kv_heads, cfg.head_dim, dtype, dev)
    kv.data.view(torch.uint8).random_(0, 64)
    grows = results.setdefault("decode_m1_gemv", {"batch": 1, "context_tokens": ctx, "rows": []})
    modes = {"default": {}, "deterministic": {"TANDEM_DETERMINISTIC": "1"}}
    order = [("bf16", "default"), ("int4_all", "default"), ("int4_all", "deterministic"),
             ("int4", "default")]  # fmt: skip
    modes.update(json.loads(os.environ.get("QUANT_H200_MODES", "{}")))  # {name: {VAR: value}}
    if os.environ.get("QUANT_H200_M1_ROWS"):
        order = [tuple(r.split("/", 1)) for r in os.environ["QUANT_H200_M1_ROWS"].split()]
    # Rows of one pass differ by up to ~5 % more than their kernels do (H200), so the rows
    # run QUANT_H200_REPEAT passes (3 unless --smoke), every other one in reverse order; each row
    # reports every pass's time, their median (step_ms) and the kernel profile of its first.
    repeat = max(1, int(os.environ.get("QUANT_H200_REPEAT", "1" if smoke else "3")))
    grows["passes"] = repeat
    by_key: dict[tuple[str, str], dict] = {}
    for rep in range(repeat):
        for name, mode in order if rep % 2 == 0 else order[::-1]:
            model = models[name]
            os.environ.update(modes[mode])
            config.set_kernel_config(None)  # rebuilt from the environment
            row = by_key.setdefault((name, mode), {"weights": name, "gemv": mode, "pass_ms": []})
            try:
                with torch.inference_mode():
                    t = timed(lambda i, model=model, kv=kv: model.logits(model.forward(ids, pos, kv, meta)),
                              1, reps=5 if smoke else 30)  # fmt: skip
                row["pass_ms"].append(t * 1e3)
                row["step_ms"] = statistics.median(row["pass_ms"])
                row["tokens_per_s"] = 1e3 / row["step_ms"]
                if (
                    dev == "cuda"
                    and f"{name}/{mode}" in os.environ.get("QUANT_H200_TIMELINE", "").split()
                    and "graph_timeline" not in row
                ):
                    with torch.inference_mode():
                        row["graph_timeline"] = graph_timeline(
                            lambda model=model, kv=kv: model.logits(model.forward(ids, pos, kv, meta))
                        )  # fmt: skip
                profile = dev == "cuda" and not smoke and name == "int4_all"
                if profile and "kernels" not in row:
                    with torch.inference_mode():
                        row["kernels"] = kernel_profile(lambda i=0, model=model, kv=kv: model.logits(
                            model.forward(ids, pos, kv, meta)), layers=cfg.num_layers)[:8]  # fmt: skip
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:400]
                traceback.print_exc()
            for key in modes[mode]:
                os.environ.pop(key, None)
            config.set_kernel_config(None)
            print(f"decode batch 1 pass {rep} {name} {mode}: {row['pass_ms'][-1:]} ms", flush=True)
    grows["rows"] = [by_key[k] for k in order]
    for row in grows["rows"]:
        print(f"decode batch 1 { ({k: v for k, v in row.items() if k != 'kernels'}) }", flush=True)
    base = next((r.get("tokens_per_s") for r in grows["rows"]
                 if r["weights"] == "bf16" and r["gemv"] == "default"), None)  # fmt: skip
    if base:
        grows["speedup_vs_bf16"] = {f"{r['weights']}/{r['gemv']}": r["tokens_per_s"] / base
                                    for r in grows["rows"] if "tokens_per_s" in r}  # fmt: skip
        print(f"batch-1 speedups vs bf16: {grows['speedup_vs_bf16']}", flush=True)
    del kv

    # Batched decode: 8 sequences of `ctx` cached tokens, one step, bf16 KV, PDL as default (the
    # INT4 GEMVs on the tensor cores: 2 <= M <= 32).
    batch = 8
    bmeta = AttentionMetadata(
        slot_mapping=torch.arange(batch, device=dev) * nb * bs + ctx - 1,
        block_tables=torch.arange(batch * nb, device=dev).view(batch, nb),
        context_lens=torch.full((batch,), ctx, device=dev),
        context_lens_list=[ctx] * batch,
        query_start_loc=list(range(batch + 1)),
        decode_only=True,
    )
    bids = torch.arange(batch, device=dev) + 7
    bpos = torch.full((batch,), ctx - 1, device=dev)
    kv = KVCache.allocate(
        cfg.num_layers, batch * nb, bs, cfg.num_kv_heads, cfg.head_dim, dtype, dev
    )
    kv.data.view(torch.uint8).random_(0, 64)
    brows = results.setdefault("decode_batch", {"batch": batch, "context_tokens": ctx, "rows": []})
    for name in ("bf16", "int4_all"):
        model = models[name]
        try:
            with torch.inference_mode():
                t = timed(lambda i, model=model, kv=kv: model.logits(model.forward(bids, bpos, kv, bmeta)),
                          1, reps=5 if smoke else 30)  # fmt: skip
            row = {"weights": name, "step_ms": t * 1e3, "tokens_per_s": batch / t}
        except Exception as e:  # noqa: BLE001
            row = {"weights": name, "error": repr(e)[:400]}
            traceback.print_exc()
        brows["rows"].append(row)
        print(f"decode batch {batch} {row}", flush=True)
    del kv


def e2e_section(dev: str, smoke: bool, results: dict) -> None:
    """End-to-end single-stream decode through the engine (`LLMEngine.step`: the scheduler, the
    captured decode graph, greedy sampling, the token back on the host), bf16 weights against
    int4_all on the same random weights: one sequence, a `prompt`-token prompt, `new` tokens.
    With async scheduling (step t + 1 launched before step t's token is read, as gpt-fast's
    generate loop runs, so the graph launch overlaps the step before) and without (each step's
    token read before the next is launched). Passes alternate in order; each row reports every
    pass's decode tokens/s (first token to last) and their median.

    QUANT_H200_E2E_MODES="weights/mode ..." adds engines run with environment settings (async
    scheduling only; set while the engine is built, captured and run): QUANT_H200_MODES's, as
    for the decode rows."""

    from tandem.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.formats.weight import LayerSpec, quantize_weights
    from tandem.model.layer_names import linear_layer_names
    from tandem.model.loader import LoadedModel

    modes = {"default": {}, "deterministic": {"TANDEM_DETERMINISTIC": "1"}}
    modes.update(json.loads(os.environ.get("QUANT_H200_MODES", "{}")))  # as the decode rows'
    extra = [tuple(r.split("/", 1)) for r in os.environ.get("QUANT_H200_E2E_MODES", "").split()]
    cfg = llama_config(smoke)
    cuda = dev == "cuda"
    prompt_len, new = (32, 16) if smoke else (1024, 256)
    weights = random_weights(cfg, dev, torch.bfloat16 if cuda else torch.float32)
    specs = {n: LayerSpec(4, 128, True) for n in linear_layer_names(cfg.num_layers)}
    specs["lm_head"] = LayerSpec(4, 128, True)
    specs["model.embed_tokens"] = LayerSpec(8, 128, True)
    options = dict(device=dev, dtype="bfloat16" if cuda else "float32",
                   max_model_len=prompt_len + new + 16, kv_cache_memory_gb=2.0 if cuda else 0.05,
                   max_num_seqs=1, cuda_graphs=True)  # fmt: skip
    keys = [("bf16", "default"), ("int4_all", "default"), *extra]
    quantized = quantize_weights(weights, specs) if any(n != "bf16" for n, _ in keys) else None
    engines = {}
    for name, mode in keys:
        w = weights if name == "bf16" else quantized
        loaded = LoadedModel(cfg, w, lr._NoTokenizer(), "random-llama")
        with _env(modes[mode]):
            engine = LLMEngine(loaded, EngineConfig.from_options(**options))
        engines[(name, mode)] = engine
    del weights, quantized, w, loaded
    prompt = lr.random_prompts(1, prompt_len, cfg.vocab_size)
    out = results.setdefault("e2e", {"batch": 1, "prompt_tokens": prompt_len, "new_tokens": new,
                                     "options": options, "modes": modes, "rows": []})  # fmt: skip
    order = [(k, a) for a in (True, False) for k in keys if a or k[1] == "default"]
    repeat = max(1, int(os.environ.get("QUANT_H200_REPEAT", "1" if smoke else "3")))
    out["passes"] = repeat
    by_key: dict[tuple, dict] = {}
    for key, engine in engines.items():
        with _env(modes[key[1]]):
            lr.run_engine(engine, prompt, 8)  # warm-up: compiles the kernels, captures the graph
    for rep in range(repeat):
        for (name, mode), use in order if rep % 2 == 0 else order[::-1]:
            engine = engines[(name, mode)]
            engine.config.async_scheduling = use
            with _env(modes[mode]):
                run = lr.run_engine(engine, prompt, new)
            row = by_key.setdefault((name, mode, use), {"weights": name, "mode": mode,
                                    "async_scheduling": use, "pass_tokens_per_s": []})  # fmt: skip
            row["pass_tokens_per_s"].append(run.decode_tokens / run.decode_s)
            row["decode_tokens_per_s"] = statistics.median(row["pass_tokens_per_s"])
            row["ms_per_token"] = 1e3 / row["decode_tokens_per_s"]
            print(f"e2e pass {rep} {name}/{mode} async={use}: "
                  f"{row['pass_tokens_per_s'][-1]:.1f} tok/s", flush=True)  # fmt: skip
    out["rows"] = [by_key[(*k, a)] for k, a in order]
    tps = {(r["weights"], r["mode"], r["async_scheduling"]): r["decode_tokens_per_s"]
           for r in out["rows"]}  # fmt: skip
    out["speedup_vs_bf16"] = {
        f"{name}/{mode}/async={use}": t / tps[("bf16", "default", use)]
        for (name, mode, use), t in tps.items()
        if name != "bf16" or mode != "default"
    }
    for row in out["rows"]:
        print(f"e2e {row}", flush=True)
    print(f"e2e speedups (vs bf16/default): {out['speedup_vs_bf16']}", flush=True)
    if cuda and not smoke:  # async scheduling: where a step's time goes in the loop
        for (name, mode), engine in engines.items():
            if mode != "default":
                continue
            engine.config.async_scheduling = True
            try:
                tl = engine_timeline(engine, prompt, 40)
            except Exception as e:  # noqa: BLE001 - keep the rows measured above
                traceback.print_exc()
                tl = {"error": repr(e)[:400]}
            by_key[(name, mode, True)]["timeline"] = tl
            print(f"e2e timeline {name}: period {tl.get('period_us', 0):.1f} us, idle "
                  f"{tl.get('idle_us', 0):.1f} us {tl.get('error', '')}", flush=True)  # fmt: skip
            for r in tl.get("by_name", [])[:16]:
                print(f"    {r['kernel'][:50]:<50} {r['launches']:6.1f} {r['exposed_us']:8.1f}")
            for r in tl.get("idle_at", [])[:8]:
                print(f"    idle {r['between'][:84]:<84} {r['us']:6.2f}")
    del engines
    if cuda:
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _env(settings: dict[str, str]):
    """The process environment with `settings` added (the kernel settings rebuilt from it),
    restored after."""
    old = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    config.set_kernel_config(None)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        config.set_kernel_config(None)


@contextlib.contextmanager
def _kernels(**changes):
    """The kernel settings with `changes`, restored after."""
    old = config.set_kernel_config(replace(config.kernel_config(), **changes))
    try:
        yield
    finally:
        config.set_kernel_config(old)


def argmax_two_stage(x: torch.Tensor, cols: int) -> torch.Tensor:
    """argmax over the last dim of x [B, V] (V a multiple of cols) in two stages: the max of each
    run of `cols` logits (many programs), then the argmax of those maxima. Equal to
    torch.argmax, first maximum included: both stages return the first of equal values."""
    b, v = x.shape
    vals, idx = x.view(b, v // cols, cols).max(dim=2)
    j = vals.argmax(dim=1)
    return j * cols + idx.gather(1, j[:, None]).squeeze(1)


def argmax_section(dev: str, smoke: bool, results: dict) -> None:
    """The greedy sampler's argmax over one row of Llama-3's 128256 logits (float32), as the
    engine runs it outside the step's graph: torch.argmax against `argmax_two_stage` at a few
    run lengths and the sampler's one-launch Triton argmax at a few block sizes (the engine
    timeline puts torch's at ~28 us a token). Each timed as 20
    calls in one graph, us per call; every variant checked equal to torch.argmax first."""
    v = 512 if smoke else LLAMA3_8B["vocab_size"]
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, v, device=dev, generator=g)
    x[0, v // 3] = x[0, 2 * v // 3] = x.max() + 1  # a tie: the first one is the answer
    want = torch.argmax(x, dim=-1)
    rows = []
    variants = {"torch.argmax": lambda i: torch.argmax(x, dim=-1)}
    for cols in (128, 256, 384, 768):
        if v % cols == 0:
            variants[f"two_stage/{cols}"] = lambda i, c=cols: argmax_two_stage(x, c)
    if dev == "cuda":
        from tandem.kernels.argmax import argmax_triton

        for block in (1024, 2048, 4096, 8192):  # the sampler's: 2048
            variants[f"triton/{block}"] = lambda i, b=block: argmax_triton(x, b)
    for name, fn in variants.items():
        if not torch.equal(fn(0), want):
            raise AssertionError(f"{name} disagrees with torch.argmax")
        t = timed(fn, 20, reps=5 if smoke else 30)
        rows.append({"variant": name, "us": t * 1e6})
        print(f"argmax {name}: {t * 1e6:.2f} us", flush=True)
    results["argmax"] = {"vocab": v, "rows": rows}


def admission_section(smoke: bool, results: dict) -> None:
    from tandem.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.model.loader import LoadedModel

    cfg = llama_config(smoke)
    loaded = LoadedModel(cfg, {}, None, "random")  # pool_layout reads only the config
    seq_tokens = 2048
    budget_gb = 40.0
    rows = {}
    for kvd in ("auto", "fp8", "int8"):
        ec = EngineConfig(
            dtype="bfloat16", device="cpu", kv_dtype=kvd, kv_cache_memory_gb=budget_gb
        )
        lay = LLMEngine.pool_layout(loaded, ec)
        per_seq = -(-(seq_tokens + 1) // lay.block_size)
        rows[kvd] = {"dtype": lay.dtype, "num_blocks": lay.num_blocks, "block_bytes": lay.block_bytes,
                     "sequences_of_2k": lay.num_blocks // per_seq}  # fmt: skip
    results["admission"] = {
        "kv_cache_memory_gb": budget_gb,
        "sequence_tokens": seq_tokens,
        "pools": rows,
        "ratio_fp8_vs_bf16": rows["fp8"]["sequences_of_2k"] / rows["auto"]["sequences_of_2k"],
        "ratio_int8_vs_bf16": rows["int8"]["sequences_of_2k"] / rows["auto"]["sequences_of_2k"],
    }
    print(f"admission {results['admission']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU or GPU)")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "h200_quant.json"))
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    skip = set(filter(None, args.skip.split(",")))
    results: dict = {
        "benchmark": "quant_h200",
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        # The settings the command ran with (its rows and modes, and any TANDEM_* switches).
        "env": {k: v for k, v in os.environ.items() if k.startswith(("QUANT_H200_", "TANDEM_"))},
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "smoke": args.smoke,
    }
    t0 = time.monotonic()

    def save() -> None:
        results["seconds"] = round(time.monotonic() - t0, 1)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)

    sections = [
        ("copy", lambda: results.__setitem__("copy", copy_bandwidth(dev, args.smoke))),
        ("admission", lambda: admission_section(args.smoke, results)),
        ("decode", lambda: decode_section(dev, args.smoke, results)),
        ("e2e", lambda: e2e_section(dev, args.smoke, results)),
        ("argmax", lambda: argmax_section(dev, args.smoke, results)),
        (
            "gemm",
            lambda: gemm_section(dev, args.smoke, results["copy"]["bytes_per_s"], results, save),
        ),
    ]
    for name, fn in sections:
        if name in skip:
            continue
        try:
            s = time.monotonic()
            fn()
            print(f"[{name} done in {time.monotonic() - s:.1f}s]", flush=True)
        except Exception as e:  # noqa: BLE001 - keep what the other sections measured
            traceback.print_exc()
            results.setdefault("errors", []).append(f"{name}: {e!r}"[:500])
        save()
    if "copy" in results:
        print(f"copy bandwidth {results['copy']['bytes_per_s'] / 1e12:.2f} TB/s")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
