"""A quantized LM head and token embedding (recipe overrides `lm_head`, `model.embed_tokens`):
the recipe rules, `tandem quantize` writing them, and models computing the same logits as a float
model holding the dequantized tables."""

from __future__ import annotations

import json

import pytest
import torch

import tandem
from tandem.formats.weight import LayerSpec, QuantizedWeight
from tandem.quant.recipe import Recipe, RecipeError, head_specs, resolve_specs
from tests.engine_checks import assert_equal_up_to_a_near_tie, run_to_completion


def test_head_specs_only_where_an_override_names_them() -> None:
    assert head_specs(Recipe(LayerSpec(4, 32)), tied=False) == {}
    r = Recipe.from_dict(
        {
            "default": {"bits": 4},
            "overrides": {"lm_head": {"bits": 4}, "model.embed_tokens": {"bits": 8}},
        }
    )
    assert head_specs(r, tied=False) == {
        "lm_head": LayerSpec(4, 128, True),
        "model.embed_tokens": LayerSpec(8, 128, True),
    }
    # Tied: one table, stored as the embedding, at the more precise of the two specs.
    assert head_specs(r, tied=True) == {"model.embed_tokens": LayerSpec(8, 128, True)}
    only_head = Recipe.from_dict({"overrides": {"lm_head": {"bits": 4, "group_size": 64}}})
    assert head_specs(only_head, tied=True) == {"model.embed_tokens": LayerSpec(4, 64, True)}
    # bits 16 keeps a table in floating point; decoder patterns do not reach the head.
    keep = Recipe.from_dict({"overrides": {"lm_head": {"bits": 16}, "*.down_proj": {"bits": 8}}})
    assert head_specs(keep, tied=False) == {}
    # The head names are valid override targets (no "matches no layer" error), typos are not.
    assert "lm_head" not in resolve_specs(r, 2)
    with pytest.raises(RecipeError, match="lm_haed"):
        resolve_specs(Recipe.from_dict({"overrides": {"lm_haed": {"bits": 4}}}), 2)


def _generate(loaded) -> list[list[int]]:
    from tandem.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    eng = LLMEngine(loaded, EngineConfig(num_blocks=32))
    sp = tandem.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    eng.add_request([5, 9, 33, 100, 7], sp, request_id="a")
    eng.add_request([11, 12], sp, request_id="b")
    return run_to_completion(eng)


@pytest.mark.parametrize("kind", ["llama", "llama3"], ids=["untied", "tied"])
def test_quantized_head_and_embedding_equal_dequantized_float(model_factory, tmp_path, kind):
    """`tandem quantize --method rtn` with the head and embedding named: the checkpoint holds
    them as QuantizedWeights, and the model's logits equal a float model's on the dequantized
    weights (on CPU up to the INT4 kernel's bfloat16 rounding, the best logits exactly)."""
    from tandem.cli import main
    from tandem.formats.weight import dequantize_weights
    from tandem.model.llama import LlamaModel
    from tandem.model.loader import LoadedModel, load_model

    _, path = model_factory(kind)
    recipe = tmp_path / "r.json"
    recipe.write_text(
        json.dumps(
            {
                "default": {"bits": 4, "group_size": 32},
                "overrides": {"lm_head": {"bits": 4}, "model.embed_tokens": {"bits": 8}},
            }
        )
    )
    out = tmp_path / "q"
    assert (
        main(["quantize", path, "--method", "rtn", "--recipe", str(recipe), "--out", str(out)]) == 0
    )
    meta = json.loads((out / "quantization.json").read_text())
    back = load_model(str(out))
    emb = back.weights["model.embed_tokens.weight"]
    assert isinstance(emb, QuantizedWeight) and emb.bits == 8
    if kind == "llama":
        head = back.weights["lm_head.weight"]
        assert isinstance(head, QuantizedWeight) and (head.bits, head.group_size) == (4, 32)
        assert meta["head_layers"] == {"lm_head": "rtn", "model.embed_tokens": "rtn"}
    else:  # tied: the one table takes the more precise spec (8 bits) and serves as the head
        assert "lm_head.weight" not in back.weights
        assert meta["head_layers"] == {"model.embed_tokens": "rtn"}

    cfg = back.config
    quant = LlamaModel(cfg, back.weights)
    ref = LlamaModel(cfg, dequantize_weights(back.weights, torch.float32))
    assert isinstance(quant.lm_head.weight, QuantizedWeight)
    assert isinstance(quant.embed.weight, QuantizedWeight)
    ids = torch.tensor([3, 0, cfg.vocab_size - 1, 17])
    assert torch.equal(quant.embed_tokens(ids), ref.embed_tokens(ids))
    hidden = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    got = quant.logits(hidden)
    want = ref.logits(hidden)
    # The quantized head on CPU is the bfloat16 INT4 kernel (tandem.kernels.cpu_int4) with each
    # row's best logits computed again in float32 (tandem.layers.embedding.cpu_logits): those
    # equal the float model's to float32 rounding, the rest to bfloat16's.
    best = want.topk(8, dim=-1).indices
    torch.testing.assert_close(got.gather(1, best), want.gather(1, best), rtol=1e-5, atol=1e-5)
    assert ((got - want).abs() <= 2**-7 * want.abs().amax()).all()
    # The quantized head is not the float one: the check above can tell them apart.
    float_head = LlamaModel(cfg, load_model(path).weights)
    assert (got - float_head.logits(hidden)).abs().max() > 1e-3
    # Whole engines: the quantized checkpoint generates the dequantized model's tokens.
    assert_equal_up_to_a_near_tie(
        _generate(back),
        _generate(
            LoadedModel(
                cfg, dequantize_weights(back.weights, torch.float32), back.tokenizer, str(out)
            )
        ),
    )
