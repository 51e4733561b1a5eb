"""AWQ, GPTQ and compressed-tensors checkpoints (tandem.model.external_quant) against independent packers.

The AWQ and GPTQ packers below follow the writers' own packing loops (AutoAWQ's
`WQLinear_GEMM.from_linear`, AutoGPTQ's `QuantLinear.pack`) in numpy, word by word; the
compressed-tensors checkpoints are written by the `compressed-tensors` package itself. Loaded
layers are checked against the float64 dequantization of the integer grid, and a tiny Llama's
greedy tokens against transformers.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import tandem
from tandem.formats.weight import QuantizedWeight
from tandem.model.external_quant import UnsupportedQuantization, check_quantization_config

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ GEMM, 4 bits


# ----------------------------------------------------------------------------- reference grids


def rtn_grid(w: torch.Tensor, bits: int, g: int, sym: bool, g_idx: torch.Tensor):
    """Round-to-nearest integer grid of w [N, K] in float64 with group `g_idx[k]` for channel k:
    codes q [N, K], zero points z [N, G] and FP16-exact scales s [N, G] (float64)."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    levels = (1 << bits) - 1
    wd = w.double()
    s = torch.empty(n, groups, dtype=torch.float64)
    z = torch.empty(n, groups, dtype=torch.int64)
    for j in range(groups):
        cols = wd[:, g_idx == j]
        if sym:
            sc = cols.abs().amax(1) / (levels // 2)
            z[:, j] = 1 << (bits - 1)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            sc = (hi - lo) / levels
            z[:, j] = torch.round(-lo / sc.half().double()).clamp(0, levels).long()
        s[:, j] = sc.half().double()
    zc, sc = z[:, g_idx], s[:, g_idx]
    q = torch.round(wd / sc + zc).clamp(0, levels).long()
    return q, z, s


def dequant64(q, z, s, g_idx) -> torch.Tensor:
    return (q - z[:, g_idx]).double() * s[:, g_idx]


def act_order_g_idx(k: int, g: int, gen: torch.Generator) -> torch.Tensor:
    """GPTQ's act-order g_idx: channels quantized in a permuted order, `g` at a time."""
    perm = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // g
    return g_idx


# ----------------------------------------------------------------------------- packers


def pack_awq(q, z, s) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM: qweight [K, N/8], qzeros [G, N/8], scales [G, N] (fp16)."""

    def pack(intweight: np.ndarray) -> np.ndarray:  # [R, N] -> [R, N / 8]
        out = np.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=np.uint32)
        for col in range(intweight.shape[1] // 8):
            for i in range(8):
                out[:, col] |= intweight[:, col * 8 + AWQ_ORDER_MAP[i]] << np.uint32(4 * i)
        return out

    qweight = pack(q.t().numpy().astype(np.uint32))
    qzeros = pack(z.t().numpy().astype(np.uint32))
    return {
        "qweight": torch.from_numpy(qweight.view(np.int32)),
        "qzeros": torch.from_numpy(qzeros.view(np.int32)),
        "scales": s.t().to(torch.float16).contiguous(),
    }


def pack_gptq(q, z, s, g_idx, bits: int, v2: bool = False) -> dict[str, torch.Tensor]:
    """AutoGPTQ: qweight [K*bits/32, N] (input rows packed), qzeros [G, N*bits/32] holding
    z - 1 (z in checkpoint_format gptq_v2), scales [G, N] (fp16), g_idx [K] (int32)."""
    per = 32 // bits
    intweight = q.t().numpy().astype(np.uint32)  # [K, N]
    qweight = np.zeros((intweight.shape[0] // per, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + per):
            qweight[row] |= intweight[j] << np.uint32(bits * (j - i))
        i += per
        row += 1
    zeros = z.t().numpy().astype(np.int64) - (0 if v2 else 1)
    zeros = (zeros & ((1 << bits) - 1)).astype(np.uint32)  # [G, N]
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // per), dtype=np.uint32)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + per):
            qzeros[:, col] |= zeros[:, j] << np.uint32(bits * (j - i))
        i += per
        col += 1
    return {
        "qweight": torch.from_numpy(qweight.view(np.int32)),
        "qzeros": torch.from_numpy(qzeros.view(np.int32)),
        "scales": s.t().to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def ct_scheme(bits: int, g: int, sym: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = "channel" if g == -1 else "group"
    args = QuantizationArgs(
        num_bits=bits,
        type="int",
        symmetric=sym,
        strategy=strategy,
        group_size=None if g == -1 else g,
    )
    return QuantizationScheme(targets=["Linear"], weights=args)


def ct_config(bits: int, g: int, sym: bool, actorder: str | None = None) -> dict:
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig(
        config_groups={"group_0": ct_scheme(bits, g, sym)},
        format="pack-quantized",
        ignore=["lm_head"],
        quantization_status="compressed",
    ).to_dict()
    if actorder:  # the older releases' activation ordering with weight_g_idx
        qc["config_groups"]["group_0"]["weights"]["actorder"] = actorder
    return qc


def pack_ct(q, z, s, g_idx, bits: int, g: int, sym: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized, written by the package: its compressor when groups are
    contiguous, its int32 packer with an act-order g_idx (the compressor has no g_idx)."""
    from compressed_tensors.compressors.pack_quantized import (
        PackedQuantizationCompressor,
        pack_to_int32,
    )

    mid = 1 << (bits - 1)
    zp = (z - mid).to(torch.int8)  # signed zero points, as compressed-tensors keeps them
    contiguous = g == -1 or torch.equal(g_idx, torch.arange(q.shape[1]) // g)
    if contiguous:
        state = {
            "weight": dequant64(q, z, s, g_idx).float(),
            "weight_scale": s.float(),
            "weight_zero_point": zp,
        }
        out = dict(PackedQuantizationCompressor.compress(state, ct_scheme(bits, g, sym)))
    else:
        out = {
            "weight_packed": pack_to_int32((q - mid).to(torch.int8), bits),
            "weight_scale": s.float(),
            "weight_shape": torch.tensor(q.shape),
            "weight_g_idx": g_idx.to(torch.int32),
        }
        if not sym:
            out["weight_zero_point"] = pack_to_int32(zp, bits, packed_dim=0)
    return out


FORMATS = ["awq", "gptq", "gptq_v2", "gptq_act_order", "ct", "ct_asym", "ct_act_order"]


def case(fmt: str, q, z, s, g_idx, bits: int, g: int, sym: bool):
    """(tensors of one layer, quantization_config) for format `fmt`."""
    if fmt == "awq":
        return pack_awq(q, z, s), {
            "quant_method": "awq",
            "bits": bits,
            "group_size": g,
            "zero_point": True,
            "version": "gemm",
        }
    if fmt.startswith("gptq"):
        v2 = fmt == "gptq_v2"
        qc = {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": g,
            "desc_act": fmt == "gptq_act_order",
            "sym": sym,
        }
        if v2:
            qc["checkpoint_format"] = "gptq_v2"
        return pack_gptq(q, z, s, g_idx, bits, v2), qc
    qc = ct_config(bits, g, sym, "group" if fmt == "ct_act_order" else None)
    return pack_ct(q, z, s, g_idx, bits, g, sym), qc


def grid_for(fmt: str, w: torch.Tensor, bits: int, g: int, gen: torch.Generator):
    """The integer grid a checkpoint of `fmt` would hold for w (group -1: one per row)."""
    k = w.shape[1]
    sym = fmt in ("ct", "ct_act_order", "gptq_act_order")
    if fmt.endswith("act_order"):
        g_idx = act_order_g_idx(k, g, gen)
    else:
        g_idx = torch.arange(k) // (k if g == -1 else g)
    return (*rtn_grid(w, bits, g, sym, g_idx), g_idx, sym)


# ----------------------------------------------------------------------------- layer tests


def _load(weights: dict, qc: dict, path: str = "ckpt"):
    from tandem.model.external_quant import load_external

    return load_external(weights, qc, path, torch.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("bits", "g", "n", "k"), [(4, 32, 48, 96), (4, 128, 16, 256),
                                                  (4, 256, 8, 512), (4, -1, 24, 72),
                                                  (8, 64, 16, 128)])  # fmt: skip
def test_layer_matches_float64_dequantization(fmt, bits, g, n, k) -> None:
    """Each format's packed layer loads as the same grid: q * scale + min equals the stored
    (q - z) * s exactly for symmetric groups, within half an FP16 unit of z * s otherwise."""
    if (fmt == "awq" and bits != 4) or (fmt.endswith("act_order") and g == -1):
        pytest.skip("AWQ is 4-bit only; act-order needs groups")
    gen = torch.Generator().manual_seed(k + n + bits)
    w = torch.randn(n, k, generator=gen) * 0.05
    q, z, s, g_idx, sym = grid_for(fmt, w, bits, g, gen)
    tensors, qc = case(fmt, q, z, s, g_idx, bits, g, sym)
    out = _load({f"layer.{name}": t for name, t in tensors.items()}, qc)
    qw = out.pop("layer.weight")
    perm = out.pop("layer.input_perm", None)
    assert not out, f"unconsumed tensors {sorted(out)}"
    assert isinstance(qw, QuantizedWeight) and qw.bits == bits and qw.in_features == k
    assert qw.group_size in (32, 64, 128)
    assert (perm is not None) == fmt.endswith("act_order")
    got = qw.dequantize(torch.float64)
    if perm is not None:  # stored W[:, perm]: put the columns back
        got = got[:, torch.argsort(perm)]
    ref = dequant64(q, z, s, g_idx)
    if sym:
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    else:
        zs = (z[:, g_idx] * s[:, g_idx]).abs()
        half_ulp = torch.finfo(torch.float16).eps / 2 * zs + 2**-25
        assert ((got - ref).abs() <= half_ulp).all()


def test_awq_packing_order_is_not_sequential() -> None:
    """The AWQ loader reads the interleaved order: one code written by the reference packer
    at column 1 must come back at column 1 (sequential unpacking would put it at column 4)."""
    q = torch.zeros(8, 32, dtype=torch.int64)
    q[1, :] = 5
    z = torch.full((8, 1), 0, dtype=torch.int64)
    s = torch.ones(8, 1, dtype=torch.float64)
    tensors, qc = case("awq", q, z, s, torch.zeros(32, dtype=torch.long), 4, 32, False)
    qw = _load({f"x.{k}": v for k, v in tensors.items()}, qc)["x.weight"]
    assert torch.equal(qw.codes()[:, :32], q.int())


@pytest.mark.parametrize(
    ("qc", "message"),
    [
        ({"quant_method": "bitsandbytes"}, "quant_method = 'bitsandbytes'"),
        ({"quant_method": "fp8"}, "quant_method = 'fp8'"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits = 3"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "group_size = 48"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "group_size = 16"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
            "checkpoint_format = 'marlin'",
        ),
        ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits = 8"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False},
            "zero_point = False",
        ),
    ],
)
def test_unsupported_configs_are_refused_by_name(qc, message) -> None:
    with pytest.raises(UnsupportedQuantization, match="quantization_config") as e:
        check_quantization_config(qc, "/m")
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("format", "marlin-24"), "format = 'marlin-24'"),
        (("weights", "num_bits", 2), "weights.num_bits = 2"),
        (("weights", "type", "float"), "weights.type = 'float'"),
        (("weights", "strategy", "tensor"), "weights.strategy = 'tensor'"),
        (("weights", "group_size", 100), "group_size = 100"),
        (("input_activations", {"num_bits": 8}), "input_activations"),
    ],
)
def test_compressed_tensors_configs_are_refused_by_name(edit, message) -> None:
    qc = ct_config(4, 128, True)
    grp = qc["config_groups"]["group_0"]
    if edit[0] == "format":
        qc["format"] = edit[1]
    elif edit[0] == "weights":
        grp["weights"][edit[1]] = edit[2]
    else:
        grp[edit[0]] = edit[1]
    with pytest.raises(UnsupportedQuantization) as e:
        check_quantization_config(qc, "/m")
    assert message in str(e.value)


