"""The token embedding and the LM head: float or per-group integer tables (a recipe can quantize
`model.embed_tokens` and `lm_head`), one table for both when the embeddings are tied."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.formats.weight import QuantizedWeight, permute_rows
from tandem.kernels.cpu_int4 import CpuInt4Weight
from tandem.kernels.embedding import embed_dequant_triton
from tandem.kernels.gemv import linear_rows
from tandem.kernels.w4a16 import n_major, w4a16_matmul
from tandem.layers.linear import CpuWeight, cpu_linear, pack_cpu_weight

Table = torch.Tensor | QuantizedWeight

# The LM head through the INT4 kernel gives bfloat16 logits: at the magnitudes of a model's best
# logits (~10-30) their spacing is 0.06-0.125, so the two best tokens often come out exactly tied
# and greedy decoding picks by index. The best few are therefore computed again in float32
# from the stored codes (a gather of LOGIT_REFINE rows per token: microseconds).
LOGIT_REFINE = 16


def cpu_logits(x: torch.Tensor, head: CpuWeight, stored: Table) -> torch.Tensor:
    """Logits [T, vocab] float32 of hidden states x [T, H] on CPU: `head` is the LM head packed
    by `pack_cpu_weight`, `stored` the same weight unpacked (for the float32 recomputation of the
    best logits when `head` computes in bfloat16)."""
    logits = cpu_linear(x, head).float()
    if not isinstance(head, CpuInt4Weight) or not isinstance(stored, QuantizedWeight):
        return logits
    k = min(LOGIT_REFINE, logits.shape[-1])
    best = logits.topk(k, dim=-1).indices  # [T, k]
    rows = permute_rows(stored, best.reshape(-1)).dequantize(torch.float32)  # [T * k, H]
    exact = torch.bmm(rows.view(*best.shape, -1), x.float().unsqueeze(-1)).squeeze(-1)
    return logits.scatter_(1, best, exact)


class VocabEmbedding:
    """[T] token ids -> [T, H] in the model dtype; a quantized table is gathered row by row and
    only those rows are dequantized."""

    def __init__(self, weight: Table, dtype: torch.dtype) -> None:
        self.weight = weight  # [vocab, H]
        self.dtype = dtype

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):
            if input_ids.is_cuda:  # one launch (with PDL) instead of ~10 torch ops
                return embed_dequant_triton(self.weight, input_ids, self.dtype)
            return permute_rows(self.weight, input_ids).dequantize(self.dtype)
        return F.embedding(input_ids, self.weight)


class LMHead:
    """[N, H] hidden states -> [N, vocab] float32 logits: for several 16-bit rows on CUDA the
    GEMM's float32 accumulator, otherwise the model dtype's, widened."""

    def __init__(self, weight: Table, device: torch.device) -> None:
        self.weight = weight  # [vocab, H], as stored
        # CPU: packed for oneDNN / the CPU INT4 kernel (`pack_cpu_weight`), beside the stored
        # form (read again for the best logits, and by the lookup of a tied table).
        self.packed: CpuWeight = pack_cpu_weight(weight) if device.type == "cpu" else weight

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.is_cuda:
            if isinstance(self.weight, QuantizedWeight):  # the GEMV stores them so: no cast
                return w4a16_matmul(hidden, self.weight, out_dtype=torch.float32)
            if hidden.shape[0] > 1 and hidden.dtype != torch.float32:
                # cuBLAS stores its float32 accumulator: no 16-bit rounding and no widening
                # pass over [N, vocab] (H200, 128256 x 4096 at 256 rows: 390 against 467 us).
                return torch.mm(hidden, self.weight.t(), out_dtype=torch.float32)
            return linear_rows(hidden, self.weight).float()
        return cpu_logits(hidden, self.packed, self.weight)


def vocab_layers(
    table: Table, head: Table | None, dtype: torch.dtype, device: torch.device
) -> tuple[VocabEmbedding, LMHead]:
    """The embedding of `table` and the LM head of `head` (None: tied, the same table)."""
    tied = head is None
    head = table if head is None else head
    if device.type == "cuda" and isinstance(head, QuantizedWeight) and head.bits == 4:
        head = n_major(head)  # the lookup gathers rows of either layout
        if tied:
            table = head
    return VocabEmbedding(table, dtype), LMHead(head, device)
