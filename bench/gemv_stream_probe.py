"""INT4 GEMV (M = 1, N-major codes): the FFMA kernel's code tiles streamed by a software-pipelined
loop instead of the register prefetch of `tandem.kernels.w4a16._gemv_nmajor_kernel`.

Two variants of the same FFMA arithmetic, each with `tl.range(..., num_stages=STAGES)`:
- `tma`: the [16 words, BLOCK_N] code tile of a group comes through a TMA tensor descriptor.
- `ptr`: the same tile through pointer loads (Triton turns them into cp.async copies).
and `old`, the library kernel, in the same process. Each spec is KIND:block_n,split_k,stages,warps
(stages unused for `old`). Median of 20 CUDA-graph replays of 16 calls over 16 weight copies.
Measured slower than the library kernel on every shape on the H200; kept so the
comparison can be re-run.

    python bench/gemv_stream_probe.py 14336 4096 old:64,8,1,1 tma:64,4,3,1 ptr:64,4,3,1
"""

import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from tandem.kernels import pdl  # noqa: E402
from tandem.kernels import w4a16 as wk  # noqa: E402
from tandem.kernels.w4a16._common import _code_hi, _code_lo, _finish_row, _split_launch  # noqa: E402
from tandem.quant.format import QuantizedWeight, quantize_rtn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemv_probe import COPIES, timed  # noqa: E402


@triton.jit
def stream_kernel(
    x_ptr,
    q_src,  # a TMA descriptor of the [KW, N] codes (DESC), else their pointer
    stride_qw,
    s_ptr,
    mn_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    G,
    groups_per_split,
    SPLIT,
    stride_xm,
    stride_sg,
    stride_om,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_P2: tl.constexpr,
    ASM: tl.constexpr,
    PDL: tl.constexpr,
    STAGES: tl.constexpr,
    DESC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    WPG: tl.constexpr = GROUP // 8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, WPG)
    offs_k = tl.arange(0, GROUP)
    k_offset = tl.where(offs_k % 2 == 0, 256.0, 16.0)
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    g_start = pid_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, G)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    for g in tl.range(g_start, g_end, num_stages=STAGES):
        if DESC:
            q = q_src.load([g * WPG, pid_n * BLOCK_N])
        else:  # pointer loads (Triton pipelines them as cp.async copies)
            q = tl.load(
                q_src + (g * WPG + offs_w)[:, None].to(tl.int64) * stride_qw + offs_n[None, :],
                mask=n_mask[None, :],
                other=0,
            )
        wi = g * WPG + offs_w
        s_off = g * stride_sg + offs_n
        s = tl.load(s_ptr + s_off).to(tl.float32)
        mn = tl.load(mn_ptr + s_off).to(tl.float32)
        xg = tl.load(x_row + g * GROUP + offs_k).to(tl.float32)
        x_sum = tl.sum(xg, axis=0)
        xp_sum = tl.sum(xg * k_offset, axis=0)
        for j in tl.static_range(0, 8, 2):
            xp = tl.load((x_row + wi * 8 + j).to(tl.pointer_type(tl.int32)))
            xa = (xp << 16).to(tl.float32, bitcast=True)
            xb = (xp & -65536).to(tl.float32, bitcast=True)
            if j == 0:
                t = q << 15
            elif j == 2:
                t = q << 7
            elif j == 4:
                t = q >> 1
            else:
                t = q >> 9
            if j == 0:
                part = _code_lo(t, ASM) * xa[:, None]
            else:
                part += _code_lo(t, ASM) * xa[:, None]
            part += _code_hi(t, ASM) * xb[:, None]
        acc += s * (tl.sum(part, axis=0) - xp_sum) + mn * x_sum
    # The library's split-K epilogue (partials, arrival counter, the last program adds them).
    _finish_row(acc, out_ptr + m.to(tl.int64) * stride_om + offs_n, ws_ptr, cnt_ptr, pid_n,
                pid_k, m, M, N, offs_n, n_mask, SPLIT, True, SPLIT_P2, False)  # fmt: skip


def launch(kind, x, w, bn, split, stages, warps=1, desc=None):
    m, k = x.shape
    n = w.out_features
    sl = _split_launch(x, w, bn, split, m, "stream_kernel")
    if sl.split < 2:
        raise ValueError("stream_kernel always adds split-K partials: give split_k >= 2")
    stream_kernel[(sl.blocks, sl.split, m)](
        x,
        desc if kind == "tma" else w.qweight,
        w.qweight.stride(1),
        w.scales,
        w.mins,
        sl.out,
        sl.ws,
        sl.counters,
        m,
        n,
        k,
        sl.groups,
        sl.per_split,
        sl.split,
        x.stride(0),
        w.scales.stride(1),
        sl.out.stride(0),
        GROUP=w.group_size,
        BLOCK_N=bn,
        SPLIT_P2=triton.next_power_of_2(sl.split),
        ASM=True,
        STAGES=stages,
        DESC=kind == "tma",
        num_warps=warps,
        **pdl.launch_options(x),
    )
    return sl.out


def main():
    n, k = int(sys.argv[1]), int(sys.argv[2])
    specs = sys.argv[3:]
    w = wk.n_major(quantize_rtn(torch.randn(n, k, device="cuda") * 0.02, 4, 128))
    ws = [w] + [
        wk.n_major(QuantizedWeight(w.qweight.clone(), w.scales.clone(), w.mins.clone(), 4, 128, k))
        for _ in range(COPIES - 1)
    ]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ w.dequantize(torch.float64).T
    for spec in specs:
        kind, rest = spec.split(":")
        bn, split, stages, warps = (int(v) for v in rest.split(","))
        try:
            if kind == "old":
                cfg = wk.GemvNConfig(bn, split, warps, 1)
                f = lambda i, cfg=cfg: wk.launch_gemv_nmajor(x, ws[i], cfg)[0]
            else:
                descs = [
                    TensorDescriptor.from_tensor(q.qweight.t(), [16, bn]) if kind == "tma" else None
                    for q in ws
                ]
                f = (
                    lambda i, kind=kind, bn=bn, split=split, stages=stages, warps=warps, descs=descs: (
                        launch(kind, x, ws[i], bn, split, stages, warps, descs[i])
                    )
                )
            y = f(0)
            torch.cuda.synchronize()
            err = ((y.double() - ref).norm() / ref.norm()).item()
            us = timed(f)
            print(
                json.dumps(
                    {
                        "N": n,
                        "K": k,
                        "variant": spec,
                        "us": us,
                        "GBps": w.nbytes / us / 1e3,
                        "rel_err": err,
                    }
                ),
                flush=True,
            )
        except Exception as e:
            print(json.dumps({"N": n, "K": k, "variant": spec, "error": repr(e)[:400]}), flush=True)


if __name__ == "__main__":
    main()
