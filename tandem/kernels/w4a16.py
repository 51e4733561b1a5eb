"""W4A16 / W8A16 matrix multiply: Triton kernels (CUDA) beside the torch reference (CPU).

y[M, N] = x[M, K] @ W^T with W held as per-group integer codes (see `tandem.quant.format`):
    W[n, k] = q[n, k] * scale[n, k // G] + min[n, k // G]

Five kernels, all dequantizing in registers (the weight is read from memory once, packed):
- `_gemv_h2_kernel`, the default for M = 1 with bf16 x and INT4 codes stored N-major (`n_major`;
  how the GPU model stores them): codes left in place under a mask are fp16 subnormals, and two
  are multiplied and added per packed-fp16 instruction. Its K split is summed either by the last
  program to arrive, or, in one-row decode steps (`gemv_accumulates`), by float atomics into a
  zeroed float32 row that the kernel reading it rounds and zeroes again.
- `_gemv_nmajor_kernel`, the same layout in float32 FMAs (x not bf16): codes become
  floats by a shift and a LOP3 under a float exponent, and split-K partials are added by the
  last program to arrive (no zero-fill or cast launches).
- `_gemv_tc_kernel` for 2 <= M <= 32 (bf16 x, INT4 N-major, groups of 64 or more): the same
  codes become bf16 pairs, one LOP3 per two codes, and the tensor cores multiply them by x.
- `_gemv_kernel` for M = 1 on row-major codes (and INT8): one program per BLOCK_N output rows
  streams their packed words and keeps a [BLOCK_N, BLOCK_W] float32 accumulator. The zero point
  is folded out of the inner loop: sum_k (q s + m) x = s * sum_k q x + m * sum_k x per group.
- `_gemm_kernel` for the other M > 1 cases, either layout: a tiled tl.dot over dequantized [BLOCK_K, BLOCK_N]
  weight tiles in the activation dtype, float32 accumulation.
The last two can split K across programs (SPLIT_K > 1) for small grids; the partial sums are then
added with float32 atomics into a zeroed buffer that is cast to the activation dtype afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.config import kernel_config
from tandem.kernels import pdl
from tandem.kernels._triton import tl, triton
from tandem.kernels.arrival import arrival_counters
from tandem.quant.format import QuantizedWeight


def w4a16_matmul_ref(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [M, K] @ dequantize(w)^T in x's dtype: the plain-torch reference (used on CPU)."""
    return F.linear(x, w.dequantize(x.dtype))


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] activations
    qw_ptr,  # [N, KW] int32 packed codes
    s_ptr,  # [N, Kp // GROUP] fp16 scales
    mn_ptr,  # [N, Kp // GROUP] fp16 zero points (value of code 0)
    out_ptr,  # [M, N] (float32 when ATOMIC)
    N,
    K,
    words_per_split,  # packed words each K-split covers (a multiple of BLOCK_W)
    KW,  # packed words per row
    stride_xm,
    stride_qn,
    stride_qw,
    stride_sn,
    stride_sg,
    stride_om,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,  # packed words per row per iteration
    ATOMIC: tl.constexpr,
    EVEN: tl.constexpr,  # whole tiles only (N, K and the split sizes divide evenly): no masks
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2).to(tl.int64)
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    q_row = qw_ptr + rows[:, None] * stride_qn
    s_row = s_ptr + rows[:, None] * stride_sn
    mn_row = mn_ptr + rows[:, None] * stride_sn
    x_row = x_ptr + m * stride_xm
    offs_w = tl.arange(0, BLOCK_W)

    w_start = pid_k * words_per_split
    w_end = tl.minimum(w_start + words_per_split, KW)
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    for w0 in range(w_start, w_end, BLOCK_W):
        wi = w0 + offs_w  # [BLOCK_W] word index
        g = (wi * PER) // GROUP
        if EVEN:
            q = tl.load(q_row + wi[None, :] * stride_qw)  # [BLOCK_N, BLOCK_W] int32
            s = tl.load(s_row + g[None, :] * stride_sg).to(tl.float32)
            mn = tl.load(mn_row + g[None, :] * stride_sg).to(tl.float32)
        else:
            w_mask = wi < w_end
            mask = n_mask[:, None] & w_mask[None, :]
            q = tl.load(q_row + wi[None, :] * stride_qw, mask=mask, other=0)
            s = tl.load(s_row + g[None, :] * stride_sg, mask=mask, other=0.0).to(tl.float32)
            mn = tl.load(mn_row + g[None, :] * stride_sg, mask=mask, other=0.0).to(tl.float32)
        qx = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        xsum = tl.zeros([BLOCK_W], dtype=tl.float32)
        for j in tl.static_range(PER):
            k = wi * PER + j
            if EVEN:
                xj = tl.load(x_row + k).to(tl.float32)
            else:
                xj = tl.load(x_row + k, mask=w_mask & (k < K), other=0.0).to(tl.float32)
            xsum += xj
            # >> is arithmetic on int32: the mask drops the sign bits of the top code. (Decoding
            # through the float exponent instead of a convert measured no faster on the H200.)
            cj = ((q >> (j * BITS)) & MASK).to(tl.float32)
            qx += cj * xj[None, :]
        acc += s * qx + mn * xsum[None, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if ATOMIC:
        tl.atomic_add(out_ptr + m * stride_om + offs_n, y, mask=n_mask)
    elif EVEN:
        tl.store(out_ptr + m * stride_om + offs_n, y.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + m * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _code_lo(t, ASM: tl.constexpr):
    """256 + (bits 15..18 of t), as float32."""
    if ASM:
        # The OR constant in a register and the mask as the immediate: ptxas left to itself
        # re-materializes the mask before every LOP3.
        return tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, 0x78000, $2, 0xEA;",
            "=r,r,r",
            [t, tl.full(t.shape, 0x43800000, tl.int32)],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    return ((t & 0x78000) | 0x43800000).to(tl.float32, bitcast=True)


@triton.jit
def _code_hi(t, ASM: tl.constexpr):
    """16 + (bits 19..22 of t), as float32."""
    if ASM:
        return tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, 0x780000, $2, 0xEA;",
            "=r,r,r",
            [t, tl.full(t.shape, 0x41800000, tl.int32)],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    return ((t & 0x780000) | 0x41800000).to(tl.float32, bitcast=True)


@triton.jit
def _code_words(q_cols, wi, w_end, n_mask, stride_qw):
    """Code words wi ([WPG], a group's) for a 1-row GEMV program's columns, [WPG, BLOCK_N]
    (N-major: 16-byte vectors across columns); words at or past w_end read as 0."""
    return tl.load(
        q_cols + wi[:, None].to(tl.int64) * stride_qw,
        mask=(wi < w_end)[:, None] & n_mask[None, :],
        other=0,
    )


@triton.jit
def _group_words(
    qw_ptr, woff, g, g_end, stride_qw, n_mask, WPG: tl.constexpr, EVEN: tl.constexpr
):  # fmt: skip
    """Group g's code words [WPG, BLOCK_N] for a 1-row program's columns (zeros from g_end on):
    one 64-bit base per group, the same for every thread, plus the 32-bit offsets `woff` of the
    program's words computed once, so each word's address is one multiply-add (a 64-bit index
    per word cost ~8 instructions)."""
    base = qw_ptr + (tl.zeros([], tl.int64) + g * WPG) * stride_qw  # g: a Python int or not
    valid = tl.full(woff.shape, g, tl.int32) < g_end  # one predicate for the whole tile
    if EVEN:
        return tl.load(base + woff, mask=valid, other=0)
    return tl.load(base + woff, mask=valid & n_mask[None, :], other=0)


@triton.jit
def _row_program(
    x_ptr, qw_ptr, N, G, groups_per_split, stride_xm, stride_qw, BLOCK_N: tl.constexpr,
    WPG: tl.constexpr,
):  # fmt: skip
    """A 1-row GEMV program's place (grid: column blocks, K splits, rows of x) and its first
    group's code words, loaded: (pid_n, pid_k, m, offs_n, n_mask, offs_w, x_row, q_cols,
    g_start, g_end, w_end, q_next)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, WPG)
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    q_cols = qw_ptr + offs_n[None, :]
    g_start = pid_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, G)
    w_end = g_end * WPG
    q_next = _code_words(q_cols, g_start * WPG + offs_w, w_end, n_mask, stride_qw)
    return pid_n, pid_k, m, offs_n, n_mask, offs_w, x_row, q_cols, g_start, g_end, w_end, q_next


@triton.jit
def _scales_of_group(s_ptr, mn_ptr, g, stride_sg, offs_n, n_mask, EVEN: tl.constexpr):
    """Group g's scales and zero points for the program's columns, as float32."""
    s_off = g * stride_sg + offs_n  # scales hold < 2**31 entries
    if EVEN:
        return tl.load(s_ptr + s_off).to(tl.float32), tl.load(mn_ptr + s_off).to(tl.float32)
    s = tl.load(s_ptr + s_off, mask=n_mask, other=0.0).to(tl.float32)
    return s, tl.load(mn_ptr + s_off, mask=n_mask, other=0.0).to(tl.float32)


@triton.jit
def _finish_row(
    acc,  # [BLOCK_N] float32 sums of this program's part of K
    out,  # [BLOCK_N] pointers into the output row
    ws_ptr,
    cnt_ptr,
    pid_n,
    pid_k,
    m,
    M,
    N,
    offs_n,
    n_mask,
    SPLIT,
    REDUCE: tl.constexpr,
    SPLIT_P2: tl.constexpr,
    EVEN: tl.constexpr,
    ROUND: tl.constexpr = None,  # a dtype the sums are rounded to before the output's
):
    """One output row of a 1-row GEMV program: stored directly, or, with K split (REDUCE), as
    partial sums that the last program to arrive at the column block (an acq_rel counter) adds
    up and stores; it then re-zeroes the counter for the next call. With ROUND (x's dtype for a
    float32 output) the stored value is the one an output in x's dtype holds, widened."""
    if REDUCE:
        ws = ws_ptr + (pid_k * M + m).to(tl.int64) * N + offs_n
        tl.store(ws, acc, mask=n_mask)
        tl.debug_barrier()  # every thread's partials are written before the counter moves
        cnt = cnt_ptr + m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            # All partials in one load (a loop would wait out one L2 round trip per split).
            sk = tl.arange(0, SPLIT_P2)
            parts = tl.load(
                ws_ptr + (sk[:, None] * M + m).to(tl.int64) * N + offs_n[None, :],
                mask=(sk < SPLIT)[:, None] & n_mask[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            total = tl.sum(parts, axis=0)
            if ROUND is not None:
                total = total.to(ROUND).to(tl.float32)
            tl.store(out, total.to(out.dtype.element_ty), mask=n_mask)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next call
    else:
        if ROUND is not None:
            acc = acc.to(ROUND).to(tl.float32)
        if EVEN:
            tl.store(out, acc.to(out.dtype.element_ty))
        else:
            tl.store(out, acc.to(out.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemv_nmajor_kernel(
    x_ptr,  # [M, K] activations
    qw_ptr,  # packed codes, word w of row n at qw_ptr + w * stride_qw + n (N-major storage)
    s_ptr,  # fp16 scales, group g of row n at s_ptr + g * stride_sg + n
    mn_ptr,  # fp16 zero points (value of code 0), same layout as the scales
    out_ptr,  # [M, N]
    ws_ptr,  # float32 [SPLIT, M, N] partial sums (REDUCE)
    cnt_ptr,  # int32 [M * cdiv(N, BLOCK_N)] arrival counters, zero between calls (REDUCE)
    M,
    N,
    K,
    G,  # groups per row (Kp // GROUP)
    groups_per_split,
    SPLIT,  # programs along K
    stride_xm,
    stride_qw,
    stride_sg,
    stride_om,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    REDUCE: tl.constexpr,  # SPLIT > 1: the last program of a column block adds the partials
    SPLIT_P2: tl.constexpr,  # SPLIT rounded up to a power of 2 (the partials' load)
    EVEN: tl.constexpr,  # N a multiple of BLOCK_N and K == Kp: no masks
    ASM: tl.constexpr,  # PTX lop3 for the code -> float step (compiled CUDA, not the interpreter)
    PDL: tl.constexpr,  # programmatic dependent launch: the first group's codes load before the wait
    X_PAIRS: tl.constexpr,  # EVEN, compiled, bf16 x with 4-byte aligned rows: x read in pairs
):
    """INT4 GEMV over N-major packed codes: the weight is read as 16-byte vectors across output
    rows, x as broadcasts, and codes become floats without an int->float convert.

    Codes j and j+1 of a word (bits 4j..4j+7) are moved by one shift to bits 15..22; each is
    then masked and OR-ed under a float exponent in one LOP3: code j (bits 15..18) under 256.0
    gives v = 256 + c, code j+1 (bits 19..22) under 16.0 gives v = 16 + c, both exact. So
    v * x = offset * x + c * x and sum_k v x = X' + sum_k c x, X' = sum_k offset_k x_k per
    group. No quarter-rate int->float convert: ~4 instructions per code in all (the SASS count
    of the loop, bench/gemv_probe.py --dump), one LOP3, half a shift and one FFMA of them per code.

    The next group's codes are loaded before this group's are used (two loads in flight per
    program). K is split over SPLIT programs; each writes its partial sums, and the last to
    arrive at its column block (an acq_rel counter) adds them and writes the output, then
    resets the counter: no zero-fill and no cast kernel around the GEMV.
    """
    WPG: tl.constexpr = GROUP // 8  # words per group
    pid_n, pid_k, m, offs_n, n_mask, offs_w, x_row, q_cols, g_start, g_end, w_end, q_next = (
        _row_program(x_ptr, qw_ptr, N, G, groups_per_split, stride_xm, stride_qw, BLOCK_N, WPG)
    )
    offs_k = tl.arange(0, GROUP)
    # The codes ride on 256 (j even) or 16 (j odd): sum_k v x = X' + sum_k c x with
    # X' = sum_k offset_k x_k.
    k_offset = tl.where(offs_k % 2 == 0, 256.0, 16.0)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Codes are never written by a kernel: with PDL they load while the previous kernel finishes.
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    for g in range(g_start, g_end):
        q = q_next
        wi = g * WPG + offs_w  # [WPG] word index
        q_next = _code_words(q_cols, wi + WPG, w_end, n_mask, stride_qw)  # the next group's
        s, mn = _scales_of_group(s_ptr, mn_ptr, g, stride_sg, offs_n, n_mask, EVEN)
        kx = g * GROUP + offs_k
        if EVEN:
            xg = tl.load(x_row + kx).to(tl.float32)
        else:
            xg = tl.load(x_row + kx, mask=kx < K, other=0.0).to(tl.float32)
        x_sum = tl.sum(xg, axis=0)
        xp_sum = tl.sum(xg * k_offset, axis=0)
        for j in tl.static_range(0, 8, 2):
            if X_PAIRS:  # bf16 x: one 32-bit load per pair, each half to float32 by a mask/shift
                xp = tl.load((x_row + wi * 8 + j).to(tl.pointer_type(tl.int32)))
                xa = (xp << 16).to(tl.float32, bitcast=True)
                xb = (xp & -65536).to(tl.float32, bitcast=True)
            elif EVEN:
                xa = tl.load(x_row + wi * 8 + j).to(tl.float32)
                xb = tl.load(x_row + wi * 8 + j + 1).to(tl.float32)
            else:
                ka = wi * 8 + j
                xa = tl.load(x_row + ka, mask=ka < K, other=0.0).to(tl.float32)
                xb = tl.load(x_row + ka + 1, mask=ka + 1 < K, other=0.0).to(tl.float32)
            if j == 0:
                t = q << 15
            elif j == 2:
                t = q << 7
            elif j == 4:
                t = q >> 1
            else:
                t = q >> 9
            if j == 0:  # the first product starts the sums (no zero-fill)
                part = _code_lo(t, ASM) * xa[:, None]
            else:
                part += _code_lo(t, ASM) * xa[:, None]  # two separate FFMAs
            part += _code_hi(t, ASM) * xb[:, None]
        acc += s * (tl.sum(part, axis=0) - xp_sum) + mn * x_sum
    out = out_ptr + m.to(tl.int64) * stride_om + offs_n
    _finish_row(acc, out, ws_ptr, cnt_ptr, pid_n, pid_k, m, M, N, offs_n, n_mask, SPLIT,
                REDUCE, SPLIT_P2, EVEN)  # fmt: skip


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
def _x_scale(amax):
    """Exponent field sf of the power of two that takes a group's largest |x| (amax) into
    [2**14, 2**15), clamped (an all-zero group; sf - 4 and 278 - sf stay valid fields), and
    from it sc = 2**(sf - 127), sc / 16 and 2**24 / sc as float32: (sf, sc, sc16, unscale)."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    sf = tl.minimum(tl.maximum(268 - e, 24), 254)
    sc = (sf << 23).to(tl.float32, bitcast=True)
    sc16 = ((sf - 4) << 23).to(tl.float32, bitcast=True)
    unscale = ((278 - sf) << 23).to(tl.float32, bitcast=True)
    return sf, sc, sc16, unscale


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


@triton.jit
def _code_pairs(t, shift, ASM: tl.constexpr):
    """bf16 128 + code for t [n, k'] holding each word twice along k' (k' = 2w + h): bits 0..3
    of the word for even k', bits 16..19 for odd (`shift`, [k'], is 0 or 16). Compiled, one LOP3
    makes both values of a 32-bit register (code c under the bf16 exponent of 128 is 128 + c)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;",
            "=r,r,r",
            [t],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=2,
        )
    # The interpreter, one code at a time (through float32: its int -> bf16 cast is a bitcast).
    return (128 + ((t >> shift[None, :]) & 15)).to(tl.float32).to(tl.bfloat16)


@triton.jit
def _tc_slice(q, d: tl.constexpr, xt, part, offs_c, KP: tl.constexpr, ASM: tl.constexpr):
    """part + W_d x_d: codes d and d + 4 of every word of q [WPG, n] as bf16 [n, k'] (k' = 2w + h)
    times xt [k', BLOCK_M] on the tensor cores."""
    t = q >> (4 * d)
    tt = tl.reshape(tl.permute(tl.join(t, t), (1, 0, 2)), (t.shape[1], KP))  # [n, k']
    w = _code_pairs(tt, (offs_c % 2) * 16, ASM)
    if ASM:
        return tl.dot(w, xt.to(tl.bfloat16), part)
    # The interpreter's dot: float32 operands (the values are the same).
    return tl.dot(w.to(tl.float32), xt.to(tl.float32), part, input_precision="ieee")


@triton.jit
def _gemv_tc_kernel(
    x_ptr,  # [M, K] bf16 activations
    qw_ptr,  # packed codes, N-major (word w of row n at qw_ptr + w * stride_qw + n)
    s_ptr,  # fp16 scales, group g of row n at s_ptr + g * stride_sg + n
    mn_ptr,  # fp16 zero points (value of code 0), same layout
    out_ptr,  # [M, N]
    ws_ptr,  # float32 [SPLIT, M, N] partial sums (REDUCE)
    cnt_ptr,  # int32 arrival counters, zero between calls (REDUCE)
    M,
    N,
    K,
    G,  # groups per row
    groups_per_split,
    SPLIT,
    stride_xm,
    stride_qw,
    stride_sg,
    stride_om,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows of x per program: 16 (the matrix instruction's smallest) to 64
    REDUCE: tl.constexpr,
    ONE_ROW: tl.constexpr,  # M == 1: the group sums of x are scalars
    ASM: tl.constexpr,
    PDL: tl.constexpr,
):
    """INT4 x bf16 on the tensor cores, BLOCK_M rows of x per program, N-major codes: codes
    become bf16 pairs in registers and the matrix instruction multiplies them by x, so a code
    costs half a LOP3 and ~0.4 of a shift instead of the FFMA kernel's LOP3, FFMA, shifts and x
    handling.

    Word w of a group holds codes k = 8w + j at bits 4j. (q >> 4d) under the mask 0x000F000F
    gives codes d and d + 4 as the two bf16 halves of one register, 128 + c each (exact). The
    product for slice d runs over k' = 2w + h (h: low or high half), that is input k = 4k' + d,
    so x is read at stride 4. Per group and column: sum_k x (128 + c) = 128 X + sum_k x c, with
    X the group's sum of x, and y += s * (that) + (zero - 128 s) * X, all in float32.
    The weight is the matrix instruction's first operand ([BLOCK_N, k']) and x^T the second,
    BLOCK_M columns (rows of x past M are zeros; each block of BLOCK_M rows re-reads the weight).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    WPG: tl.constexpr = GROUP // 8
    KP: tl.constexpr = 2 * WPG  # k' per slice
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, WPG)
    offs_c = tl.arange(0, KP)
    offs_g = tl.arange(0, GROUP)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    x_rows = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm  # [1, BLOCK_M]
    q_cols = qw_ptr + offs_n[None, :]

    g_start = pid_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, G)
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # Scales, zero points and the group's x are loaded a group ahead: their latency would
    # otherwise stall every group (the codes are pipelined by Triton, num_stages).
    # (Every program has at least one group: the launch sizes the splits so.)
    s_next = tl.load(s_ptr + g_start * stride_sg + offs_n, mask=n_mask)
    mn_next = tl.load(mn_ptr + g_start * stride_sg + offs_n, mask=n_mask)
    kx = g_start * GROUP + offs_g
    if ONE_ROW:
        x_next = tl.load(x_ptr + kx, mask=kx < K, other=0.0)
    else:
        x_next = tl.load(x_rows + kx[:, None], mask=(kx < K)[:, None] & m_mask[None, :], other=0.0)
    col0 = (tl.arange(0, BLOCK_M) == 0)[None, :]
    for g in range(g_start, g_end):
        q = tl.load(
            q_cols + (g * WPG + offs_w)[:, None].to(tl.int64) * stride_qw,
            mask=n_mask[None, :],
            other=0,
        )  # [WPG, BLOCK_N]
        s = s_next.to(tl.float32)
        mn = mn_next.to(tl.float32)
        xg = x_next  # [GROUP] (one row) or [GROUP, BLOCK_M], bf16
        gn = g + 1
        # (gn < g_end as a tensor: the interpreter refuses a scalar inside a mask.)
        nmask = n_mask & ((offs_n * 0 + gn) < g_end)
        s_next = tl.load(s_ptr + gn * stride_sg + offs_n, mask=nmask)
        mn_next = tl.load(mn_ptr + gn * stride_sg + offs_n, mask=nmask)
        kx = gn * GROUP + offs_g
        kmask = (kx < K) & ((offs_g * 0 + gn) < g_end)
        xs = tl.sum(xg.to(tl.float32), axis=0)  # the group's sum of x: a scalar, or [BLOCK_M]
        # x at k = 4k' + d for slice d: [k', a, b] with d = 2a + b.
        if ONE_ROW:
            x_next = tl.load(x_ptr + kx, mask=kmask, other=0.0)
            xa, xb = tl.split(tl.reshape(xg, (KP, 2, 2)))
            x0, x2 = tl.split(xa)
            x1, x3 = tl.split(xb)
            x0 = tl.where(col0, x0[:, None], 0.0)
            x1 = tl.where(col0, x1[:, None], 0.0)
            x2 = tl.where(col0, x2[:, None], 0.0)
            x3 = tl.where(col0, x3[:, None], 0.0)
        else:
            x_next = tl.load(x_rows + kx[:, None], mask=kmask[:, None] & m_mask[None, :], other=0.0)
            x4 = tl.permute(tl.reshape(xg, (KP, 2, 2, BLOCK_M)), (0, 3, 1, 2))  # [k', m, a, b]
            xa, xb = tl.split(x4)
            x0, x2 = tl.split(xa)
            x1, x3 = tl.split(xb)
        part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        part = _tc_slice(q, 0, x0, part, offs_c, KP, ASM)
        part = _tc_slice(q, 1, x1, part, offs_c, KP, ASM)
        part = _tc_slice(q, 2, x2, part, offs_c, KP, ASM)
        part = _tc_slice(q, 3, x3, part, offs_c, KP, ASM)
        if ONE_ROW:
            acc += s[:, None] * part + ((mn - 128.0 * s) * xs)[:, None]
        else:
            acc += s[:, None] * part + (mn - 128.0 * s)[:, None] * xs[None, :]
    out = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    omask = n_mask[:, None] & m_mask[None, :]
    if REDUCE:
        ws = ws_ptr + (pid_k * M + offs_m).to(tl.int64)[None, :] * N + offs_n[:, None]
        tl.store(ws, acc, mask=omask)
        tl.debug_barrier()  # every thread's partials are written before the counter moves
        cnt = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for sk in range(0, SPLIT):
                total += tl.load(
                    ws_ptr + (sk * M + offs_m).to(tl.int64)[None, :] * N + offs_n[:, None],
                    mask=omask,
                    other=0.0,
                    cache_modifier=".cg",
                )
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next call
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _gemm_kernel(
    x_ptr,  # [M, K]
    qw_ptr,  # [N, KW] int32
    s_ptr,  # [N, Kp // GROUP] fp16
    mn_ptr,  # [N, Kp // GROUP] fp16
    out_ptr,  # [M, N] (float32 when ATOMIC)
    M,
    N,
    K,
    words_per_split,  # a multiple of BLOCK_K // PER
    KW,
    stride_xm,
    stride_qn,
    stride_qw,
    stride_sn,
    stride_sg,
    stride_om,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # input features per iteration (a multiple of 32 // BITS)
    ATOMIC: tl.constexpr,
    DOT_FP32: tl.constexpr,  # fp32 operands (fp32 activations, or bf16 under the interpreter)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    PER: tl.constexpr = 32 // BITS
    BLOCK_W: tl.constexpr = BLOCK_K // PER
    MASK: tl.constexpr = (1 << BITS) - 1

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_w = tl.arange(0, BLOCK_W)
    offs_j = tl.arange(0, PER)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm

    w_start = pid_k * words_per_split
    w_end = tl.minimum(w_start + words_per_split, KW)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for w0 in range(w_start, w_end, BLOCK_W):
        wi = w0 + offs_w
        mask = (wi < w_end)[:, None] & n_mask[None, :]
        q = tl.load(
            qw_ptr + rows[None, :] * stride_qn + wi[:, None] * stride_qw, mask=mask, other=0
        )
        g = (wi * PER) // GROUP
        s_off = rows[None, :] * stride_sn + g[:, None] * stride_sg
        s = tl.load(s_ptr + s_off, mask=mask, other=0.0)
        mn = tl.load(mn_ptr + s_off, mask=mask, other=0.0)
        codes = (q[:, None, :] >> (offs_j * BITS)[None, :, None]) & MASK  # [BLOCK_W, PER, BLOCK_N]
        w = codes.to(tl.float32) * s.to(tl.float32)[:, None, :] + mn.to(tl.float32)[:, None, :]
        w = tl.reshape(w, (BLOCK_K, BLOCK_N))  # row kw * PER + j: input feature order
        k = w0 * PER + offs_k
        x = tl.load(
            x_rows + k[None, :],
            mask=m_mask[:, None] & ((k < K) & (k < w_end * PER))[None, :],
            other=0.0,
        )
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    omask = m_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=omask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=omask)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8
    block_w: int = 64
    split_k: int = 1
    num_warps: int = 4


@dataclass(frozen=True)
class GemvNConfig:
    """`_gemv_nmajor_kernel`: INT4, M = 1, N-major codes (`n_major`)."""

    block_n: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2


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


@dataclass(frozen=True)
class GemvTCConfig:
    """`_gemv_tc_kernel`: INT4, N-major codes, tensor cores, `block_m` rows of x per program."""

    block_n: int = 256
    split_k: int = 4
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 16  # rows of x per program (16, 32 or 64); more rows re-read the weight


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def is_n_major(w: QuantizedWeight) -> bool:
    """Codes, scales and zero points stored N-major (column n contiguous along the rows)."""
    return w.qweight.stride(0) == 1 and w.scales.stride(0) == 1 and w.mins.stride(0) == 1


def n_major(w: QuantizedWeight) -> QuantizedWeight:
    """The same weight with N-major storage: `qweight` is still an [N, KW] tensor (every
    QuantizedWeight operation works on it unchanged), but a view of a contiguous [KW, N] one, so
    that a program of the M = 1 kernel reads 16-byte vectors across output rows and x as
    broadcasts. The M > 1 kernel reads either layout. The GPU model stores its INT4 weights so."""
    if is_n_major(w):
        return w

    def t(a: torch.Tensor) -> torch.Tensor:
        return a.t().contiguous().t()

    return QuantizedWeight(
        t(w.qweight), t(w.scales), t(w.mins), w.bits, w.group_size, w.in_features, w.zero_point
    )


@dataclass
class GemvX:
    """A row of activations in the form `_gemv_h2_kernel` reads (XPREP), written by the kernel
    that produces x (`store_gemv_x`): per group of `group` inputs, x scaled by the power of two
    that puts its largest |x| in [2**14, 2**15) (the inputs at odd positions by a sixteenth of
    it, for the GEMV's x16 codes) as fp16; and per group, float32, 2**24 / scale and the sum of
    x; in input order (the GEMV pairs x0 with x4 and so on itself: storing the pairs instead, by
    16-bit stores permuted inside each 16-byte word, made RMSNorm 125 -> 410 us per decode step
    on the H200)."""

    scaled: torch.Tensor  # fp16 [M, K]
    scalars: torch.Tensor  # float32 [M, K // group, 2]
    group: int

    @staticmethod
    def empty(m: int, k: int, group: int, device: torch.device) -> GemvX:
        return GemvX(
            torch.empty((m, k), dtype=torch.float16, device=device),
            torch.empty((m, k // group, 2), dtype=torch.float32, device=device),
            group,
        )


@triton.jit
def store_gemv_x(
    v,  # [NG, GROUP] float32: x at groups g0 .. g0 + NG of one row (as the GEMV will read it)
    g0,
    n_cols,  # K; groups past it are not written
    scaled_ptr,  # this row of GemvX.scaled
    scal_ptr,  # this row of GemvX.scalars
    GROUP: tl.constexpr,
):
    """Write v's whole groups in the GemvX form (a producer kernel's epilogue; the producer
    computes in [groups, GROUP] tiles so that no reshape is needed here)."""
    gi = g0 + tl.arange(0, v.shape[0])
    gmask = (gi + 1) * GROUP <= n_cols
    _, sc, sc16, unscale = _x_scale(tl.max(tl.abs(v), axis=1))
    i = tl.arange(0, GROUP)
    h = (v * tl.where((i % 2 == 1)[None, :], sc16[:, None], sc[:, None])).to(tl.float16)
    tl.store(scaled_ptr + gi[:, None] * GROUP + i[None, :], h, mask=gmask[:, None])
    tl.store(scal_ptr + gi * 2, unscale, mask=gmask)
    tl.store(scal_ptr + gi * 2 + 1, tl.sum(v, axis=1), mask=gmask)


def gemv_x_ref(x: torch.Tensor, group: int) -> GemvX:
    """The GemvX form of x [M, K] (K a multiple of group) in plain torch: the reference the
    producer kernels are tested against."""
    m, k = x.shape
    v = x.float().reshape(m, k // group, group)
    amax = v.abs().amax(-1)
    e = (amax.view(torch.int32) >> 23) & 0xFF
    sf = (268 - e).clamp(24, 254)
    sc = (sf << 23).view(torch.float32)
    sc16 = ((sf - 4) << 23).view(torch.float32)
    odd = (torch.arange(group, device=x.device) % 2 == 1)[None, None, :]
    h = (v * torch.where(odd, sc16[..., None], sc[..., None])).to(torch.float16).reshape(m, k)
    scal = torch.stack([((278 - sf) << 23).view(torch.float32), v.sum(-1)], dim=-1)
    return GemvX(h.contiguous(), scal.contiguous(), group)


def gemv_x_group(w: QuantizedWeight | torch.Tensor, x_dtype: torch.dtype) -> int | None:
    """The group size of the GemvX form `w`'s M = 1 product reads on the GPU, or None when that
    product does not take it (not the packed-fp16 GEMV)."""
    if not isinstance(w, QuantizedWeight) or x_dtype != torch.bfloat16:
        return None
    if w.qweight.device.type != "cuda" or kernel_config().interpreted:
        return None
    if not h2_eligible(w, w.in_features, x_dtype, w.qweight.device):
        return None
    return w.group_size


def gemv_accumulates(w: QuantizedWeight | torch.Tensor, x_dtype: torch.dtype) -> bool:
    """Whether `w`'s one-row product on the GPU adds into a zeroed float32 row with float
    atomics (`w4a16_matmul(accumulate=)`) rather than summing its K split through partials, an
    arrival counter and a last program (a fence and two round trips to L2 at the end of every
    call). Only for the packed-fp16 GEMV, on compiled CUDA, unless the `deterministic` kernel
    setting is on. The adds come in any order, so the float32 sums, and rarely their rounding to
    x's dtype, vary in the last bit from run to run; `deterministic` gives bit-reproducible
    steps.
    Measured on the H200 (Llama-3-8B shape): the INT4 + INT4-head decode step
    of a Llama-3-8B shape 1.807 / 1.807 / 1.803 ms against 2.023 / 2.029 with the counter."""
    if not isinstance(w, QuantizedWeight) or not w.qweight.is_cuda:
        return False
    return gemv_atomic_enabled(x_dtype) and h2_weight(w, w.in_features)


def gemv_atomic_enabled(x_dtype: torch.dtype) -> bool:
    """The settings' part of `gemv_accumulates` (the same for every weight): compiled CUDA, bf16
    x, not `deterministic`."""
    kc = kernel_config()
    return x_dtype == torch.bfloat16 and not kc.deterministic and not kc.interpreted


def h2_weight(w: QuantizedWeight, k: int) -> bool:
    """The weight's part of `h2_eligible`: INT4 codes stored N-major, K whole groups."""
    return w.bits == 4 and is_n_major(w) and k == w.scales.shape[1] * w.group_size


def h2_eligible(
    w: QuantizedWeight, k: int, x_dtype: torch.dtype | None, device: torch.device
) -> bool:
    """Whether `_gemv_h2_kernel` serves this M = 1 product: INT4 N-major codes of whole groups
    (K a multiple of the group size), bf16 x on the GPU (any x in the interpreter)."""
    if not h2_weight(w, k):
        return False
    interpreted = kernel_config().interpreted
    return x_dtype == torch.bfloat16 or (interpreted and device.type != "cuda")


def default_config(
    m: int,
    n: int,
    k: int,
    device: torch.device,
    w: QuantizedWeight | None = None,
    x_dtype: torch.dtype | None = None,
    accumulate: bool = False,
) -> GemvConfig | GemvNConfig | GemvH2Config | GemvTCConfig | GemmConfig:
    """A launch configuration by shape: enough programs in flight to cover every SM
    (`accumulate`: the packed-fp16 GEMV adding into a float32 row, `gemv_accumulates`)."""
    sms = _num_sms(device)
    if (
        2 <= m <= 32
        and w is not None
        and w.bits == 4
        and w.group_size >= 64
        and is_n_major(w)
        and x_dtype == torch.bfloat16
        and device.type == "cuda"
        and not kernel_config().interpreted
    ):
        # Tensor cores for 2 <= M <= 32 (measured on the H200): 16 rows and 256 columns per
        # program up to M = 16, then 32 rows and 128 columns; K split until ~1.5 (16 rows) or
        # ~1.8 (32 rows) programs per SM run, each keeping >= 2 groups. At M = 1 the FFMA kernel
        # below is faster; past M = 32 the tl.dot GEMM wins on some shapes.
        block_m, block_n = (16, 256) if m <= 16 else (32, 128)
        target = 3 * sms // 2 if block_m == 16 else 9 * sms // 5
        groups = -(-k // w.group_size)
        blocks = triton.cdiv(n, block_n)
        split = 1
        while blocks * split < target and groups >= 4 * split:
            split *= 2
        return GemvTCConfig(block_n, split, num_warps=4, num_stages=3, block_m=block_m)
    if m == 1 and w is not None and w.bits == 4 and is_n_major(w):
        # From the sweeps in bench/results/h200_quant.json (H200, Llama-3-8B shapes): one warp
        # per 64 columns; K split until each program has at most 4 groups and at least ~1536
        # programs run (at most 32 ways, >= 1 group each).
        groups = -(-k // w.group_size)
        blocks = triton.cdiv(n, 64)
        split = 1
        while split < 32 and (groups > 4 * split or blocks * split < 1536) and groups >= 2 * split:
            split *= 2
        if h2_eligible(w, k, x_dtype, device):
            # From bench/gemv_probe.py on the H200: one warp per 32 columns (64
            # registers); K split until >= 2048 programs run, and on until 3584 while a program
            # would hold more than 4 groups, and while it would hold more than 16 (the LM head:
            # 128256 x 4096 84 us at split 2, 99 unsplit); at most 32 ways, >= 1 group each.
            blocks = triton.cdiv(n, 32)
            split = 1
            while (
                split < 32
                and groups >= 2 * split
                and (
                    blocks * split < 2048
                    or (groups > 4 * split and blocks * split < 3584)
                    or groups > 16 * split
                )
            ):
                split *= 2
            if accumulate:
                # Adding into a float32 row, the scales a group ahead (capped at 72 registers,
                # no spills): see GemvH2Config.ahead.
                return GemvH2Config(32, split, 1, ahead=True)
            return GemvH2Config(block_n=32, split_k=split, num_warps=1)
        return GemvNConfig(block_n=64, split_k=split, num_warps=1)
    if m == 1:
        # The best of the sweep in bench/results/h200_quant.json (H200, Llama-3-8B shapes).
        return GemvConfig(block_n=8, block_w=256 if n >= 8192 else 128, split_k=1, num_warps=4)
    if m > 64 and n >= 8192:
        return GemmConfig(block_m=128, block_n=128, block_k=64, split_k=1, num_warps=8)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    # Split K while the grid is under two programs per SM and each split keeps >= 1024 inputs.
    while tiles * split < 2 * sms and k // (split * 2) >= 1024:
        split *= 2
    warps = 4 if block_m * block_n <= 64 * 64 else 8
    return GemmConfig(block_m=block_m, block_n=block_n, block_k=128, split_k=split, num_warps=warps)


def w4a16_matmul_triton(
    x: torch.Tensor,  # [M, K]
    w: QuantizedWeight,
    config: GemvConfig | GemvNConfig | GemvH2Config | GemvTCConfig | GemmConfig | None = None,
    xq: GemvX | None = None,
    accumulate: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ dequantize(w)^T with the Triton kernels; returns [M, N] in x's dtype. `xq`, x's
    GemvX form from its producer, is read instead of x when the launch is the packed-fp16 GEMV
    (it must fit x and w; other launches do not read it). `accumulate` (packed-fp16 GEMV only,
    see `gemv_accumulates`): a zeroed float32 [M, N] tensor the product is added into and
    returned as it is (its reader rounds it to x's dtype and zeroes it again). `out_dtype`
    float32: the x-dtype result widened to float32, stored so by the packed-fp16 GEMV itself
    (no cast launch), cast after the others."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of shape {w.shape}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = w.out_features
    per = 32 // w.bits
    kw = w.qweight.shape[1]
    if config is None:
        config = default_config(m, n, k, x.device, w, x.dtype, accumulate is not None)
    if accumulate is not None and not isinstance(config, GemvH2Config):
        raise ValueError(f"accumulate needs the packed-fp16 GEMV (GemvH2Config), not {config}")
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"out_dtype is x's dtype or float32, got {out_dtype}")
    if m == 0:
        return torch.empty((0, n), dtype=out_dtype or x.dtype, device=x.device)
    if isinstance(config, GemvH2Config):
        return launch_gemv_h2(x, w, config, xq, accumulate, out_dtype)[0]
    if out_dtype not in (None, x.dtype):
        return w4a16_matmul_triton(x, w, config, xq, accumulate).to(out_dtype)
    if isinstance(config, GemvNConfig):
        return launch_gemv_nmajor(x, w, config)[0]
    if isinstance(config, GemvTCConfig):
        return launch_gemv_tc(x, w, config)[0]
    if isinstance(config, GemvConfig):
        block_w = config.block_w
        words = triton.cdiv(triton.cdiv(kw, config.split_k), block_w) * block_w
        split = triton.cdiv(kw, words)
    else:
        block_w = config.block_k // per
        words = triton.cdiv(triton.cdiv(kw, config.split_k), block_w) * block_w
        split = triton.cdiv(kw, words)
    atomic = split > 1
    out = (
        torch.zeros((m, n), dtype=torch.float32, device=x.device)
        if atomic
        else torch.empty((m, n), dtype=x.dtype, device=x.device)
    )
    common = (w.qweight, w.scales, w.mins, out)
    if isinstance(config, GemvConfig):
        _gemv_kernel[(triton.cdiv(n, config.block_n), split, m)](
            x,
            *common,
            n,
            k,
            words,
            kw,
            x.stride(0),
            w.qweight.stride(0),
            w.qweight.stride(1),
            w.scales.stride(0),
            w.scales.stride(1),
            out.stride(0),
            BITS=w.bits,
            GROUP=w.group_size,
            BLOCK_N=config.block_n,
            BLOCK_W=block_w,
            ATOMIC=atomic,
            EVEN=n % config.block_n == 0 and kw % block_w == 0 and k == kw * per,
            num_warps=config.num_warps,
        )
    else:
        dot_fp32 = x.dtype == torch.float32 or not x.is_cuda
        grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), split)
        _gemm_kernel[grid](
            x,
            *common,
            m,
            n,
            k,
            words,
            kw,
            x.stride(0),
            w.qweight.stride(0),
            w.qweight.stride(1),
            w.scales.stride(0),
            w.scales.stride(1),
            out.stride(0),
            BITS=w.bits,
            GROUP=w.group_size,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            ATOMIC=atomic,
            DOT_FP32=dot_fp32,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    return out.to(x.dtype) if atomic else out


def _compiled_cuda(x: torch.Tensor) -> bool:
    """Triton compiles for the GPU (inline PTX allowed), rather than interpreting on the CPU."""
    return x.is_cuda and not kernel_config().interpreted


@dataclass
class _SplitLaunch:
    """What both N-major INT4 launches share: the output, the K split and its workspace."""

    out: torch.Tensor
    ws: torch.Tensor  # float32 [split, M, N] partial sums (the output when split == 1: not read)
    counters: torch.Tensor  # arrival counters (the output when split == 1: not read)
    groups: int
    per_split: int  # groups per program
    split: int  # programs along K (each with >= 1 group)
    blocks: int  # column blocks

    def args(self, x: torch.Tensor, w: QuantizedWeight) -> tuple:
        """The kernels' leading positional arguments, x to the output's row stride."""
        m, k = x.shape
        return (x, w.qweight, w.scales, w.mins, self.out, self.ws, self.counters, m,
                w.out_features, k, self.groups, self.per_split, self.split, x.stride(0),
                w.qweight.stride(1), w.scales.stride(1), self.out.stride(0))  # fmt: skip


def _split_launch(
    x: torch.Tensor,
    w: QuantizedWeight,
    block_n: int,
    split_k: int,
    row_blocks: int,
    name: str,
    out: torch.Tensor | None = None,  # the caller's float32 row, added into: no workspace
    out_dtype: torch.dtype | None = None,  # of the output allocated here (None: x's)
) -> _SplitLaunch:
    if w.bits != 4 or not is_n_major(w):
        raise ValueError(f"{name} needs INT4 codes stored N-major (see n_major)")
    if w.mins.stride(1) != w.scales.stride(1):
        raise ValueError("scales and zero points must share one layout")
    m, n = x.shape[0], w.out_features
    groups = w.scales.shape[1]
    per_split = triton.cdiv(groups, split_k)
    split = triton.cdiv(groups, per_split)
    blocks = triton.cdiv(n, block_n)
    atomic = out is not None
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if split > 1 and not atomic:
        ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device, row_blocks * blocks)
    else:
        ws = counters = out
    return _SplitLaunch(out, ws, counters, groups, per_split, split, blocks)


def launch_gemv_nmajor(x: torch.Tensor, w: QuantizedWeight, config: GemvNConfig):
    """(output, the compiled kernel launched): the latter for benchmarks that read its code."""
    m, k = x.shape
    n = w.out_features
    sl = _split_launch(x, w, config.block_n, config.split_k, m, "GemvNConfig")
    split = sl.split
    even = n % config.block_n == 0 and k == sl.groups * w.group_size
    compiled = _compiled_cuda(x)
    kernel = _gemv_nmajor_kernel[(sl.blocks, split, m)](
        *sl.args(x, w),
        GROUP=w.group_size,
        BLOCK_N=config.block_n,
        REDUCE=split > 1,
        SPLIT_P2=triton.next_power_of_2(split),
        EVEN=even,
        ASM=compiled,
        X_PAIRS=even
        and compiled
        and x.dtype == torch.bfloat16
        and x.data_ptr() % 4 == 0
        and x.stride(0) % 2 == 0,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl.launch_options(x),
    )
    return sl.out, kernel


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


def launch_gemv_tc(x: torch.Tensor, w: QuantizedWeight, config: GemvTCConfig):
    """(output, the compiled kernel launched) of `_gemv_tc_kernel`."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"GemvTCConfig needs bf16 activations, got {x.dtype}")
    m = x.shape[0]
    m_blocks = triton.cdiv(m, config.block_m)
    sl = _split_launch(x, w, config.block_n, config.split_k, m_blocks, "GemvTCConfig")
    kernel = _gemv_tc_kernel[(sl.blocks, sl.split, m_blocks)](
        *sl.args(x, w),
        GROUP=w.group_size,
        BLOCK_N=config.block_n,
        BLOCK_M=config.block_m,
        REDUCE=sl.split > 1,
        ONE_ROW=m == 1,
        ASM=_compiled_cuda(x),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl.launch_options(x),
    )
    return sl.out, kernel


def w4a16_matmul(
    x: torch.Tensor,
    w: QuantizedWeight,
    xq: GemvX | None = None,
    accumulate: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T: the Triton kernels on CUDA, the torch reference elsewhere. `xq`,
    `accumulate`, `out_dtype`: see `w4a16_matmul_triton`."""
    if not x.is_cuda:
        if accumulate is not None:
            raise ValueError("accumulate is for the CUDA GEMV")
        y = w4a16_matmul_ref(x, w)
        return y if out_dtype is None else y.to(out_dtype)
    lead = x.shape[:-1]
    y = w4a16_matmul_triton(
        x.reshape(-1, x.shape[-1]), w, xq=xq, accumulate=accumulate, out_dtype=out_dtype
    )
    return y.view(*lead, w.out_features)
