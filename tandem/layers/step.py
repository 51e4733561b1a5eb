"""What every layer of one forward pass shares: the batch's positions, KV cache and attention
metadata, and the choices made once per step rather than once per layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tandem.kernels.w4a16 import gemv_atomic_enabled

if TYPE_CHECKING:
    from tandem.kv.cache import KVCache
    from tandem.layers.attention import AttentionMetadata, CpuDecodeAttention, CpuVarlenAttention


@dataclass
class Step:
    """One forward pass over T packed tokens."""

    positions: torch.Tensor  # [T]
    kv: KVCache
    meta: AttentionMetadata
    dtype: torch.dtype  # the activations'
    cuda: bool  # the fused CUDA kernels run (else the CPU path)
    # A single CUDA row: RMSNorm and SiluAndMul also write x in the form their consumer's INT4
    # GEMV reads (`QuantLinear.gemv_x_form`).
    one_row: bool
    # One-row INT4 GEMVs add into float32 rows of their own that their readers round and zero
    # (`tandem.kernels.w4a16.gemv_accumulates`): the settings' part, checked once a step.
    accumulate: bool
    # Built by the first layer that needs them, then shared by every layer of the step.
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [T, 1, D/2]
    cpu_decode: CpuDecodeAttention | None = None
    cpu_varlen: CpuVarlenAttention | None = None
    # The float32 rows GEMVs added into this step: zeroed again if the step stops part-way.
    accumulators: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def begin(
        cls, positions: torch.Tensor, kv: KVCache, meta: AttentionMetadata, h: torch.Tensor
    ) -> Step:
        """The step whose first hidden states are h [T, H] (the token embeddings)."""
        one_row = h.shape[0] == 1 and h.is_cuda
        accumulate = one_row and gemv_atomic_enabled(h.dtype)
        return cls(positions, kv, meta, h.dtype, h.is_cuda, one_row, accumulate)

    def abort(self) -> None:
        """Undo what a step that stopped between a GEMV and its reader left behind: a float32 row
        left non-zero would be added onto by every later step (a capture that failed ran
        nothing, so there is nothing to undo)."""
        if self.accumulators and not torch.cuda.is_current_stream_capturing():
            for row in self.accumulators:
                row.zero_()
