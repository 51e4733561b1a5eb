"""What the W4A16 kernels share: the torch reference, code decoding and one-row program
helpers, the N-major layout, and the K-split launch of the N-major kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.config import kernel_config
from tandem.formats.weight import QuantizedWeight
from tandem.kernels._triton import tl, triton
from tandem.kernels.arrival import arrival_counters


def w4a16_matmul_ref(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [M, K] @ dequantize(w)^T in x's dtype: the plain-torch reference (used on CPU)."""
    return F.linear(x, w.dequantize(x.dtype))


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
