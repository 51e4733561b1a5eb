"""Linear layers: each owns its weight in the form its kernel reads, its bias, its act-order input
permutation, and (INT4 on CUDA) the float32 row its one-row GEMV adds into.

- `Linear`: a float weight (bf16 / fp16 / fp32). CUDA: the Triton GEMV for one row, F.linear
  otherwise; CPU: oneDNN.
- `QuantLinear`: a per-group INT4 / INT8 `QuantizedWeight`. CUDA: `tandem.kernels.w4a16`
  (stored N-major for INT4, the layout the one-row kernel reads fastest); CPU: PyTorch's CPU
  INT4 kernel where it serves the format.

On a CPU each weight is packed once at load into the form its kernel reads:
- float32 weights: oneDNN's blocked layout (`torch.ops.mkldnn`), instead of F.linear (MKL
  sgemm). Measured on a 2-core AMD EPYC VM, one thread, SmolLM2-135M's linear
  layers + LM head: 73 -> 39 ms at 8 rows (a batch-8 decode step), 45 -> 37 ms at one row.
- per-group 4- and 8-bit weights (GGUF Q4_1 / Q8_0, `tandem quantize` outputs): the codes, read
  by PyTorch's CPU INT4 kernel (`tandem.kernels.cpu_int4`). On a 2-core Xeon VM,
  one thread, one row, SmolLM2-135M's Q4_1 layers take 6.5 ms of CPU time a
  token and its Q8_0 LM head 4.1 ms, against 20 + 10.5 ms in float32 through oneDNN.
- anything else (other dtypes, other group sizes): `linear`.

Hand-offs with the neighbouring layers (both decided here, by the linear):
- its input: the layer before it (RMSNorm, SiluAndMul) asks `gemv_x_form` whether to write x in
  the form the one-row INT4 GEMV reads (in the act-order input order, if any), and passes it as
  a `GemvInput`; decode attention stores its output in the input order (`input_places`) and
  passes an `InOrder`; any other input is gathered into the input order here;
- its output: on one-row steps an INT4 GEMV adds into its float32 row when its `reader` can
  round that row itself (`takes_accumulator`); it then returns an `Accumulated`.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from tandem.formats.weight import QuantizedWeight
from tandem.kernels.cpu_int4 import CpuInt4Weight, can_pack, int4_linear_cpu, pack_int4_cpu
from tandem.kernels.gemv import linear_rows
from tandem.kernels.w4a16 import GemvX, gemv_x_group, h2_weight, n_major, w4a16_matmul
from tandem.layers.step import Step

CPU_PACKED_LINEAR = torch.backends.mkldnn.is_available()

CpuWeight = torch.Tensor | QuantizedWeight | CpuInt4Weight


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


class GemvInput(NamedTuple):
    """A linear layer's input x [1, K] together with its GemvX form, both written by the layer
    before it in one pass (`QuantLinear.gemv_x_form`)."""

    x: torch.Tensor
    xq: GemvX


class InOrder(NamedTuple):
    """A linear layer's input x [T, K] already in its input order (`Linear.input_places`),
    stored so by the layer before it."""

    x: torch.Tensor


class Accumulated(NamedTuple):
    """A linear layer's output left in the float32 row its GEMV added into: the reader rounds it
    to `dtype` as the GEMV would have stored it, and zeroes the row for the next step."""

    row: torch.Tensor  # [1, N] float32
    dtype: torch.dtype


class AccumulatorReader(Protocol):
    """A layer that reads a linear layer's output and may round an `Accumulated` row itself."""

    def takes_accumulator(self, step: Step) -> bool: ...


