"""The linear layers of a Llama-family decoder, by the fused weight each feeds."""

from __future__ import annotations

# Linear layers of one decoder layer, by the fused weight they feed (see LlamaModel).
FUSED_GROUPS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def linear_layer_names(num_layers: int) -> list[str]:
    """Every quantizable layer name of a Llama-family model, in order."""
    return [
        f"model.layers.{i}.{part}"
        for i in range(num_layers)
        for parts in FUSED_GROUPS.values()
        for part in parts
    ]
