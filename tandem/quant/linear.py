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
) -> torch.Tensor:
    """x [..., K] @ w^T (+ bias) for a float weight [N, K] or a per-group integer one (`xq`:
    x's GemvX form, written by its producer for the INT4 GEMV)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    y = w4a16_matmul(x, w, xq)
    return y if bias is None else y + bias
