"""Which W4A16 kernel serves a product and with what launch (`default_config`), and the entry
points (`w4a16_matmul`, `w4a16_matmul_triton`)."""

from __future__ import annotations

import torch

from tandem.config import kernel_config
from tandem.formats.weight import QuantizedWeight
from tandem.kernels._triton import triton
from tandem.kernels.w4a16._common import _num_sms, is_n_major, w4a16_matmul_ref
from tandem.kernels.w4a16.gemm import GemmConfig, _gemm_kernel
from tandem.kernels.w4a16.gemv import GemvConfig, GemvNConfig, _gemv_kernel, launch_gemv_nmajor
from tandem.kernels.w4a16.gemv_h2 import GemvH2Config, launch_gemv_h2
from tandem.kernels.w4a16.gemv_tc import GemvTCConfig, launch_gemv_tc
from tandem.kernels.w4a16.gemv_x import GemvX


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
    # N, K, packed words per K split and per row, then the strides of x, codes, scales and out.
    sizes = (n, k, words, kw, x.stride(0), *w.qweight.stride(), *w.scales.stride(), out.stride(0))
    if isinstance(config, GemvConfig):
        _gemv_kernel[(triton.cdiv(n, config.block_n), split, m)](
            x,
            *common,
            *sizes,
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
            *sizes,
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
