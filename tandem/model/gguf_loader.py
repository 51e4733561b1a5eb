"""Load a llama.cpp GGUF checkpoint as a ModelConfig, an HF-named state dict and a Tokenizer.

Weights are dequantized to plain float tensors on load (Tandem does its own INT4 packing in
`tandem.formats`); `load_gguf_q4_1` instead keeps Q4_1 and Q8_0 tensors as they are stored
(`tandem/formats/gguf.py`). The float result is laid out exactly as transformers' GGUF loader lays it out, so the
same forward pass serves safetensors and GGUF checkpoints. The header (config and tokenizer) is
read by `gguf_meta.py`.
"""

from __future__ import annotations

import re
from typing import Any

import gguf
import numpy as np
import torch

from tandem.formats.gguf import q4_1_to_quantized, q8_0_to_quantized
from tandem.formats.weight import QuantizedWeight, permute_rows
from tandem.model.config import ModelConfig, UnsupportedModelError
from tandem.model.gguf_meta import Metadata, config_from_metadata, load_tokenizer, open_reader
from tandem.model.tokenizer import Tokenizer
from tandem.progress import Percent

# Architectures whose attn_q / attn_k rows llama.cpp's converter reorders for its rotary layout
# (`LlamaModel.permute` in convert_hf_to_gguf.py). Qwen2's converter leaves them as in HF.
_PERMUTED_QK = {"llama"}

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors llama.cpp writes that carry no weights of their own: rope_freqs holds the llama3 rope
# scaling factors (read into the config instead); attn_rot_embd is a leftover of old converters.
_IGNORED_TENSORS = re.compile(r"^(rope_freqs\.weight|blk\.\d+\.attn_rot_embd\.weight)$")
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def load_gguf(
    path: str, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read a GGUF file: its config, its dequantized weights under HF names, and its tokenizer."""
    reader = open_reader(path)
    meta = Metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    config = config_from_metadata(meta, tensors, path)
    state_dict = _state_dict(tensors, config, meta.architecture, dtype, path)
    tokenizer = load_tokenizer(path, meta, config.eos_token_ids)
    return config, state_dict, tokenizer


# ---------------------------------------------------------------------------------------------
# Weights


def _hf_name(gguf_name: str) -> str | None:
    """HF state-dict name for a GGUF tensor name, or None for tensors that hold no weights."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if _IGNORED_TENSORS.match(gguf_name):
        return None
    m = _LAYER_NAME.match(gguf_name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
    raise UnsupportedModelError(f"unexpected tensor {gguf_name!r} in GGUF file")


def _dequantize(t: Any, path: str) -> np.ndarray:
    """A GGUF tensor as float32 numpy, in torch (row-major, reversed-ggml) shape."""
    try:
        # GGUFReader already reverses ggml's dimension order, so rows come first as in HF.
        values = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(
            f"{path}: tensor {t.name!r} is stored as {t.tensor_type.name}, which the gguf package "
            "cannot dequantize (F32, F16, BF16 and the Q*/IQ* block types are supported)"
        ) from e
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    values = values.astype(np.float32, copy=False).reshape(shape)
    if not values.flags.writeable:
        # F32 comes back as a view of the read-only memory map; copy so the tensor owns its memory.
        values = values.copy()
    return values


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a q/k weight (or bias).

    convert_hf_to_gguf.py does `reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)`,
    turning HF's split-halves rotary layout into interleaved pairs; this is its inverse.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _state_dict(
    tensors: dict[str, Any], config: ModelConfig, arch: str, dtype: torch.dtype, path: str
) -> dict[str, torch.Tensor]:
    """Dequantize every weight into an HF-named dict, checking nothing is missing."""
    out: dict[str, torch.Tensor] = {}
    permuted = arch in _PERMUTED_QK
    progress = Percent("loading weights", sum(int(t.n_bytes) for t in tensors.values()))
    for name, t in tensors.items():
        hf = _hf_name(name)
        if hf is None:
            progress.advance(int(t.n_bytes))
            continue
        w = torch.from_numpy(_dequantize(t, path))
        if permuted and ".attn_q." in name:
            w = _unpermute(w, config.num_heads)
        elif permuted and ".attn_k." in name:
            w = _unpermute(w, config.num_kv_heads)
        out[hf] = w if dtype == torch.float32 else w.to(dtype)
        progress.advance(int(t.n_bytes))
    expected = _expected_names(config)
    missing = sorted(expected - out.keys())
    if missing:
        raise ValueError(f"{path} lacks tensors the model needs: {', '.join(missing[:5])}")
    return out


def _expected_names(config: ModelConfig) -> set[str]:
    """HF names a complete checkpoint for `config` must provide."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_layers):
        for part in _LAYER_TENSORS.values():
            names.add(f"model.layers.{i}.{part}.weight")
        if config.attention_bias:
            names |= {f"model.layers.{i}.self_attn.{p}_proj.bias" for p in "qkv"}
    return names


def q4_1_tensor(t: Any, cfg: ModelConfig, permuted: bool) -> tuple[str, QuantizedWeight]:
    """One GGUF Q4_1 (or Q8_0) tensor (a GGUFReader tensor) as (HF name, QuantizedWeight).

    `permuted`: the file's architecture reorders q/k rows for llama.cpp's rotary layout; they
    are put back in HF order, as the float loader does.
    """
    hf = _hf_name(t.name)
    cols, rows = (int(d) for d in t.shape.tolist())  # ggml order: fastest dimension first
    if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
        qw = q8_0_to_quantized(t.data, rows, cols)
    else:
        qw = q4_1_to_quantized(t.data, rows, cols)
    if permuted and ".attn_q." in t.name:
        qw = permute_rows(qw, _unpermute(torch.arange(rows), cfg.num_heads))
    elif permuted and ".attn_k." in t.name:
        qw = permute_rows(qw, _unpermute(torch.arange(rows), cfg.num_kv_heads))
    return hf, qw


def load_gguf_q4_1(path: str, cfg: ModelConfig, heads: bool = False) -> dict[str, QuantizedWeight]:
    """The Q4_1 linear weights of a GGUF file as QuantizedWeights under HF names; with `heads`
    also the token embedding and LM head when they are Q4_1 or Q8_0."""
    reader = open_reader(path)
    meta = Metadata(reader, path)
    permuted = meta.architecture in _PERMUTED_QK
    types = (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0)
    out: dict[str, QuantizedWeight] = {}
    for t in reader.tensors:
        if t.tensor_type not in types:
            continue
        hf = _hf_name(t.name)
        if hf is None or not hf.endswith(".weight"):
            continue
        layer = ".layers." in hf
        if not (layer and t.tensor_type == types[0]) and not (heads and not layer):
            continue  # without `heads`, embeddings and lm_head stay in float
        name, qw = q4_1_tensor(t, cfg, permuted)
        out[name] = qw
    return out
