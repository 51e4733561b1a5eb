"""RMSNorm with the residual add fused in, and the hand-off to the linear layer reading it."""

from __future__ import annotations

import torch

from tandem.kernels.rmsnorm import rmsnorm, rmsnorm_gemv_x
from tandem.layers.linear import Accumulated, GemvInput, Linear
from tandem.layers.step import Step


class RMSNorm:
    """residual += h; x = RMSNorm(residual) (transformers' cast order: normalize in float32,
    cast, then scale). `consumer`, the linear layer reading x, says on a one-row CUDA step
    whether the norm also writes x in the form its INT4 GEMV reads (`gemv_x_form`), in the same
    pass."""

    def __init__(self, weight: torch.Tensor, eps: float, consumer: Linear | None = None) -> None:
        self.weight = weight  # [H]
        self.eps = eps
        self.consumer = consumer

    def takes_accumulator(self, step: Step) -> bool:
        """The norm kernel rounds and zeroes a GEMV's float32 row (`acc_input`) on every step."""
        return True

    def __call__(
        self, h: torch.Tensor | Accumulated, residual: torch.Tensor | None, step: Step
    ) -> tuple[torch.Tensor | GemvInput, torch.Tensor]:
        """h [T, H], the branch output (the token embeddings in the first layer; residual None
        then) -> (x, the new residual stream)."""
        acc_input = isinstance(h, Accumulated)
        dtype = h.dtype  # an Accumulated row's: the dtype it is rounded to
        if acc_input:
            h = h.row
        group = order = None
        if step.one_row and self.consumer is not None:
            group, order = self.consumer.gemv_x_form(dtype)
        if group is None:
            return rmsnorm(h, self.weight, self.eps, residual, acc_input)
        # An act-order consumer's form is written in its input order, in the same pass.
        x, residual, xq = rmsnorm_gemv_x(
            h, self.weight, self.eps, residual, group, acc_input, order
        )
        return GemvInput(x, xq), residual
