"""The embedded default model (SmolLM2-135M-Instruct GGUF) answers exactly as transformers does."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import tandem
from tandem.model.info import default_model_path

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    folder, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def llm():
    return tandem.LLM()


def _reference_ids(tok, ids):
    ref_ids = tok.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    if isinstance(ref_ids, dict) or hasattr(ref_ids, "input_ids"):
        ref_ids = ref_ids["input_ids"]
    assert ids == list(ref_ids)


def _hf_greedy(model, tok, ids: list[int], n: int) -> list[int]:
    return model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=tok.eos_token_id,
    )[0, len(ids) :].tolist()


def test_greedy_chat_reply_equals_transformers_up_to_near_ties(llm, hf_model):
    """The default engine on CPU reads the GGUF codes through the bfloat16 INT4 kernel
    (`tandem.kernels.cpu_int4`), which rounds activations, scales and outputs to bfloat16. As
    on the GPU (tests/gpu/test_engine_gpu.py), where transformers' two best tokens are within a
    few times its own bfloat16 error of each other the engine may pick the other one: every pick
    must be the float32 argmax up to 6x transformers' bfloat16 error at that position (+1e-3),
    and the reply must equal transformers' up to the first such near-tie."""
    tok, model = hf_model
    ids = llm.chat_prompt(QUESTION)
    _reference_ids(tok, ids)
    n = 48
    out = llm.generate([ids], tandem.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[
        0
    ]
    assert len(out.token_ids) == n
    assert out.text.startswith("The capital of France is Paris.")
    ref = _hf_greedy(model, tok, ids, n)
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        x = torch.tensor([ids + out.token_ids[:-1]])
        l32 = model(x).logits[0, len(ids) - 1 :].double()  # [n, V]: the logits each pick saw
        l16 = model16(x).logits[0, len(ids) - 1 :].double()
    tol = 6 * (l16 - l32).abs().amax(dim=-1) + 1e-3
    ours = torch.tensor(out.token_ids)
    gap = l32.amax(dim=-1) - l32.gather(1, ours[:, None]).squeeze(1)
    assert (gap <= tol).all(), f"picks beyond the tolerance at {(gap > tol).nonzero().tolist()}"
    first = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref, strict=True)) if a != b), n)
    if first < n:  # the same prefix, so l32[first] are transformers' logits there too
        top2 = l32[first].topk(2).values
        assert top2[0] - top2[1] <= tol[first], f"differs at {first}, not a near-tie"


def test_float_engine_equals_transformers_exactly(hf_model):
    """With the weights dequantized to float32 (quantization none) the greedy reply is
    transformers' token for token."""
    tok, model = hf_model
    llm = tandem.LLM(quantization="none")
    ids = llm.chat_prompt(QUESTION)
    sp = tandem.SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    out = llm.generate([ids], sp)[0]
    assert out.token_ids == _hf_greedy(model, tok, ids, 48)
    assert "Paris" in out.text


def test_batch_of_chats_equals_one_by_one(llm):
    questions = [
        "Name a primary colour.",
        "What is 2 + 2?",
        "Say hello in French.",
        "Who wrote Hamlet?",
    ]
    prompts = [llm.chat_prompt([{"role": "user", "content": q}]) for q in questions]
    sp = tandem.SamplingParams(max_tokens=24, temperature=0)
    batched = llm.generate(prompts, sp)
    for p, b in zip(prompts, batched, strict=True):
        assert llm.generate([p], sp)[0].token_ids == b.token_ids


def test_tokenizer_from_the_cache_equals_the_one_built_from_the_gguf(tmp_path, monkeypatch):
    """The tokenizer built from the GGUF vocabulary is kept in the cache directory; the copy
    read back at the next start tokenizes, decodes and templates exactly as a fresh build."""
    from tandem.model.info import load_model_info

    monkeypatch.setenv("TANDEM_CACHE_DIR", "none")
    _, fresh, _ = load_model_info()
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    _, first, _ = load_model_info()  # builds and saves
    saved = list((tmp_path / "tokenizers").iterdir())
    assert len(saved) == 1 and (saved[0] / "tokenizer.json").is_file()
    _, cached, _ = load_model_info()  # reads the saved copy
    texts = ["Hello world", "  naïve café — 東京 🚀\n\ttabs", "<|im_start|>user\nhi<|im_end|>", ""]
    for tok in (first, cached):
        assert tok.vocab_size == fresh.vocab_size
        assert tok.eos_token_ids == fresh.eos_token_ids
        for t in texts:
            assert tok.encode(t) == fresh.encode(t)
            ids = fresh.encode(t)
            assert tok.decode(ids, skip_special_tokens=False) == fresh.decode(
                ids, skip_special_tokens=False
            )
        assert tok.apply_chat_template(QUESTION) == fresh.apply_chat_template(QUESTION)
