"""Draft models for speculative decoding, built from the target or loaded beside it.

    self:N          the target's first N layers, its final norm and LM head
    self-int4       the whole target, its linear layers quantized to INT4 (asymmetric, g128, RTN)
    self-int4:DIR   the same from a `tandem quantize` checkpoint of the target
    PATH            a separate (smaller) model; its tokenizer must be the target's

A draft proposes token ids the target verifies, so both must mean the same thing by every id:
a draft whose vocabulary or special tokens differ is refused with what differs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from tandem.config import EngineConfig
from tandem.device import resolved_device, resolved_dtype
from tandem.formats.weight import LayerSpec, QuantizedWeight, dequantize_weights, quantize_weights
from tandem.kv.cache import KVCache
from tandem.kv.sizing import DEFAULT_KV_GB
from tandem.model.config import ModelConfig
from tandem.model.info import load_model_info
from tandem.model.layer_names import linear_layer_names
from tandem.model.llama import LlamaModel
from tandem.model.loader import LoadedModel, load_model
from tandem.model.quantized_checkpoint import read_quantization
from tandem.model.tokenizer import Tokenizer

log = logging.getLogger("tandem.draft")

DRAFT_SPECS = (
    "ngram, self:N, self-int4, self-int4:DIR or a path to a model with the target's tokenizer"
)
_SHOWN = 5  # differing tokens listed by name in a refusal


def _some(items: list[str]) -> str:
    more = f", ... ({len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def tokenizer_differences(target: Tokenizer, draft: Tokenizer) -> list[str]:
    """What makes two tokenizers disagree (empty when the draft may propose for the target)."""
    diffs = []
    tv, dv = target.hf.get_vocab(), draft.hf.get_vocab()
    if len(tv) != len(dv):
        diffs.append(f"vocabulary size: {len(tv)} tokens in the target, {len(dv)} in the draft")
    only_t = sorted(set(tv) - set(dv), key=tv.__getitem__)
    only_d = sorted(set(dv) - set(tv), key=dv.__getitem__)
    moved = sorted((k for k in set(tv) & set(dv) if tv[k] != dv[k]), key=tv.__getitem__)
    if only_t:
        toks = [f"{t!r} (id {tv[t]})" for t in only_t]
        diffs.append(f"tokens only in the target ({len(only_t)}): {_some(toks)}")
    if only_d:
        toks = [f"{t!r} (id {dv[t]})" for t in only_d]
        diffs.append(f"tokens only in the draft ({len(only_d)}): {_some(toks)}")
    if moved:
        toks = [f"{t!r} (id {tv[t]} in the target, {dv[t]} in the draft)" for t in moved]
        diffs.append(f"tokens with different ids ({len(moved)}): {_some(toks)}")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target.hf, name, None), getattr(draft.hf, name, None)
        if a != b:
            diffs.append(f"{name}: {a} in the target, {b} in the draft")
    ts = dict(zip(target.hf.all_special_tokens, target.hf.all_special_ids, strict=False))
    ds = dict(zip(draft.hf.all_special_tokens, draft.hf.all_special_ids, strict=False))
    if ts != ds:
        diffs.append(
            f"special tokens (token: id): target {sorted(ts.items(), key=lambda kv: kv[1])}, "
            f"draft {sorted(ds.items(), key=lambda kv: kv[1])}"
        )
    return diffs


def check_alignment(
    spec: str, target_cfg: ModelConfig, target_tok: Tokenizer, draft_cfg: ModelConfig, draft_tok
) -> None:
    """Raise ValueError saying what differs when the draft's ids do not mean the target's."""
    diffs = []
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        diffs.append(
            f"model vocab_size (embedding rows): {target_cfg.vocab_size} in the target, "
            f"{draft_cfg.vocab_size} in the draft"
        )
    diffs += tokenizer_differences(target_tok, draft_tok)
    if diffs:
        raise ValueError(f"draft model {spec!r} cannot propose for the target: " + "; ".join(diffs))


def runnable_weights(weights: dict[str, Any], device: torch.device, dtype: torch.dtype):
    """The weights as the draft runs them on `device`.

    INT4 layers stay packed on CUDA (the W4A16 kernels read a third of the bytes). Elsewhere the
    W4A16 path is a torch reference that dequantizes the whole layer on every call (about 50x a
    float matmul on CPU); dequantizing once here gives the same values, so the same proposals,
    at the speed of a float model.
    """
    if device.type == "cuda":
        return weights
    return dequantize_weights(weights, dtype)


def int4_weights(target: LoadedModel) -> dict[str, Any]:
    """The target's linear layers quantized to INT4 g128 with zero points by round-to-nearest.

    A target that already holds quantized layers (a `tandem quantize` checkpoint) is used as is.
    """
    if any(isinstance(w, QuantizedWeight) for w in target.weights.values()):
        log.info("self-int4: the target checkpoint is already quantized; drafting with it as is")
        return target.weights
    spec = LayerSpec(bits=4, group_size=128, zero_point=True)
    names = linear_layer_names(target.config.num_layers)
    return quantize_weights(target.weights, {n: spec for n in names})


def _architecture(cfg: ModelConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d.pop("name")
    return d


def load_draft_model(spec: str, config: EngineConfig, target: LoadedModel | None = None):
    """The draft model named by `spec` (see the module docstring) on the config's device.

    `target` is the loaded target when the caller has it; otherwise it is loaded when the draft
    is built from its weights (self:N, self-int4), and only its config and tokenizer otherwise.
    """
    dtype, device = resolved_dtype(config), resolved_device(config)
    if spec.startswith("self:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError as e:
            raise ValueError(f"draft {spec!r}: expected self:N with N a number of layers") from e
        target = target or load_model(config.model, dtype)
        cfg = target.config
        if not 1 <= n < cfg.num_layers:
            raise ValueError(
                f"draft {spec!r}: N must be in [1, {cfg.num_layers - 1}] for this model"
            )
        small = dataclasses.replace(cfg, num_layers=n)
        return LlamaModel(small, runnable_weights(target.weights, device, dtype), dtype, device)
    if spec == "self-int4":
        target = target or load_model(config.model, dtype)
        weights = runnable_weights(int4_weights(target), device, dtype)
        return LlamaModel(target.config, weights, dtype, device)
    path = spec.removeprefix("self-int4:")
    if not os.path.exists(os.path.expanduser(path)):
        raise ValueError(f"unknown draft {spec!r} (no such file or directory): use {DRAFT_SPECS}")
    if target is not None:
        target_cfg, target_tok = target.config, target.tokenizer
    else:
        target_cfg, target_tok, _ = load_model_info(config.model)
    draft = load_model(path, dtype)
    check_alignment(spec, target_cfg, target_tok, draft.config, draft.tokenizer)
    if path != spec:
        if read_quantization(os.path.expanduser(path)) is None:
            raise ValueError(
                f"draft {spec!r}: {path!r} is not a `tandem quantize` checkpoint (it has no "
                "quantization.json); use self-int4 to quantize the target at start-up"
            )
        a, b = _architecture(target_cfg), _architecture(draft.config)
        differ = [f"{k}: {a[k]!r} in the target, {b[k]!r} in the draft" for k in a if a[k] != b[k]]
        if differ:
            raise ValueError(
                f"draft {spec!r} is not a quantization of the target: " + "; ".join(differ)
            )
    return LlamaModel(draft.config, runnable_weights(draft.weights, device, dtype), dtype, device)


def draft_num_blocks(model: LlamaModel, config: EngineConfig) -> int:
    """KV blocks of a draft's own pool: config.num_blocks, else what kv_cache_memory_gb holds
    (unset: DEFAULT_KV_GB)."""
    if config.num_blocks is not None:
        return config.num_blocks
    cfg = model.cfg
    per_block = KVCache.bytes_per_block(
        cfg.num_layers, config.block_size, cfg.num_kv_heads, cfg.head_dim, model.dtype
    )
    gb = DEFAULT_KV_GB if config.kv_cache_memory_gb is None else config.kv_cache_memory_gb
    return max(1, int(gb * 2**30) // per_block)
