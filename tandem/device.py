"""The torch device and dtypes an engine's settings name, "auto" resolved for this host.

Kept out of `config.py` so that the command line starts without torch.
"""

from __future__ import annotations

import torch

from tandem.config import DTYPES, EngineConfig


def resolved_device(config: EngineConfig) -> torch.device:
    """config.device; "auto": cuda when available, else cpu."""
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolved_dtype(config: EngineConfig) -> torch.dtype:
    """config.dtype; "auto": bfloat16 on cuda, float32 elsewhere."""
    if config.dtype == "auto":
        return torch.bfloat16 if resolved_device(config).type == "cuda" else torch.float32
    if config.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {config.dtype!r}")
    return getattr(torch, config.dtype)


def resolved_kv_dtype(config: EngineConfig) -> torch.dtype:
    """The KV pool's storage dtype."""
    if config.kv_dtype == "auto":
        return resolved_dtype(config)
    if config.kv_dtype == "fp8":
        return torch.float8_e4m3fn
    if config.kv_dtype == "int8":
        return torch.int8
    raise ValueError(f"kv_dtype must be one of auto, fp8, int8; got {config.kv_dtype!r}")
