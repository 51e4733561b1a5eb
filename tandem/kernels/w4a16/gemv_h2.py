"""The one-row INT4 GEMV in packed fp16 arithmetic (`_gemv_h2_kernel`): the default for M = 1
with bf16 x and N-major codes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.formats.weight import QuantizedWeight
from tandem.kernels import pdl
from tandem.kernels._triton import tl, triton
from tandem.kernels.w4a16._common import (
    _code_words,
    _compiled_cuda,
    _finish_row,
    _group_words,
    _row_program,
    _scales_of_group,
    _split_launch,
)
from tandem.kernels.w4a16.gemv_x import GemvX, _x_scale


@triton.jit
def _h2_codes_fma(q, xp, acc, HI: tl.constexpr, FIRST: tl.constexpr):
    """acc + codes * xp in f16x2 (ASM only). The codes of q under the mask 0x000F000F (HI:
    0x00F000F0), left in place, are two fp16 subnormals, c * 2**-24 (HI: 16 c * 2**-24), exact;
    xp holds the matching x pair, scaled. FIRST: no accumulator yet (a multiply)."""
    if FIRST:
        if HI:
            return tl.inline_asm_elementwise(
                "{.reg .b32 t; and.b32 t, $1, 0x00F000F0; mul.rn.f16x2 $0, t, $2;}",
                "=r,r,r",
                [q, xp],
                dtype=tl.int32,
                is_pure=True,
                pack=1,
            )
        return tl.inline_asm_elementwise(
            "{.reg .b32 t; and.b32 t, $1, 0x000F000F; mul.rn.f16x2 $0, t, $2;}",
            "=r,r,r",
            [q, xp],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    if HI:
        return tl.inline_asm_elementwise(
            "{.reg .b32 t; and.b32 t, $1, 0x00F000F0; fma.rn.f16x2 $0, t, $2, $3;}",
            "=r,r,r,r",
            [q, xp, acc],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    return tl.inline_asm_elementwise(
        "{.reg .b32 t; and.b32 t, $1, 0x000F000F; fma.rn.f16x2 $0, t, $2, $3;}",
        "=r,r,r,r",
        [q, xp, acc],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _x_pairs(xa, xb, sc2):
    """xa = bf16 pair (x_j, x_j+1), xb = (x_j+4, x_j+5) -> f16x2 (x_j sc, x_j+4 sc) and
    (x_j+1 sc16, x_j+5 sc16) (ASM only). sc2 holds the powers of two as a bf16 pair (sc low,
    sc16 high): one bf16x2 multiply scales both halves exactly, then each half is widened to
    float32 by a shift or mask and two halves narrow to fp16 together."""
    return tl.inline_asm_elementwise(
        "{.reg .b32 ta, tb, a, b, c, d; mul.rn.bf16x2 ta, $2, $4; mul.rn.bf16x2 tb, $3, $4; "
        "shl.b32 a, ta, 16; shl.b32 b, tb, 16; and.b32 c, ta, 0xFFFF0000; "
        "and.b32 d, tb, 0xFFFF0000; cvt.rn.f16x2.f32 $0, b, a; cvt.rn.f16x2.f32 $1, d, c;}",
        "=r,=r,r,r,r",
        [xa, xb, sc2],
        dtype=(tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _pair_halves(a, b):
    """(low halves of a and b, high halves of a and b) as two 32-bit pairs (ASM only)."""
    return tl.inline_asm_elementwise(
        "prmt.b32 $0, $2, $3, 0x5410; prmt.b32 $1, $2, $3, 0x7632;",
        "=r,=r,r,r",
        [a, b],
        dtype=(tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _hadd2(a, b):
    return tl.inline_asm_elementwise(
        "add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _h2_total(t):
    """The two fp16 halves of t, added, as float32 (ASM only)."""
    return tl.inline_asm_elementwise(
        "{.reg .f16 l, h; mov.b32 {l, h}, $1; add.rn.f16 l, l, h; cvt.f32.f16 $0, l;}",
        "=f,r",
        [t],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _round_f16(v):
    return v.to(tl.float16).to(tl.float32)


@triton.jit
def _gemv_h2_kernel(
    x_ptr,  # [M, K] activations (bf16 when ASM)
    qw_ptr,  # packed codes, N-major (word w of row n at qw_ptr + w * stride_qw + n)
    s_ptr,  # fp16 scales, group g of row n at s_ptr + g * stride_sg + n
    mn_ptr,  # fp16 zero points (value of code 0), same layout
    out_ptr,  # [M, N]
    ws_ptr,  # float32 [SPLIT, M, N] partial sums (REDUCE)
    cnt_ptr,  # int32 arrival counters, zero between calls (REDUCE)
    M,
    N,
    K,  # == G * GROUP (whole groups: x is read without masks)
    G,
    groups_per_split,
    SPLIT,
    stride_xm,
    stride_qw,
    stride_sg,
    stride_om,
    xs_ptr,  # XPREP: float32 [M, G, 2] per group: 2**24 / scale, sum of x
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    REDUCE: tl.constexpr,
    SPLIT_P2: tl.constexpr,
    EVEN: tl.constexpr,  # N a multiple of BLOCK_N: no masks
    ASM: tl.constexpr,  # compiled CUDA: packed fp16 arithmetic; the interpreter emulates it
    PDL: tl.constexpr,
    XPREP: tl.constexpr,  # x_ptr holds `GemvX.scaled` (x scaled by its producer)
    ADDR: tl.constexpr = False,  # code-word addresses from a 64-bit base per group (_group_words)
    AHEAD: tl.constexpr = False,  # scales, zero points (and GemvX's scalars) loaded a group ahead
    ATOMIC: tl.constexpr = False,  # out_ptr: a zeroed float32 row each program adds into
    ROUND: tl.constexpr = None,  # a float32 output holding sums rounded to this dtype (not ATOMIC)
):
    """INT4 GEMV over N-major codes in packed fp16 arithmetic: two codes per instruction.

    An INT4 code left in place under a mask is an fp16 subnormal: bits 0..3 of a half are
    c * 2**-24 and bits 4..7 are 16 c * 2**-24, both exact. So a word's codes pair up without a
    shift or an offset: q & 0x000F000F holds codes 0 and 4, q & 0x00F000F0 codes 1 and 5 (times
    16), (q >> 8) the same for 2, 6 and 3, 7; one `fma.rn.f16x2` multiplies a pair by x and
    adds it in: ~1.1 instructions per code (a shift per word, an AND and an FMA per two codes)
    against the FFMA kernel's ~3.9.

    Precision: per group, x is scaled by a power of two so that its largest |x| lies in
    [2**14, 2**15) (the pairs for the x16 codes by a sixteenth of it); bf16 x is exact in fp16
    there. A product c x 2**-24 is then at most 2**-5, exact to fp16's 11 bits down to 2**-14
    and within 2**-25 below, far under the group's largest term; four products per half and the
    tree over the group's words are added in fp16 (relative 2**-12 per add), the group total is
    scaled back and joins the float32 sums: y += s * sum_k c x + zero * sum_k x.

    Preparing x (~0.75 instructions per code, and two reductions across the warp per group) is
    the largest cost beside the codes'; with XPREP the producer of x (RMSNorm, silu * up) has
    written it in that form (`GemvX`, `store_gemv_x`) and the loop reads four words per word.
    """
    WPG: tl.constexpr = GROUP // 8  # words per group
    pid_n, pid_k, m, offs_n, n_mask, offs_w, x_row, q_cols, g_start, g_end, w_end, q_first = (
        _row_program(x_ptr, qw_ptr, N, G, groups_per_split, stride_xm, stride_qw, BLOCK_N, WPG)
    )
    offs_k = tl.arange(0, GROUP)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Codes are never written by a kernel: with PDL they load while the previous kernel finishes.
    if ADDR:
        woff = offs_w[:, None] * stride_qw + offs_n[None, :]  # < 2**31: the launcher checks
        q_next = _group_words(qw_ptr, woff, g_start, g_end, stride_qw, n_mask, WPG, EVEN)
    else:
        q_next = q_first
    if AHEAD:  # scales and zero points are weights too: the first group's before the wait
        s_next, mn_next = _scales_of_group(s_ptr, mn_ptr, g_start, stride_sg, offs_n, n_mask, EVEN)
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    if AHEAD and XPREP:
        xs_row = xs_ptr + m.to(tl.int64) * G * 2
        unscale_next = tl.load(xs_row + g_start * 2)
        x_sum_next = tl.load(xs_row + g_start * 2 + 1)
    for g in range(g_start, g_end):
        q = q_next
        wi = g * WPG + offs_w
        if ADDR:  # the next group's
            q_next = _group_words(qw_ptr, woff, g + 1, g_end, stride_qw, n_mask, WPG, EVEN)
        else:
            q_next = _code_words(q_cols, wi + WPG, w_end, n_mask, stride_qw)
        if AHEAD:
            # This group's came with the one before; the next one's (the last group's again at
            # the end: an address in range) now, so no DRAM round trip waits inside a group.
            gn = tl.minimum(g + 1, g_end - 1)
            s, mn = s_next, mn_next
            s_next, mn_next = _scales_of_group(s_ptr, mn_ptr, gn, stride_sg, offs_n, n_mask, EVEN)
        else:
            s, mn = _scales_of_group(s_ptr, mn_ptr, g, stride_sg, offs_n, n_mask, EVEN)
        if XPREP:
            # x as its producer wrote it (`GemvX`): scaled fp16 x, paired here by two byte
            # permutes per two pairs, and the group's 2**24 / scale and sum of x.
            xw = (x_row + g * GROUP).to(tl.pointer_type(tl.int32)) + offs_w * 4
            if AHEAD:
                unscale, x_sum = unscale_next, x_sum_next
                unscale_next = tl.load(xs_row + gn * 2)
                x_sum_next = tl.load(xs_row + gn * 2 + 1)
            else:
                xs = xs_ptr + (m.to(tl.int64) * G + g) * 2
                unscale = tl.load(xs)
                x_sum = tl.load(xs + 1)
        else:
            xg = tl.load(x_row + g * GROUP + offs_k).to(tl.float32)
            x_sum = tl.sum(xg, axis=0)
            sf, sc, sc16, unscale = _x_scale(tl.max(tl.abs(xg), axis=0))
        if ASM:
            if XPREP:
                p0, p1 = _pair_halves(tl.load(xw), tl.load(xw + 2))  # x 0,4 and 1,5
                p2, p3 = _pair_halves(tl.load(xw + 1), tl.load(xw + 3))  # x 2,6 and 3,7
            else:
                xr = (x_row + wi * 8).to(tl.pointer_type(tl.int32))  # bf16 pairs of a word's x
                sc2 = ((sf - 4) << 23) | (sf << 7)  # bf16 sc16 (high half), sc (low half)
                p0, p1 = _x_pairs(tl.load(xr), tl.load(xr + 2), sc2)  # x 0,4 and 1,5
                p2, p3 = _x_pairs(tl.load(xr + 1), tl.load(xr + 3), sc2)  # x 2,6 and 3,7
            q8 = q >> 8
            part = _h2_codes_fma(q, p0[:, None], q, False, True)
            part = _h2_codes_fma(q, p1[:, None], part, True, False)
            part = _h2_codes_fma(q8, p2[:, None], part, False, False)
            part = _h2_codes_fma(q8, p3[:, None], part, True, False)
            total = _h2_total(tl.reduce(part, 0, _hadd2))  # [BLOCK_N]
        else:
            # The same arithmetic one code at a time: x rounded to fp16 after scaling, every
            # product-and-add rounded to fp16 in the order of the packed halves (codes 0-3 in
            # the low half, 4-7 in the high); the sum over words in float32.
            for j in tl.static_range(8):
                if XPREP:
                    xt = tl.load(x_row + g * GROUP + offs_w * 8 + j).to(tl.float32)
                elif j % 2 == 1:
                    xt = _round_f16(tl.load(x_row + wi * 8 + j).to(tl.float32) * sc16)
                else:
                    xt = _round_f16(tl.load(x_row + wi * 8 + j).to(tl.float32) * sc)
                if j % 2 == 1:
                    cj = ((q >> (4 * j)) & 15).to(tl.float32) * (16.0 * 2.0**-24)
                else:
                    cj = ((q >> (4 * j)) & 15).to(tl.float32) * 2.0**-24
                prod = cj * xt[:, None]
                if j == 0:
                    lo = _round_f16(prod)
                elif j < 4:
                    lo = _round_f16(lo + prod)
                elif j == 4:
                    hi = _round_f16(prod)
                else:
                    hi = _round_f16(hi + prod)
            total = tl.sum(lo + hi, axis=0)
        acc += s * (total * unscale) + mn * x_sum
    out = out_ptr + m.to(tl.int64) * stride_om + offs_n
    if ATOMIC:  # float32 adds at L2, fire and forget: no partials, counter or last program
        tl.atomic_add(out, acc, mask=n_mask, sem="relaxed", scope="gpu")
    else:
        _finish_row(acc, out, ws_ptr, cnt_ptr, pid_n, pid_k, m, M, N, offs_n, n_mask, SPLIT,
                    REDUCE, SPLIT_P2, EVEN, ROUND)  # fmt: skip


@dataclass(frozen=True)
class GemvH2Config:
    """`_gemv_h2_kernel`: INT4, M = 1, N-major codes, packed fp16 arithmetic. Code-word
    addresses come from one 64-bit base per group plus 32-bit offsets when x is read as it is
    (measured on the H200: 4096 x 4096 from 6.4-6.5 to 6.2 us, the LM head, 128256 x 4096, from
    84-91 to 77 us), not when it is read as GemvX (no faster there)."""

    block_n: int = 32
    split_k: int = 1
    num_warps: int = 1
    num_stages: int = 1
    # Scales and zero points (and GemvX's scalars) loaded a group ahead, under a cap of 72
    # registers for ptxas (no spills). Measured on the H200 (Llama-3-8B shapes): summing the K
    # split by the arrival counter, 14336 x 4096 10.72 / 10.64 us against 10.98 / 10.81,
    # 4096 x 14336 11.36 against 11.24, the decode step unchanged; adding into a float32 row
    # (`accumulate`), 9.02 / 9.07 against 10.20 and 9.37 / 9.42 against 10.58, the decode step
    # 1.807 against 1.881 ms. So `default_config` uses it with `accumulate` only.
    ahead: bool = False


def launch_gemv_h2(
    x: torch.Tensor,
    w: QuantizedWeight,
    config: GemvH2Config,
    xq: GemvX | None = None,
    accumulate: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """(output, the compiled kernel launched) of `_gemv_h2_kernel`; with `xq` (x's GemvX form,
    from its producer) the kernel reads that instead of x. `accumulate`: a float32 [M, N]
    tensor, zero on entry, that every program adds its part into with float atomics (returned
    as the output): no split-K partials, arrival counters or last program, but the order of the
    adds, and so the last bits of the sums, varies from call to call. `out_dtype=float32`: the
    output in float32 holding what x's dtype would (rounded to it, then widened exactly)."""
    m, k = x.shape
    n = w.out_features
    if out_dtype not in (None, x.dtype, torch.float32) or (out_dtype and accumulate is not None):
        raise ValueError(f"out_dtype is x's dtype or float32, without accumulate; got {out_dtype}")
    rounds = out_dtype == torch.float32 and x.dtype != torch.float32
    rnd = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(x.dtype) if rounds else None
    if accumulate is not None and (
        accumulate.dtype != torch.float32 or accumulate.shape != (m, n) or accumulate.stride(1) != 1
    ):
        raise ValueError(
            f"accumulate must be a float32 [{m}, {n}] tensor with unit column stride, got "
            f"{accumulate.dtype} {tuple(accumulate.shape)}"
        )
    sl = _split_launch(x, w, config.block_n, config.split_k, m, "GemvH2Config", accumulate,
                       out_dtype)  # fmt: skip
    if k != sl.groups * w.group_size:
        raise ValueError(f"GemvH2Config needs whole groups: K {k}, group size {w.group_size}")
    # woff, the words' offsets from their group's base, is 32-bit.
    addr = xq is None and (w.group_size // 8) * w.qweight.stride(1) + n < 2**31
    asm = _compiled_cuda(x)
    if xq is not None:
        if xq.group != w.group_size or xq.scaled.shape != (m, k):
            raise ValueError(
                f"GemvX of shape {tuple(xq.scaled.shape)}, group {xq.group}, does not fit x "
                f"{(m, k)} and a weight of group size {w.group_size}"
            )
        x, xs = xq.scaled, xq.scalars
    else:
        xs = x  # not read
        if asm:
            if x.dtype != torch.bfloat16:
                raise ValueError(f"GemvH2Config needs bf16 activations on the GPU, got {x.dtype}")
            if x.data_ptr() % 16 or (m > 1 and x.stride(0) % 8):
                x = x.contiguous().clone()  # each word's 8 values of x are read as 16 aligned bytes
    kernel = _gemv_h2_kernel[(sl.blocks, sl.split, m)](
        *sl.args(x, w),
        xs,
        XPREP=xq is not None,
        GROUP=w.group_size,
        BLOCK_N=config.block_n,
        REDUCE=sl.split > 1 and accumulate is None,
        SPLIT_P2=triton.next_power_of_2(sl.split),
        EVEN=n % config.block_n == 0,
        ASM=asm,
        ADDR=addr,
        AHEAD=config.ahead,
        ATOMIC=accumulate is not None,
        ROUND=rnd,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **({"maxnreg": 72} if asm and config.ahead else {}),
        **pdl.launch_options(x),
    )
    return sl.out, kernel
