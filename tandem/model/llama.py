"""The Llama-family transformer (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Plain tensors in, tensors out. Activations are packed: T tokens of many sequences in one
[T, hidden] tensor; `AttentionMetadata` says which tokens belong to which sequence. The model
loads the checkpoint into layers (`tandem.layers`) and composes them; each layer chooses its
own kernels, and the fusions between two of them live in those layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.config import KernelConfig, kernel_config
from tandem.formats.weight import QuantizedWeight, cat_rows, permute_rows
from tandem.kv.cache import KVCache
from tandem.layers.activation import SiluAndMul
from tandem.layers.attention import (  # noqa: F401 (model users import them from here)
    Attention,
    AttentionMetadata,
    varlen_attention_kind,
)
from tandem.layers.embedding import vocab_layers
from tandem.layers.linear import Linear, linear_layer
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryKVWrite
from tandem.layers.step import Step
from tandem.model.config import ModelConfig
from tandem.model.rotary import cos_sin_table


@dataclass
class DecoderLayer:
    """One decoder layer's layers, in the order they run."""

    input_norm: RMSNorm
    qkv: Linear  # [(Hq + 2 Hkv) * D, H]: q, k and v fused
    rotary: RotaryKVWrite
    attn: Attention
    o: Linear  # [H, Hq * D]
    post_norm: RMSNorm
    gate_up: Linear  # [2 I, H]: gate and up fused
    act: SiluAndMul
    down: Linear  # [H, I]

    def __post_init__(self) -> None:
        # Which layer reads each linear layer's output (down's reader is the next layer's norm).
        self.qkv.reader, self.o.reader, self.gate_up.reader = self.rotary, self.post_norm, self.act


def _input_perm(weights: dict, names: list[str], device: torch.device) -> torch.Tensor | None:
    """The input permutation shared by the layers `names` fused into one (None: no act-order)."""
    perms = [weights.get(n + ".input_perm") for n in names]
    if all(p is None for p in perms):
        return None
    if any(p is None or not torch.equal(p, perms[0]) for p in perms):
        raise ValueError(
            f"{', '.join(names)} share their input but not their act-order input permutation "
            "(g_idx); Tandem fuses them into one layer and needs one order"
        )
    return perms[0].to(device=device, dtype=torch.long)


def _rows(w: torch.Tensor | QuantizedWeight, index: torch.Tensor):
    """`w` with its output rows reordered (`index[i]` is the source of row i)."""
    return permute_rows(w, index) if isinstance(w, QuantizedWeight) else w[index]


class LlamaModel:
    """Weights plus the forward pass; no KV allocation, no scheduling."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
        kernels: KernelConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.kernels = kernels or kernel_config()
        self.dtype = dtype
        self.device = torch.device(device)

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return weights[name].to(device=self.device, dtype=dtype)

        table = w("model.embed_tokens.weight")
        if table.shape != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"model.embed_tokens.weight has shape {tuple(table.shape)}, "
                f"config says ({cfg.vocab_size}, {cfg.hidden_size})"
            )
        head = None
        if not cfg.tie_word_embeddings and "lm_head.weight" in weights:
            head = w("lm_head.weight")
        self.embed, self.lm_head = vocab_layers(table, head, dtype, self.device)
        self.max_positions = max_positions or cfg.max_position_embeddings
        self.cos_sin = cos_sin_table(cfg, self.max_positions, self.device)
        self.scale = cfg.head_dim**-0.5
        self.norm = RMSNorm(w("model.norm.weight"), cfg.rms_norm_eps)
        perms = {k.removesuffix(".input_perm") for k in weights if k.endswith(".input_perm")}
        self.layers = [self._layer(i, weights, w, perms) for i in range(cfg.num_layers)]
        if perms:
            raise ValueError(
                f"act-order (g_idx) is supported for the decoder layers' linear layers, not for "
                f"{', '.join(sorted(perms))}"
            )
        for layer, after in zip(self.layers, [*self.layers[1:], None], strict=True):
            layer.down.reader = after.input_norm if after is not None else self.norm

    def _layer(self, i: int, weights: dict, w, perms: set[str]) -> DecoderLayer:
        """Decoder layer i from the checkpoint: q/k/v and gate/up fused into one linear layer
        each, act-order permutations checked and kept with the layer that reads them (`perms`:
        the layers with one not yet claimed)."""
        cfg, dev = self.cfg, self.device
        p = f"model.layers.{i}."
        bias = None
        if cfg.attention_bias and p + "self_attn.q_proj.bias" in weights:
            bias = torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        qkv = [p + f"self_attn.{n}_proj" for n in "qkv"]
        mlp = [p + "mlp.gate_proj", p + "mlp.up_proj"]
        gate, up = (w(n + ".weight") for n in mlp)
        down_perm = _input_perm(weights, [p + "mlp.down_proj"], dev)
        if down_perm is not None:  # silu(gate) * up is elementwise: permute its producers
            gate, up = _rows(gate, down_perm), _rows(up, down_perm)
        perms -= {*qkv, p + "self_attn.o_proj", *mlp, p + "mlp.down_proj"}

        def linear(weight, names: list[str], bias=None) -> Linear:
            return linear_layer(weight, bias, _input_perm(weights, names, dev), dev, self.dtype)

        qkv_layer = linear(cat_rows([w(n + ".weight") for n in qkv]), qkv, bias)
        o = linear(w(p + "self_attn.o_proj.weight"), [p + "self_attn.o_proj"])
        gate_up = linear(cat_rows([gate, up]), mlp)
        down = linear_layer(w(p + "mlp.down_proj.weight"), device=dev, dtype=self.dtype)
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        return DecoderLayer(
            input_norm=RMSNorm(w(p + "input_layernorm.weight"), cfg.rms_norm_eps, qkv_layer),
            qkv=qkv_layer,
            rotary=RotaryKVWrite(self.cos_sin, i, hq, hkv, d),
            attn=Attention(i, self.scale, hkv, o, self.kernels),
            o=o,
            post_norm=RMSNorm(w(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps, gate_up),
            gate_up=gate_up,
            act=SiluAndMul(down),
            down=down,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run every layer over the packed tokens, writing their KV; returns final hidden [T, H].

        On CUDA about ten launches per layer: at decode batch sizes every small op is launch
        latency, so the layers fuse what they can (residual add + RMSNorm, rotary + KV write).
        Nothing here reads a device value on the host, so a decode batch can be captured in a
        CUDA graph (`tandem.engine.cuda_graphs`)."""
        h = self.embed(input_ids)
        step = Step.begin(positions, kv, meta, h)
        residual = None  # the residual stream; h is the pending branch output
        try:
            for layer in self.layers:
                x, residual = layer.input_norm(h, residual, step)
                attn = layer.attn(layer.rotary(layer.qkv(x, step), step), step)
                x, residual = layer.post_norm(layer.o(attn, step), residual, step)
                h = layer.down(layer.act(layer.gate_up(x, step), step), step)
            return self.norm(h, residual, step)[0]
        except BaseException:
            step.abort()
            raise

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, H] in the model dtype."""
        return self.embed(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, vocab] float32 (the model dtype's logits, widened)."""
        return self.lm_head(hidden)
