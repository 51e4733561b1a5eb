"""W4A16 / W8A16 matrix multiply: Triton kernels (CUDA) beside the torch reference (CPU).

y[M, N] = x[M, K] @ W^T with W held as per-group integer codes (see `tandem.formats.weight`):
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

Modules: `gemv` (the FFMA one-row GEMVs), `gemv_h2` (the packed-fp16 one), `gemv_x` (the x form
it reads from its producer), `gemv_tc` (tensor cores), `gemm` (tiled), `dispatch` (which kernel
and launch serves a product; the entry points), `_common` (what they share).
"""

from tandem.kernels.w4a16._common import is_n_major, n_major, w4a16_matmul_ref
from tandem.kernels.w4a16.dispatch import (
    default_config,
    gemv_accumulates,
    gemv_atomic_enabled,
    gemv_x_group,
    h2_eligible,
    h2_weight,
    w4a16_matmul,
    w4a16_matmul_triton,
)
from tandem.kernels.w4a16.gemm import GemmConfig
from tandem.kernels.w4a16.gemv import GemvConfig, GemvNConfig, launch_gemv_nmajor
from tandem.kernels.w4a16.gemv_h2 import GemvH2Config, launch_gemv_h2
from tandem.kernels.w4a16.gemv_tc import GemvTCConfig, launch_gemv_tc
from tandem.kernels.w4a16.gemv_x import GemvX, gemv_x_ref, store_gemv_x

__all__ = [
    "GemmConfig",
    "GemvConfig",
    "GemvH2Config",
    "GemvNConfig",
    "GemvTCConfig",
    "GemvX",
    "default_config",
    "gemv_accumulates",
    "gemv_atomic_enabled",
    "gemv_x_group",
    "gemv_x_ref",
    "h2_eligible",
    "h2_weight",
    "is_n_major",
    "launch_gemv_h2",
    "launch_gemv_nmajor",
    "launch_gemv_tc",
    "n_major",
    "store_gemv_x",
    "w4a16_matmul",
    "w4a16_matmul_ref",
    "w4a16_matmul_triton",
]