# ----------------------------------------------------------------------------- end to end


def write_checkpoint(hf_model, src: str, out: str, fmt: str, bits: int = 4, g: int = 32) -> dict:
    """`src`'s tiny Llama with every decoder linear layer in format `fmt`; returns the float
    state dict of the dequantized weights (what the checkpoint stands for)."""
    import shutil

    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(1)
    sd = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    qc: dict = {}
    shared: dict[str, tuple] = {}  # act-order: layers that read one input share one order
    for name, t in sd.items():
        if ".layers." in name and name.endswith("proj.weight"):
            base = name.removesuffix(".weight")
            q, z, s, g_idx, sym = grid_for(fmt, t, bits, g, gen)
            if fmt.endswith("act_order"):
                # GPTQ gives q/k/v (and gate/up) one Hessian, hence one order
                parent, leaf = base.rsplit(".", 1)
                key = parent + ("" if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj",
                                               "up_proj") else "." + leaf)  # fmt: skip
                g_idx = shared.setdefault(key, (g_idx,))[0]
                q, z, s = rtn_grid(t, bits, g, sym, g_idx)
            packed, qc = case(fmt, q, z, s, g_idx, bits, g, sym)
            tensors.update({f"{base}.{k}": v.contiguous() for k, v in packed.items()})
            deq[name] = dequant64(q, z, s, g_idx).float()
        else:
            tensors[name] = t.contiguous()
            deq[name] = t
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads(open(os.path.join(src, "config.json")).read())
    cfg["quantization_config"] = qc
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(src, name), out)
    return deq


