"""SwiGLU (silu(gate) * up) between gate_up and down, and its hand-off to down."""

from __future__ import annotations

import torch

from tandem.kernels.activation import silu_and_mul, silu_and_mul_gemv_x
from tandem.layers.linear import Accumulated, GemvInput, Linear
from tandem.layers.step import Step


class SiluAndMul:
    """[T, 2 I] -> silu(x[:, :I]) * x[:, I:]. `consumer` (down) says, as for `RMSNorm`, whether
    one CUDA row is also written in the form its INT4 GEMV reads."""

    def __init__(self, consumer: Linear) -> None:
        self.consumer = consumer

    def _group(self, dtype: torch.dtype) -> int | None:
        return self.consumer.gemv_x_form(dtype)[0]

    def takes_accumulator(self, step: Step) -> bool:
        """Only the kernel writing the GemvX form rounds and zeroes a GEMV's float32 row."""
        return self._group(step.dtype) is not None

    def __call__(self, gu: torch.Tensor | Accumulated, step: Step) -> torch.Tensor | GemvInput:
        """gu [T, 2 I] (gate_up's output) -> [T, I]."""
        acc_dtype = None
        if isinstance(gu, Accumulated):
            gu, acc_dtype = gu
        group = self._group(acc_dtype or gu.dtype) if step.one_row else None
        if group is None:
            return silu_and_mul(gu)
        return GemvInput(*silu_and_mul_gemv_x(gu, group, acc_dtype))
