"""Read a GGUF file's header: its ModelConfig and its tokenizer, without its weights.

Torch is not needed here: the gateway reads a model this way (`tandem.model.info`), and the
weight loader (`gguf_loader.py`) starts from the same reader and config.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any

import numpy as np

from tandem.config import cache_dir
from tandem.model.config import ModelConfig, UnsupportedModelError
from tandem.model.gguf_file import Field as GGUFField
from tandem.model.gguf_file import open_gguf
from tandem.model.tokenizer import Tokenizer
from tandem.progress import report

# general.architecture -> ModelConfig.model_type (llama.cpp writes Mistral checkpoints as
# "llama" too).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

# The Llama 3.x pre-training context, used when a file with rope_freqs does not record it.
_LLAMA3_DEFAULT_ORIGINAL_CONTEXT = 8192


def open_reader(path: str) -> Any:
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


class Metadata:
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


def config_from_metadata(meta: Metadata, tensors: dict[str, Any], path: str) -> ModelConfig:
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
    meta: Metadata, tensors: dict[str, Any], theta: float, head_dim: int
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
# Tokenizer


def load_tokenizer(path: str, meta: Metadata, eos_ids: list[int]) -> Tokenizer:
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