PROMPTS = [[5, 9, 33, 100, 7], [11, 12, 13]]
# The CPU INT4 kernel computes in bfloat16 with bfloat16 scales (tandem.kernels.cpu_int4): where
# the reference's two best tokens are closer than this (nats), greedy decoding may pick the other.
NEAR_TIE = 0.15


def hf_greedy(model, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[float]]]:
    """Per prompt: transformers' greedy tokens and, at each step, the gap between its best two
    log-probabilities."""
    out = []
    for p in prompts:
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([p]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        gaps = []
        for sc in gen.scores:
            top = torch.log_softmax(sc[0].double(), -1).topk(2).values
            gaps.append(float(top[0] - top[1]))
        out.append((gen.sequences[0, len(p) :].tolist(), gaps))
    return out


def tandem_greedy(path: str, prompts: list[list[int]], n: int, **options) -> list[list[int]]:
    llm = tandem.LLM(path, num_blocks=32, **options)
    sp = tandem.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, sp)]


def assert_greedy_matches(path: str, want: list) -> None:
    """Tandem's dequantized float path gives transformers' tokens exactly; its INT4 path (the
    codes read by the CPU INT4 kernel) the same up to a first difference at a near-tie."""
    exact = tandem_greedy(path, PROMPTS, 10, quantization="none", dtype="float32")
    assert exact == [t for t, _ in want]
    int4 = tandem_greedy(path, PROMPTS, 10)
    for got, (ref, gaps) in zip(int4, want, strict=True):
        i = next((j for j, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b), None)
        assert i is None or gaps[i] <= NEAR_TIE, f"differs at {i}, gap {gaps[i]}: {got} {ref}"


