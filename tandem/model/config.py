"""Model hyper-parameters for the Llama family, read from a Hugging Face config or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Hugging Face `architectures` / `model_type` values this implementation covers.
SUPPORTED_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


class UnsupportedModelError(ValueError):
    """The checkpoint names an architecture Tandem does not implement."""


@dataclass
class ModelConfig:
    """Everything the Llama-family forward pass needs to know about a checkpoint."""

    model_type: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "model"

    def num_parameters(self) -> int:
        """The checkpoint's parameters, unquantized: the token embedding, each layer's attention
        (q, k, v, o and their biases) and MLP (gate, up, down) and its two norms, the final norm,
        and the LM head unless it is the embedding."""
        h = self.hidden_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if self.attention_bias else 0)
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "model") -> ModelConfig:
        """Build from a parsed `config.json`; raises `UnsupportedModelError` naming the architecture."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        kind = None
        for a in archs:
            kind = kind or SUPPORTED_ARCHITECTURES.get(a)
        kind = kind or SUPPORTED_MODEL_TYPES.get(str(model_type))
        if kind is None:
            what = ", ".join(archs) or str(model_type)
            raise UnsupportedModelError(
                f"unsupported architecture {what!r}: Tandem serves "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        if eos is None:
            eos_ids: list[int] = []
        elif isinstance(eos, list):
            eos_ids = [int(e) for e in eos]
        else:
            eos_ids = [int(eos)]
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers >= 5 moves rope settings into `rope_parameters`.
        rope_params = cfg.get("rope_parameters")
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        if isinstance(rope_scaling, dict):
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rtype == "default":
                rope_scaling = None
            elif rtype not in ("llama3", "linear"):
                raise UnsupportedModelError(f"unsupported rope_scaling type {rtype!r}")
        return cls(
            model_type=kind,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            # Attention here is over the whole context; a sliding window (Mistral) only matters past
            # its length, so the usable context is capped at the window.
            max_position_embeddings=min(
                int(cfg.get("max_position_embeddings", 2048)),
                int(cfg.get("sliding_window") or 1 << 62)
                if cfg.get("use_sliding_window", kind == "mistral")
                else 1 << 62,
            ),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=kind == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )
