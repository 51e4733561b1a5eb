"""The linear layer of the model: float weights through F.linear, quantized ones through W4A16."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.w4a16 import GemvX, w4a16_matmul
from tandem.quant.format import QuantizedWeight


def linear(
    x: torch.Tensor,
    w: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None = None,
    xq: GemvX | None = None,
    accumulate: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ w^T (+ bias) for a float weight [N, K] or a per-group integer one (`xq`:
    x's GemvX form, written by its producer for the INT4 GEMV; `accumulate`: a zeroed float32
    row the INT4 GEMV adds into, see `tandem.kernels.w4a16.gemv_accumulates`)."""
    if isinstance(w, torch.Tensor):
        if accumulate is not None:
            raise ValueError("accumulate is for quantized weights")
        return F.linear(x, w, bias)
    if accumulate is not None and bias is not None:
        raise ValueError("accumulate takes no bias (the reader adds nothing)")
    y = w4a16_matmul(x, w, xq, accumulate)
    return y if bias is None else y + bias
