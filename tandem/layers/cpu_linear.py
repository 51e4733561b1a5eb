"""The linear layer on CPU: each weight is packed once at load into the form its kernel reads.

- float32 weights: oneDNN's blocked layout (`torch.ops.mkldnn`), instead of F.linear (MKL
  sgemm). Measured on a 2-core AMD EPYC VM, one thread, SmolLM2-135M's linear
  layers + LM head: 73 -> 39 ms at 8 rows (a batch-8 decode step), 45 -> 37 ms at one row.
- per-group 4- and 8-bit weights (GGUF Q4_1 / Q8_0, `tandem quantize` outputs): the codes, read
  by PyTorch's CPU INT4 kernel (`tandem.kernels.cpu_int4`). On a 2-core Xeon VM,
  one thread, one row, SmolLM2-135M's Q4_1 layers take 6.5 ms of CPU time a
  token and its Q8_0 LM head 4.1 ms, against 20 + 10.5 ms in float32 through oneDNN.
- anything else (other dtypes, other group sizes): `tandem.quant.linear.linear`.
"""

from __future__ import annotations

import torch

from tandem.kernels.cpu_int4 import CpuInt4Weight, can_pack, int4_linear_cpu, pack_int4_cpu
from tandem.quant.format import QuantizedWeight, permute_rows
from tandem.quant.linear import linear

CPU_PACKED_LINEAR = torch.backends.mkldnn.is_available()

CpuWeight = torch.Tensor | QuantizedWeight | CpuInt4Weight


def pack_cpu_weight(w: CpuWeight) -> CpuWeight:
    """`w` [N, K] in the layout `cpu_linear` reads fastest: a float32 CPU tensor in oneDNN's
    blocked layout (opaque: only `cpu_linear` reads it), a per-group integer CPU weight in the
    CPU INT4 kernel's; anything else is returned as it is."""
    if isinstance(w, QuantizedWeight):
        return pack_int4_cpu(w) if can_pack(w) else w
    if (
        not CPU_PACKED_LINEAR
        or not isinstance(w, torch.Tensor)
        or w.device.type != "cpu"
        or w.dtype != torch.float32
        or w.is_mkldnn
    ):
        return w
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())


def cpu_linear(x: torch.Tensor, w: CpuWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` on CPU, x [T, K] times a weight packed by `pack_cpu_weight`."""
    if isinstance(w, CpuInt4Weight):
        return int4_linear_cpu(x, w, bias)
    if isinstance(w, torch.Tensor) and w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return linear(x, w, bias)


# The LM head through the INT4 kernel gives bfloat16 logits: at the magnitudes of a model's best
# logits (~10-30) their spacing is 0.06-0.125, so the two best tokens often come out exactly tied
# and greedy decoding picks by index. The best few are therefore computed again in float32
# from the stored codes (a gather of LOGIT_REFINE rows per token: microseconds).
LOGIT_REFINE = 16


def cpu_logits(
    x: torch.Tensor, head: CpuWeight, stored: torch.Tensor | QuantizedWeight
) -> torch.Tensor:
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
