"""Draft models: self-int4, self-int4:DIR and a separate model; refusal of misaligned drafts."""

from __future__ import annotations

import pytest
import torch

import tandem
from tandem.config import EngineConfig
from tandem.engine.draft_models import int4_weights, load_draft_model
from tandem.formats.weight import QuantizedWeight
from tandem.model.loader import load_model
from tests.conftest import build_random_model


def _prompts(n_list=(6, 33, 17), seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in n_list]


def _greedy(max_tokens=24):
    return tandem.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A one-layer model of `kind` with other weights and the same tokenizer as the target."""
    made: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in made:
            made[kind] = str(tmp_path_factory.mktemp(f"small_{kind}"))
            build_random_model(kind, made[kind], seed=9, num_hidden_layers=1)
        return made[kind]

    return get


def _quantize_dir(src: str, out: str) -> None:
    from tandem.cli import main

    assert main(["quantize", src, "--method", "rtn", "--out", out, "--float-dtype", "float32"]) == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("draft", ["self-int4", "path"])
def test_greedy_speculation_with_model_drafts_equals_plain(model_factory, small_draft, kind, draft):
    _, path = model_factory(kind)
    spec_name = small_draft(kind) if draft == "path" else draft
    plain = tandem.LLM(path, num_blocks=128)
    spec = tandem.LLM(path, num_blocks=128, speculative=spec_name)
    prompts = _prompts((6, 33, 17, 12, 25))
    sps = [_greedy(24), _greedy(5), _greedy(30), _greedy(30), _greedy(30)]
    base = plain.generate(prompts, sps)
    # Runs that end inside an accepted run: max_tokens (5), a stop token and a stop string the
    # plain run meets after several tokens.
    sps[3] = tandem.SamplingParams(
        max_tokens=30, temperature=0, stop_token_ids=[base[3].token_ids[9]]
    )
    sps[4] = tandem.SamplingParams(
        max_tokens=30,
        temperature=0,
        ignore_eos=True,
        stop=[plain.tokenizer.decode(base[4].token_ids[6:8])],
    )
    base = plain.generate(prompts, sps)
    assert base[3].finish_reason == "stop" and len(base[3].token_ids) < 30
    assert base[4].stop_string is not None
    out = spec.generate(prompts, sps)
    for b, o in zip(base, out, strict=True):
        assert o.token_ids == b.token_ids
        assert o.text == b.text
        assert o.finish_reason == b.finish_reason
    assert spec.speculator.stats.proposed > 0
    assert spec.engine.pool.num_used == 0


def test_self_int4_quantizes_every_linear_layer_to_int4_g128(model_factory):
    hf, path = model_factory("llama")
    loaded = load_model(path)
    weights = int4_weights(loaded)
    n_layers = loaded.config.num_layers
    quantized = {k: v for k, v in weights.items() if isinstance(v, QuantizedWeight)}
    assert len(quantized) == 7 * n_layers  # q, k, v, o, gate, up, down per layer
    for name, qw in quantized.items():
        assert (qw.bits, qw.group_size, qw.zero_point) == (4, 128, True)
        w = loaded.weights[name].float()
        deq = qw.dequantize(torch.float32)
        # Asymmetric 4-bit groups along the input dimension: at most 16 levels per group, and
        # each weight rounds to its nearest level (error <= half a step, plus FP16 rounding).
        step = qw.scales.float().repeat_interleave(128, dim=1)[:, : w.shape[1]]
        assert ((deq - w).abs() <= step / 2 + 1e-3 * w.abs().max()).all(), name
        for row in deq[:4]:
            assert row.unique().numel() <= 16 * ((w.shape[1] + 127) // 128)
    # Embeddings, norms and the LM head stay in float, unchanged.
    assert torch.equal(
        weights["model.embed_tokens.weight"], loaded.weights["model.embed_tokens.weight"]
    )
    # The draft model runs the same layer count as the target (the whole model, not a prefix).
    model = load_draft_model("self-int4", EngineConfig(model=path, num_blocks=64), loaded)
    assert model.cfg.num_layers == n_layers


def test_self_int4_from_a_quantized_checkpoint(tmp_path, model_factory):
    _, path = model_factory("llama")
    qdir = str(tmp_path / "q")
    _quantize_dir(path, qdir)
    plain = tandem.LLM(path, num_blocks=128)
    spec = tandem.LLM(path, num_blocks=128, speculative=f"self-int4:{qdir}")
    prompts = _prompts((9, 21))
    base = plain.generate(prompts, _greedy())
    out = spec.generate(prompts, _greedy())
    assert [o.token_ids for o in out] == [b.token_ids for b in base]
    # In-memory RTN and the tandem quantize --method rtn checkpoint make the same draft.
    st = spec.speculator.stats
    mem = tandem.LLM(path, num_blocks=128, speculative="self-int4")
    mem.generate(prompts, _greedy())
    assert (mem.speculator.stats.proposed, mem.speculator.stats.accepted) == (
        st.proposed,
        st.accepted,
    )


def test_self_int4_dir_must_be_a_quantization_of_the_target(tmp_path, model_factory):
    _, path = model_factory("llama")
    cfg = EngineConfig(model=path, num_blocks=64)
    with pytest.raises(ValueError, match="not a `tandem quantize` checkpoint"):
        load_draft_model(f"self-int4:{path}", cfg)
    other = str(tmp_path / "deeper")
    build_random_model("llama", other, seed=3, num_hidden_layers=2)
    qdir = str(tmp_path / "q")
    _quantize_dir(other, qdir)
    with pytest.raises(ValueError, match=r"not a quantization of the target: num_layers: 3 .* 2"):
        load_draft_model(f"self-int4:{qdir}", cfg)


def _save_tokenizer(path: str, words: list[str], eos: str, bos: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos, bos_token=bos).save_pretrained(path)


def test_misaligned_drafts_are_refused_saying_what_differs(tmp_path, model_factory):
    _, path = model_factory("llama")
    cfg = EngineConfig(model=path, num_blocks=64)
    words = [f"w{i}" for i in range(512)]

    bigger = str(tmp_path / "bigger")
    build_random_model("llama", bigger, seed=4, vocab_size=600, num_hidden_layers=1)
    with pytest.raises(ValueError) as e:
        load_draft_model(bigger, cfg)
    msg = str(e.value)
    assert "cannot propose for the target" in msg
    assert "model vocab_size (embedding rows): 512 in the target, 600 in the draft" in msg
    assert "vocabulary size: 512 tokens in the target, 600 in the draft" in msg
    assert "tokens only in the draft (88): 'w512' (id 512)" in msg

    renamed = str(tmp_path / "renamed")  # same size, two tokens spelled differently
    build_random_model("llama", renamed, seed=4, num_hidden_layers=1)
    _save_tokenizer(renamed, words[:100] + ["x100", "x101"] + words[102:], "w1", "w2")
    with pytest.raises(ValueError) as e:
        load_draft_model(renamed, cfg)
    msg = str(e.value)
    assert "vocabulary size" not in msg and "vocab_size" not in msg
    assert "tokens only in the target (2): 'w100' (id 100), 'w101' (id 101)" in msg
    assert "tokens only in the draft (2): 'x100' (id 100), 'x101' (id 101)" in msg

    swapped = str(tmp_path / "swapped")  # same tokens, two ids exchanged
    build_random_model("llama", swapped, seed=4, num_hidden_layers=1)
    _save_tokenizer(swapped, words[:7] + ["w8", "w7"] + words[9:], "w1", "w2")
    with pytest.raises(ValueError) as e:
        load_draft_model(swapped, cfg)
    assert (
        "tokens with different ids (2): 'w7' (id 7 in the target, 8 in the draft), "
        "'w8' (id 8 in the target, 7 in the draft)"
    ) in str(e.value)

    special = str(tmp_path / "special")  # same vocabulary, another end-of-sequence token
    build_random_model("llama", special, seed=4, num_hidden_layers=1)
    _save_tokenizer(special, words, "w3", "w2")
    with pytest.raises(ValueError) as e:
        load_draft_model(special, cfg)
    msg = str(e.value)
    assert "tokens only" not in msg and "different ids" not in msg
    assert "eos_token_id: 1 in the target, 3 in the draft" in msg
    assert (
        "special tokens (token: id): target [('w1', 1), ('w2', 2)], draft [('w2', 2), ('w3', 3)]"
    ) in msg


def test_unknown_draft_names_the_choices(model_factory):
    _, path = model_factory("llama")
    with pytest.raises(ValueError, match="unknown draft 'nope'.*self-int4"):
        tandem.LLM(path, num_blocks=64, speculative="nope")
    with pytest.raises(ValueError, match=r"N must be in \[1, 2\]"):
        tandem.LLM(path, num_blocks=64, speculative="self:3")
