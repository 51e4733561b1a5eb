"""The bytes of each token (the chat API's logprobs `bytes`): joined, a text's tokens give back
its UTF-8 bytes exactly, characters split over several tokens included."""

from __future__ import annotations

import pytest

TEXTS = ["héllo 😀 wörld", "日本語のテキスト", "a\tb\n  c", "€ in one, 👩‍👩‍👧 in many"]


@pytest.fixture(scope="module")
def smollm2():
    from tandem.config import EngineConfig
    from tandem.model.info import load_model_info

    _, tok, _ = load_model_info(EngineConfig.from_options().model)
    return tok


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_tokens_join_to_the_text(smollm2, text):
    ids = smollm2.encode(text, add_special_tokens=False)
    parts = smollm2.token_bytes(ids)
    assert b"".join(parts) == text.encode()
    if any(ord(c) > 0x7FF for c in text):  # some character is split over tokens
        assert any(smollm2.decode([t]) == "\ufffd" for t in ids)


def test_a_special_token_is_its_text(smollm2):
    ids = smollm2.encode("<|im_start|>user", add_special_tokens=False)
    assert smollm2.token_bytes(ids)[0] == b"<|im_start|>"


def _sentencepiece_like():
    """A byte-fallback BPE vocabulary as SentencePiece models have (Llama 2, Mistral): U+2581
    for a space, <0xNN> pieces for bytes outside the vocabulary."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tandem.model.tokenizer import Tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "c", "é", "▁a", "ab"]:
        vocab[piece] = len(vocab)
    bpe = models.BPE(vocab, [("▁", "a"), ("a", "b")], unk_token="<unk>", byte_fallback=True)
    tk = HfTokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>")
    return Tokenizer(hf)


@pytest.mark.parametrize("text", ["ab c", "abé 😀b", "a日b"])
def test_byte_fallback_tokens_join_to_the_text(text):
    tok = _sentencepiece_like()
    ids = tok.encode(text, add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    parts = tok.token_bytes(ids)
    # The pre-tokenizer marks every word's start with U+2581, the first word's too.
    assert b"".join(parts) == (" " + text).encode()
    if any(len(c.encode()) > 1 and c != "é" for c in text):
        assert any(p.startswith("<0x") for p in pieces)  # bytes outside the vocabulary
        assert any(len(b) == 1 and b[0] >= 0x80 for b in parts)


@pytest.mark.parametrize("vocab", ["smollm2", "sentencepiece"])
def test_token_pieces_are_each_tokens_text_and_bytes(smollm2, vocab, monkeypatch):
    """What the chat API's logprobs report per token, remembered per id: the same as decoding
    the token alone and its bytes, on a first call, from the cache, and after the cache (made
    small here) is cleared."""
    from tandem.model import tokenizer as tokenizer_module

    tok = smollm2 if vocab == "smollm2" else _sentencepiece_like()
    monkeypatch.setattr(tokenizer_module, "PIECES_CACHED", 64)
    ids = list(range(0, tok.vocab_size, max(1, tok.vocab_size // 150)))[:150]
    ids += ids[:10] + tok.encode("<|im_start|>é 😀", add_special_tokens=False)
    want = [
        (tok.decode([t], skip_special_tokens=False), list(tok.token_bytes([t])[0])) for t in ids
    ]
    for start in range(0, len(ids), 40):  # batches that hit, miss and overflow the cache
        assert tok.token_pieces(ids[start : start + 40]) == want[start : start + 40]
    assert tok.token_pieces(ids[:5]) == want[:5]
    assert len(tok._pieces) <= 64


def test_vocab_kind_from_the_decoder(smollm2):
    assert smollm2._vocab_kind == "byte_level"
    assert _sentencepiece_like()._vocab_kind == "metaspace"