class Linear:
    """y = x @ W^T (+ bias) for a float weight [N, K]."""

    quantized = False

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        input_perm: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.weight: CpuWeight = weight
        self.bias = bias
        # Act-order checkpoints (`tandem.model.external_quant`): weight columns stored grouped, the
        # input read in this order [K] (None: in order). Producers that can write x in that
        # order take it as int32: `input_order` (x[perm], gathered) or `input_places` (where
        # each element of x goes, the inverse, scattered).
        self.input_perm = input_perm
        self.input_order = self.input_places = None
        if input_perm is not None:
            self.input_order = input_perm.to(torch.int32)
            self.input_places = torch.argsort(input_perm).to(torch.int32)
        # The layer reading this one's output (see `QuantLinear`); a float GEMV never adds
        # into a float32 row, so it is only recorded.
        self.reader: AccumulatorReader | None = None
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        if torch.device(device).type == "cpu":
            self.weight = pack_cpu_weight(weight)

    def gemv_x_form(self, x_dtype: torch.dtype) -> tuple[int | None, torch.Tensor | None]:
        """(group, order) of the GemvX form this layer's one-row product reads from x of
        `x_dtype`: group None when it reads plain x (every float weight); order the int32
        permutation the form is written in (None: x's own)."""
        return None, self.input_order

    def _input(self, x: torch.Tensor | GemvInput | InOrder) -> tuple[torch.Tensor, GemvX | None]:
        """x as this layer reads it: in its input order, beside its GemvX form if written. A
        GemvX form is written in the input order already (the GEMV reads only it), as is an
        `InOrder` x; any other x is gathered here."""
        if isinstance(x, GemvInput):
            return x
        if isinstance(x, InOrder):
            return x.x, None
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        return x, None

    def __call__(self, x: torch.Tensor | GemvInput, step: Step) -> torch.Tensor | Accumulated:
        """x [T, K] -> [T, N] in x's dtype."""
        x, _ = self._input(x)
        if not step.cuda:
            return cpu_linear(x, self.weight, self.bias)
        return linear_rows(x, self.weight, self.bias)


class QuantLinear(Linear):
    """y = x @ W^T (+ bias) for a per-group integer weight (`tandem.formats.weight`)."""

    quantized = True

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None = None,
        input_perm: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        cuda = torch.device(device).type == "cuda"
        if cuda and weight.bits == 4:
            weight = n_major(weight)  # the layout the one-row W4A16 kernel reads fastest
        super().__init__(weight, bias, input_perm, device)  # type: ignore[arg-type]
        # One-row decode steps with bf16 activations: the packed-fp16 GEMV adds into this
        # float32 row (see `w4a16.gemv_accumulates`), which its reader rounds and zeroes again,
        # so it is zero between steps; allocated here, outside any CUDA graph capture.
        self.acc_row: torch.Tensor | None = None
        if cuda and dtype == torch.bfloat16 and h2_weight(weight, weight.in_features):
            self.acc_row = torch.zeros(1, weight.out_features, dtype=torch.float32, device=device)

    def gemv_x_form(self, x_dtype: torch.dtype) -> tuple[int | None, torch.Tensor | None]:
        return gemv_x_group(self.weight, x_dtype), self.input_order

    def __call__(self, x: torch.Tensor | GemvInput, step: Step) -> torch.Tensor | Accumulated:
        x, xq = self._input(x)
        if not step.cuda:
            return cpu_linear(x, self.weight, self.bias)
        acc = None
        if (
            step.accumulate
            and self.acc_row is not None
            and self.bias is None  # the reader adds nothing
            and self.reader is not None
            and self.reader.takes_accumulator(step)
        ):
            acc = self.acc_row
            step.accumulators.append(acc)
        y = linear(x, self.weight, self.bias, xq, acc)
        return y if acc is None else Accumulated(y, x.dtype)


def linear_layer(
    weight: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None = None,
    input_perm: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Linear:
    """The linear layer serving `weight` (already on `device`), activations of `dtype`."""
    if isinstance(weight, QuantizedWeight):
        return QuantLinear(weight, bias, input_perm, device, dtype)
    return Linear(weight, bias, input_perm, device)
