"""Shared fixtures: tiny random Llama-family checkpoints written to disk with transformers."""

from __future__ import annotations

import gc
import os

# This process forks children (fork + exec) while gRPC is in use: gRPC's fork handlers can
# hang fork() itself (seen in Popen under load); with no fork in the children before exec they
# are not needed. Set before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA, Triton kernels run under the interpreter; it must be chosen before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _fresh_kernel_settings():
    """Each test starts from the environment's kernel settings: an engine a test built installs
    its own for the process (`tandem.config.set_kernel_config`)."""
    from tandem import config

    config.set_kernel_config(None)
    yield
    config.set_kernel_config(None)


@pytest.fixture(autouse=True)
def _device_memory_given_back(request):
    """A GPU test's engine can outlive the test until the cyclic collector runs, which a long
    session does rarely: a traceback that a library keeps from an import made on the test's
    behalf holds, in a reference cycle, every frame above it, the test's with its locals (seen
    on a CPU with transformers' lazy imports). On an H100 a Llama-3-8B engine kept 18 GB
    allocated through every later test. After each test under tests/gpu it is collected and
    the allocator's cache returned to the device, so that a test sizing its pool from free
    memory, or capturing graphs, does not inherit its predecessors' memory. (A conftest.py of
    its own in tests/gpu would shadow this module, which tests import by the name conftest.)"""
    yield
    if torch.cuda.is_available() and request.node.path.parent.name == "gpu":
        gc.collect()
        torch.cuda.empty_cache()


def require_interpreter(*kernels) -> None:
    """For CPU kernel tests: pass when every Triton function given (triton's own, like tl.sum,
    and the module's kernels) runs under the interpreter; skip when triton is compiled on a
    CUDA machine (tests/gpu covers it); fail, saying why, when triton was imported before
    TRITON_INTERPRET=1 was set on a machine without CUDA."""
    from triton.runtime.interpreter import InterpretedFunction

    if all(isinstance(f, InterpretedFunction) for f in kernels):
        return
    if torch.cuda.is_available():
        pytest.skip("triton is in compiled mode (TRITON_INTERPRET unset); tests/gpu covers CUDA")
    pytest.fail(
        "triton was imported before TRITON_INTERPRET=1 was set (by an earlier test module); "
        "run `make test`, or set TRITON_INTERPRET=1 in the environment"
    )


def run_healthcheck(address: str, *extra: str, timeout_s: float = 2, env: dict | None = None):
    """`python -m services.healthcheck ADDRESS --timeout T EXTRA...` as a container probe runs
    it (TANDEM_STAGE_TLS_CA only from `env`); the finished process, output captured."""
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k != "TANDEM_STAGE_TLS_CA"}
    return subprocess.run(
        [sys.executable, "-m", "services.healthcheck", address, "--timeout", str(timeout_s)]
        + list(extra),
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
    )


def self_signed_cert(directory) -> tuple:
    """(key, cert): PEM files of a one-day self-signed certificate for localhost and 127.0.0.1,
    written into `directory` by openssl (the certificate is its own CA)."""
    import subprocess
    from pathlib import Path

    key, cert = Path(directory) / "key.pem", Path(directory) / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return key, cert


def _word_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="w1", bos_token="w2")


def build_random_model(kind: str, path: str, seed: int = 0, **overrides):
    """Write a small random checkpoint of `kind` (llama, llama3, mistral, qwen2) to `path`."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # Larger than the default 0.02 so logits are peaked: greedy ties would make the
        # token comparison depend on rounding rather than on correctness.
        initializer_range=0.2,
        bos_token_id=2,
        eos_token_id=1,
    )
    common.update(overrides)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    elif kind == "llama3":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
        model = LlamaForCausalLM(
            LlamaConfig(rope_parameters=rope, tie_word_embeddings=True, **common)
        )
    elif kind == "mistral":
        model = MistralForCausalLM(
            MistralConfig(sliding_window=None, tie_word_embeddings=False, **common)
        )
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common))
    else:
        raise ValueError(kind)
    model = model.eval()
    model.save_pretrained(path)
    _word_tokenizer(common["vocab_size"]).save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """Build (and cache) a random checkpoint per kind: returns (hf_model, path)."""
    cache: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in cache:
            path = str(tmp_path_factory.mktemp(kind))
            cache[kind] = (build_random_model(kind, path), path)
        return cache[kind]

    return get
