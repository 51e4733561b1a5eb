"""What the GPU decode benchmarks share: a random Llama model built in memory (transformers and
Tandem on the same weights, no download), copy bandwidth, the roofline, and run metadata.

Imported by bench/decode_roofline.py and bench/throughput.py (run them from the repository root).
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from meta import revision

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Llama-3-8B's shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336).
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
# Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads of 64, 8 KV heads, tied embedding): a
# float32 run on a GPU in the time a bfloat16 Llama-3-8B takes.
LLAMA32_1B = dict(
    LLAMA3_8B,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    tie_word_embeddings=True,
)
# A few-MB model of the same family, for --smoke runs on CPU.
SMOKE = dict(
    LLAMA3_8B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
SHAPES = {"llama3-8b": LLAMA3_8B, "llama3.2-1b": LLAMA32_1B, "smoke": SMOKE}


def run_info(argv: list[str]) -> dict[str, Any]:
    """The command, revision, device and library versions a result was produced with."""
    rev, dirty = revision()
    import transformers
    import triton

    cuda = torch.cuda.is_available()
    return {
        "command": "python " + " ".join(shlex.quote(a) for a in argv),
        "git_revision": rev,
        "git_uncommitted_changes": dirty,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def captured(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """fn() captured in a CUDA graph, after a warm-up call (it compiles) on a side stream."""
    from tandem.engine.cuda_graphs import capture_graph

    return capture_graph(fn)[0]


def copy_bandwidth(nbytes: int = 4 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth, (bytes read + bytes written) / time; median of reps."""
    from tandem.engine.roofline import copy_bandwidth as measure

    return measure(nbytes, reps)


def build_hf_model(shape: dict[str, Any], device: str, dtype: torch.dtype):
    """A transformers LlamaForCausalLM with random weights, allocated and initialised on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    # Norm weights start at 1; randomise them a little so a wrong norm cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
    return model.eval()


def write_random_checkpoint(path: str, shape: str, dtype: str = "bfloat16") -> str:
    """A Hugging Face directory with random weights of `shape` (a key of SHAPES) and a
    word-level tokenizer over its vocabulary; reused when it already exists (it is written
    beside `path` and renamed into place, so an interrupted write leaves no partial one)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ValueError(f"{path!r} exists and is no checkpoint: give a new or empty directory")
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    dims = SHAPES[shape]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = build_hf_model(dims, device, getattr(torch, dtype))
    partial = f"{path.rstrip(os.sep)}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    model.save_pretrained(partial)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the stages that load it need the memory more than we do
    vocab = dims["vocab_size"]
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="w2", bos_token="w1").save_pretrained(
        partial
    )
    if os.path.isdir(path):
        os.rmdir(path)  # empty (checked above)
    os.rename(partial, path)
    return path


class _NoTokenizer:
    """The engine reads only `eos_token_ids` from a tokenizer; benchmarks pass token ids."""

    eos_token_ids: list[int] = []


def tandem_engine(hf_model, tokenizer: Any = None, **engine_options: Any):
    """An `LLMEngine` over the transformers model's own weights (no copy where shapes agree);
    `tokenizer` (a `tandem.model.tokenizer.Tokenizer`) where the run needs one (grammars)."""
    from tandem.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.model.config import ModelConfig
    from tandem.model.loader import LoadedModel

    cfg = ModelConfig.from_hf(hf_model.config.to_dict(), name="random-llama")
    weights = dict(hf_model.state_dict())
    loaded = LoadedModel(cfg, weights, tokenizer or _NoTokenizer(), "random-llama")
    config = EngineConfig(**engine_options)
    config.validate()
    return LLMEngine(loaded, config)


def engine_from_checkpoint(**engine_options: Any):
    """An `LLMEngine` over the checkpoint `engine_options["model"]`, loaded as a worker loads
    it: on a GPU only the engine's own weights are on the device when its KV pool is sized."""
    from tandem.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.model.loader import load_model

    config = EngineConfig(**engine_options)
    config.validate()
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[config.dtype]
    return LLMEngine(load_model(config.model, dtype), config)


def weight_bytes_per_step(engine) -> int:
    """Bytes of weights one decode step reads: every layer, the final norm and the LM head."""
    from tandem.engine.roofline import weight_bytes

    return weight_bytes(engine.model)


def kv_bytes_per_token(engine) -> int:
    from tandem.engine.roofline import kv_bytes_per_token as per_token

    return per_token(engine.kv)


@dataclass
class EngineRun:
    e2e_s: float  # add_request to last token
    decode_s: float  # from every sequence having its first token to the last token
    steps: int
    tokens: int  # generated tokens, all sequences
    decode_tokens: int  # generated after the first token


def run_engine(engine, prompts: list[list[int]], new_tokens: int) -> EngineRun:
    """Greedy, fixed-length generation for every prompt through `LLMEngine.step`."""
    from tandem.api.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    seqs = [engine.add_request(p, sp) for p in prompts]
    steps = 0
    t_first = None
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if t_first is None and all(s.output_token_ids for s in seqs):
            sync()
            t_first = time.perf_counter()
    sync()
    t1 = time.perf_counter()
    tokens = sum(len(s.output_token_ids) for s in seqs)
    if tokens != len(prompts) * new_tokens:
        raise RuntimeError(f"generated {tokens} tokens, expected {len(prompts) * new_tokens}")
    assert t_first is not None
    return EngineRun(t1 - t0, t1 - t_first, steps, tokens, tokens - len(prompts))


def hf_generate_s(model, input_ids: torch.Tensor, new_tokens: int, **kwargs: Any) -> float:
    """Seconds for transformers' greedy `generate` of exactly `new_tokens` per row."""
    sync()
    t0 = time.perf_counter()
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        **kwargs,
    )
    sync()
    t = time.perf_counter() - t0
    if out.shape[1] != input_ids.shape[1] + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - input_ids.shape[1]} tokens")
    return t


def decode_roofline_s(
    weight_bytes: int, kv_per_token: int, batch: int, prompt: int, new_tokens: int, bw: float
) -> float:
    """Fewest seconds the decode steps after the first token can take at bandwidth `bw`:
    each step reads every weight once and each sequence's whole KV (its new token's included)."""
    total = 0
    for k in range(1, new_tokens):  # the step that produces token k + 1 attends prompt + k tokens
        total += weight_bytes + batch * (prompt + k) * kv_per_token
    return total / bw


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()