@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq_act_order", "ct_asym"])
def test_greedy_tokens_match_transformers_on_dequantized_weights(
    fmt, model_factory, tmp_path
) -> None:
    """transformers cannot run AWQ/GPTQ on a CPU without autoawq/optimum+auto-gptq, so the
    reference is transformers on the same checkpoint's dequantized float32 weights."""
    hf_model, src = model_factory("llama")
    deq = write_checkpoint(hf_model, src, str(tmp_path / fmt), fmt)
    ref = type(hf_model)(hf_model.config).eval()
    ref.load_state_dict(deq)
    assert_greedy_matches(str(tmp_path / fmt), hf_greedy(ref, PROMPTS, 10))


# transformers warns that the checkpoint's own quantization_config wins (run_compressed is kept).
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
def test_compressed_tensors_greedy_tokens_match_transformers_loading_it(
    model_factory, tmp_path
) -> None:
    """transformers reads a compressed-tensors checkpoint itself (its compressed-tensors
    integration decompresses it): both load the same directory."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    hf_model, src = model_factory("llama")
    out = str(tmp_path / "ct")
    deq = write_checkpoint(hf_model, src, out, "ct")
    theirs = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)
    ).eval()
    for name, t in deq.items():  # transformers decompressed the same weights
        mod = name.removesuffix(".weight")
        if ".layers." in name and name.endswith("proj.weight"):
            got = theirs.get_submodule(mod).weight.detach().float()
            torch.testing.assert_close(got, t, rtol=0, atol=1e-7)
    assert_greedy_matches(out, hf_greedy(theirs, PROMPTS, 10))
