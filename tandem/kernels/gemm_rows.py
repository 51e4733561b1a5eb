"""y = x @ W^T for a few rows of x (decode batches, 2 <= M <= 256): a Triton GEMM that streams
the weight once, on the tensor cores, with programmatic dependent launch.

At decode batch sizes a linear layer is still a pass over its weight: 64 rows of x are 1.5% of
the bytes of a 4096-wide weight. The kernel is laid out for that pass:

- The weight is the dot's first operand: each program multiplies a [BLOCK_N, BLOCK_K] tile of W
  by x^T [BLOCK_K, BLOCK_M], so the matrix instruction's long side is the weight's BLOCK_N rows
  and its short side the batch (M padded to a power of 2 >= 16, at most 128; more rows take a
  second row block, the fastest grid axis, so both blocks of a column block run together and
  the second reads the weight tile from L2).
- The K loop is software-pipelined (num_stages tiles in flight per program).
- When the column blocks are too few to fill the multiprocessors (Llama-3-8B's o_proj: 32 of
  128 columns on 132), K is split over SPLIT_K programs. Each writes its float32 partial tile
  to a workspace and counts its arrival on the column block's counter (an acq_rel atomic,
  `tandem.kernels.arrival`); the last to arrive adds the partials in split order (the same sum
  whichever program is last), adds the bias, stores the output and re-zeroes the counter. No
  second kernel.
- With PDL, each program asks L2 for the first 64 KiB of its weight rows before its wait (no
  kernel writes weights) and reads x only after it, so those loads overlap the previous
  kernel's tail.

Tile shape, split and pipeline depth are chosen per (N, K, M bucket) by Triton's autotuner on the
first call (timed with the L2 cache flushed). The workspace of that first call is sized for
every config tried; later calls size it for the chosen one. Under the Triton interpreter (CPU
tensors) a fixed config runs instead.
"""

from __future__ import annotations

import torch

from tandem.config import kernel_config
from tandem.kernels import pdl
from tandem.kernels._triton import tl, triton
from tandem.kernels.arrival import arrival_counters
from tandem.kernels.attention_parts import prefetch_l2

MIN_ROWS = 2
MAX_ROWS = 256
MAX_BLOCK_M = 128
_SMEM_BYTES = 220 << 10  # a config's pipeline stages must fit in shared memory (H100/H200: 227 KiB)

# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)
_SHAPES = [
    (128, 128, 1, 4, 3),
    (128, 64, 1, 4, 5),
    (64, 128, 1, 4, 4),
    (64, 64, 1, 4, 6),
    (128, 64, 1, 8, 4),
    (128, 128, 1, 8, 3),
    (128, 128, 2, 4, 3),
    (64, 128, 2, 4, 4),
    (128, 128, 4, 4, 3),
    (128, 64, 4, 4, 4),
    (64, 128, 4, 4, 4),
    (128, 64, 8, 4, 4),
    (64, 128, 8, 4, 3),
    (64, 64, 8, 4, 4),
]
_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}, num_warps=nw, num_stages=ns)
    for bn, bk, sk, nw, ns in _SHAPES
]


def _usable(
    cfg: triton.Config, n: int, k: int, block_m: int, m_blocks: int, elem: int, sms: int
) -> bool:
    """Whether the autotuner should try `cfg` for this shape: its stages fit in shared memory,
    and it splits K only where the unsplit grid leaves multiprocessors idle, into splits of at
    least two tiles, with at most four programs per multiprocessor in all, and with at most 64
    accumulator registers per thread (the merge holds the sum and the partials it loads; more
    spills)."""
    bn, bk, sk = cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_K"], cfg.kwargs["SPLIT_K"]
    if cfg.num_stages * (bn + block_m) * bk * elem > _SMEM_BYTES:
        return False
    if sk == 1:
        return True
    tiles = m_blocks * triton.cdiv(n, bn)
    return (
        tiles < sms
        and tiles * sk <= 4 * sms
        and triton.cdiv(k, bk) >= 2 * sk
        and bn * block_m <= 64 * 32 * cfg.num_warps
    )


_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


# Where no config above fits (float32 x in row blocks of 128): small tiles, two stages.
_FALLBACK = triton.Config({"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 1}, num_warps=4, num_stages=2)


def _candidates(x: torch.Tensor, n: int, k: int, block_m: int) -> list:
    """The configs the autotuner tries for x [M, K] times an [n, k] weight."""
    m_blocks = triton.cdiv(x.shape[0], block_m)
    sms = _num_sms(x.device)
    keep = [c for c in _CONFIGS if _usable(c, n, k, block_m, m_blocks, x.element_size(), sms)]
    return keep or [_FALLBACK]


def _prune(configs: list, named_args: dict, **kwargs) -> list:
    """The autotuner's early prune: `_candidates` for the launch's shape."""
    x = named_args["x_ptr"]
    return _candidates(x, named_args["N"], named_args["K"], kwargs["BLOCK_M"])


@triton.jit
def _store_out(out_ptr, bias_ptr, acc, offs_m, offs_n, m_mask, n_mask, N, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (+ bias) into out [M, N] (row-major) in out's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


# One compiled kernel for every row count (M only masks).
@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _gemm_rows_kernel(
    x_ptr,  # [M, K], any strides
    w_ptr,  # [N, K], unit stride along K
    bias_ptr,  # [N] contiguous, read only when HAS_BIAS
    out_ptr,  # [M, N] contiguous
    ws_ptr,  # float32 partial tiles [SPLIT_K, n_blocks, m_blocks, BLOCK_N, BLOCK_M] (SPLIT_K > 1)
    cnt_ptr,  # int32 [n_blocks * m_blocks] arrival counters, zero between calls (SPLIT_K > 1)
    M,
    N,
    K,
    M_BUCKET,  # M rounded up to a power of 2: a key of the autotuner, unused here
    stride_xm,
    stride_xk,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows of x per program: a power of 2, 16 to 128
    DOT_FP32: tl.constexpr,  # upcast both operands and multiply in float32 (no TF32)
    PREFETCH: tl.constexpr,  # ask L2 for the first weight tiles before the PDL wait
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # This program's K range: whole BLOCK_K tiles; the last split may be short or empty.
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    if PREFETCH:
        # Before the wait only the weight is read (no kernel writes it): 64 KiB of the
        # program's rows, one address per 128-byte line (64 16-bit values), into L2, holding
        # no registers; the pipelined loads after the wait then find it there.
        PRE_K: tl.constexpr = 32768 // BLOCK_N
        lines = k_start + tl.arange(0, PRE_K // 64) * 64
        want = n_mask[:, None] & (lines < k_end)[None, :]
        prefetch_l2((w_rows + lines[None, :]).to(tl.int64), want.to(tl.int32))
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        xk = tl.load(
            x_rows + offs_k[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        if DOT_FP32:
            # The interpreter (CPU tensors) stores bf16 as raw 16-bit integers and its dot
            # would multiply those, so it multiplies float32 values; so do float32 inputs.
            acc = tl.dot(w.to(tl.float32), tl.trans(xk.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(xk), acc)

    if SPLIT_K == 1:
        _store_out(out_ptr, bias_ptr, acc, offs_m, offs_n, m_mask, n_mask, N, HAS_BIAS)
    else:
        TILE: tl.constexpr = BLOCK_N * BLOCK_M
        tiles = tl.num_programs(0) * tl.num_programs(1)  # tiles per split
        tile = pid_n * tl.num_programs(0) + pid_m
        in_tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        first = ws_ptr + tile.to(tl.int64) * TILE + in_tile  # split 0's partial of this tile
        step = tiles.to(tl.int64) * TILE  # from one split's partial to the next
        tl.store(first + pid_k * step, acc)
        tl.debug_barrier()  # every thread's partials are written before the counter moves
        cnt = cnt_ptr + tile
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            # The sum in split order (the same whichever program is last), its own partial read
            # back too (holding it in registers through the loads spills them). The loads are
            # unrolled, so several are in flight at once, and bypass L1 (.cg): other programs
            # wrote them.
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for sk in tl.static_range(SPLIT_K):
                total += tl.load(first + sk * step, cache_modifier=".cg")
            _store_out(out_ptr, bias_ptr, total, offs_m, offs_n, m_mask, n_mask, N, HAS_BIAS)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next call


# (N, K, M bucket, x dtype, bias dtype) -> the config the autotuner chose: it sizes the split-K
# workspace of later calls. The autotuner's own cache has the same key (it adds every tensor
# argument's dtype; the rest are fixed by x's).
_CHOSEN: dict[tuple, triton.Config] = {}


def _compiled(x: torch.Tensor) -> bool:
    """Triton compiles for the GPU, rather than interpreting on the CPU."""
    return x.is_cuda and not kernel_config().interpreted


def _key(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    m_bucket = triton.next_power_of_2(x.shape[0])
    return (w.shape[0], x.shape[1], m_bucket, x.dtype, None if bias is None else bias.dtype)


def _interpreter_config(k: int) -> triton.Config:
    """The config run under the interpreter (which cannot time configs): 64 x 64 tiles, K split
    in two once it holds four tiles, so both epilogues run on CPU too."""
    split = 2 if k >= 4 * 64 else 1
    return triton.Config({"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": split}, num_warps=4)


def _workspace_elems(cfg: triton.Config, n: int, block_m: int, m_blocks: int) -> int:
    """Float32 partials of a K split: a BLOCK_N x BLOCK_M tile per split and output block."""
    split, bn = cfg.kwargs["SPLIT_K"], cfg.kwargs["BLOCK_N"]
    return 0 if split == 1 else split * m_blocks * triton.cdiv(n, bn) * bn * block_m


def _block_m(m: int) -> int:
    return min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))


def gemm_rows_config(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> dict | None:
    """The config `gemm_rows_triton(x, w, bias)` runs (tile shape, K split, warps, stages), or
    None where the autotuner has not chosen one yet for this shape."""
    if _compiled(x):
        cfg = _CHOSEN.get(_key(x, w, bias))
        if cfg is None:
            return None
    else:
        cfg = _interpreter_config(x.shape[1])
    return {
        **cfg.kwargs,
        "BLOCK_M": _block_m(x.shape[0]),
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }


def gemm_rows_triton(
    x: torch.Tensor,  # [M, K], 2 <= M <= 256
    w: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    _config: triton.Config | None = None,  # a fixed config instead of the autotuner's (tests)
) -> torch.Tensor:
    """[M, K] @ [N, K]^T (+ bias) -> [M, N] in x's dtype, float32 accumulation."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(
            f"gemm_rows takes x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    m, k = x.shape
    n = w.shape[0]
    if not MIN_ROWS <= m <= MAX_ROWS:
        raise ValueError(
            f"gemm_rows takes {MIN_ROWS} to {MAX_ROWS} rows, got {m} "
            "(one row: gemv_triton; more: F.linear)"
        )
    if w.shape[1] != k:
        raise ValueError(f"x has {k} columns, weight has {w.shape[1]}")
    if n == 0 or k == 0:
        raise ValueError(f"empty weight of shape {tuple(w.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"gemm_rows takes float16, bfloat16 or float32 x, got {x.dtype}")
    if w.dtype != x.dtype:
        raise ValueError(f"x and weight dtypes differ: {x.dtype} and {w.dtype}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device}, weight on {w.device}")
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
        if not bias.is_floating_point() or bias.device != x.device:
            raise ValueError(f"bias must be floating point on {x.device}")
        bias = bias.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()

    compiled = _compiled(x)
    block_m = _block_m(m)
    m_blocks = triton.cdiv(m, block_m)
    key = _key(x, w, bias)
    if _config is not None:
        cfg = _config
    elif not compiled:
        cfg = _interpreter_config(k)
    else:
        cfg = _CHOSEN.get(key)  # None: the autotuner's first call for this shape
    # Room for the config that runs, or on the autotuner's first call for every one it tries.
    runs = [cfg] if cfg is not None else _candidates(x, n, k, block_m)
    ws_elems = max(_workspace_elems(c, n, block_m, m_blocks) for c in runs)
    tiles = m_blocks * max(triton.cdiv(n, c.kwargs["BLOCK_N"]) for c in runs)

    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    # Always float32 and int32 tensors: the autotuner's key holds every tensor argument's dtype.
    ws = torch.empty(max(ws_elems, 1), dtype=torch.float32, device=x.device)
    counters = arrival_counters(x.device, tiles)
    opts = pdl.launch_options(x)
    args = (x, w, bias if bias is not None else out, out, ws, counters, m, n, k, key[2],
            x.stride(0), x.stride(1), w.stride(0))  # fmt: skip
    meta = dict(
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        DOT_FP32=x.dtype == torch.float32 or not compiled,
        PREFETCH=opts["PDL"] and x.element_size() == 2,
        **opts,
    )
    grid = lambda meta: (m_blocks, triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
    if compiled and _config is None:
        _gemm_rows_tuned[grid](*args, **meta)
        _CHOSEN.setdefault(key, _gemm_rows_tuned.best_config)
    else:
        _gemm_rows_kernel[grid](
            *args, **meta, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages
        )
    return out


_gemm_rows_tuned = triton.autotune(
    configs=_CONFIGS,
    key=["N", "K", "M_BUCKET"],
    prune_configs_by={"early_config_prune": _prune},
)(_gemm_rows_kernel)
