"""Incremental detokenization against a decode of the whole output: the same text whatever the
ids and however they arrive, split characters held back until complete, stop strings cut where
they begin, and a cost per id that does not grow with the output."""

from __future__ import annotations

import copy
import random

import pytest

from tandem.api.detokenizer import IncrementalDetokenizer
from tandem.model.tokenizer import Tokenizer
from tests.test_token_bytes import _sentencepiece_like

TEXTS = [
    "héllo 😀 wörld, and then some",
    "日本語のテキストです。",
    "a\tb\n  c  d",
    "👩‍👩‍👧 € ☕ end",
]


@pytest.fixture(scope="module")
def smollm2():
    from tandem.config import EngineConfig
    from tandem.model.info import load_model_info

    _, tok, _ = load_model_info(EngineConfig.from_options().model)
    return tok


@pytest.fixture(scope="module", params=["byte-level BPE", "byte-fallback SentencePiece"])
def tok(request, smollm2):
    return smollm2 if request.param == "byte-level BPE" else _sentencepiece_like()


def whole(tok, prompt: list[int], out: list[int]) -> str:
    """The reference: the output's text as a decode of the prompt's last ids and the output
    together gives it (the detokenizer's contract)."""
    ctx = prompt[-4:]
    full, head = tok.decode(ctx + out, skip_special_tokens=True), tok.decode(ctx, True)
    return full[len(head) :] if full.startswith(head) else tok.decode(out, True)


def feed(d: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    deltas, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 5])
        deltas.append(d.add(ids[i : i + n]))
        i += n
    deltas.append(d.finish())
    return deltas


@pytest.mark.parametrize("seed", range(6))
def test_any_ids_in_any_chunks_give_the_whole_decode(smollm2, seed):
    # Byte-level BPE: any ids, partial characters and special tokens included.
    rng = random.Random(seed)
    vocab = smollm2.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
    out = [rng.randrange(vocab) for _ in range(rng.randrange(1, 200))]
    d = IncrementalDetokenizer(smollm2, prompt)
    assert "".join(feed(d, out, rng)) == whole(smollm2, prompt, out)
    assert d.output_ids == out


# Characters of one to four UTF-8 bytes, spaces and newlines.
ALPHABET = "abc xyz\n.,éøß€日本語😀☕👩"


@pytest.mark.parametrize("seed", range(6))
def test_any_text_in_any_chunks_gives_the_whole_decode(tok, seed):
    # Byte fallback decodes runs of bytes together: ids drawn at random would be invalid UTF-8
    # whose replacement characters depend on where a decode starts, so these are a text's ids.
    rng = random.Random(seed)
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(1, 120)))
    prompt = tok.encode("Say:", add_special_tokens=False)
    out = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt)
    deltas = feed(d, out, rng)
    assert "".join(deltas) == whole(tok, prompt, out)
    assert not any("\ufffd" in x for x in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_a_text_comes_back_with_no_broken_character(tok, text):
    prompt = tok.encode("Say:", add_special_tokens=False)
    ids = tok.encode(" " + text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt)
    deltas = feed(d, ids, random.Random(0))
    assert "".join(deltas) == whole(tok, prompt, ids)
    assert text in "".join(deltas)
    # A character split over ids is held back until its last byte: no delta carries U+FFFD.
    assert not any("\ufffd" in x for x in deltas)


@pytest.mark.parametrize("stop", ["wör", "😀", "and then", "no such text"])
def test_stop_strings_cut_where_they_begin(smollm2, stop):
    text = TEXTS[0]
    ids = smollm2.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(smollm2, [], stop=[stop])
    got = ""
    for i in range(len(ids)):
        got += d.add_until_stop(ids[i : i + 1])[0]
        if d.stopped_by is not None:
            break
    got += d.finish()
    want = text.split(stop)[0]
    assert got == want and d.stopped_by == (stop if stop in text else None)
    # In one message, the ids past the one completing the stop string are not output.
    d = IncrementalDetokenizer(smollm2, [], stop=[stop])
    got, n = d.add_until_stop(ids)
    assert got + d.finish() == want and len(d.output_ids) == n
    if stop in text:
        assert stop in smollm2.decode(ids[:n]) and stop not in smollm2.decode(ids[: n - 1])


def _min_tokens_reference(tok, ids: list[int], stop: str, m: int) -> tuple[str, int]:
    """The output under `min_tokens=m` by brute force: the first id count k >= m whose text
    holds `stop` ending past the text of the first m - 1 ids; the text up to that match, and k
    (the whole text and len(ids) when none)."""
    floor = len(tok.decode(ids[: max(0, m - 1)], skip_special_tokens=True))
    for k in range(max(m, 1), len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=True)
        i = text.find(stop, max(0, floor - len(stop) + 1))
        if i != -1:
            return text[:i], k
    return tok.decode(ids, skip_special_tokens=True), len(ids)


@pytest.mark.parametrize("m", [0, 1, 2, 5, 9, 40])
@pytest.mark.parametrize("seed", range(3))
def test_min_tokens_holds_stop_strings_back(smollm2, m, seed):
    """No stop string ends the output within the first min_tokens - 1 ids' text, whatever the
    chunks the ids arrive in."""
    text = "one, two, three, four, five, six, seven, eight, nine, ten, eleven"
    ids = smollm2.encode(text, add_special_tokens=False)
    want, k = _min_tokens_reference(smollm2, ids, ",", m)
    rng = random.Random(seed)
    d = IncrementalDetokenizer(smollm2, [], stop=[","], min_tokens=m)
    got, pos, used = "", 0, 0
    while pos < len(ids) and d.stopped_by is None:
        step = rng.randint(1, 4)
        delta, n = d.add_until_stop(ids[pos : pos + step])
        got, used, pos = got + delta, used + n, pos + step
    got += d.finish()
    assert (got, used) == (want, k)
    if m > 2:  # "one" "," " two" ...: the first comma is the second id
        assert want.count(",") >= 1  # the test's stops really were held back


def test_the_cost_of_an_id_does_not_grow_with_the_output(smollm2):
    """Ids decoded per added id stay bounded: a decode of the whole output at every step made
    a sequence of n ids cost n^2 / 2."""
    decoded = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            decoded.append(len(ids))
            return smollm2.decode(ids, skip_special_tokens=skip_special_tokens)

    prompt = smollm2.encode("Say:", add_special_tokens=False)
    ids = smollm2.encode(" ".join(TEXTS * 40), add_special_tokens=False)
    assert len(ids) > 1000
    d = IncrementalDetokenizer(Counting(), prompt)
    text = "".join(feed(d, ids, random.Random(1)))
    assert text == whole(smollm2, prompt, ids)
    assert sum(decoded) < 20 * len(ids), sum(decoded) / len(ids)


def test_decode_gives_what_transformers_decode_gives(tok, smollm2):
    """`Tokenizer.decode` goes straight to the fast tokenizer's backend where transformers'
    wrapper would add nothing (the default model's does): the same text as the wrapper's for
    any ids, special ones among them, skipped or not."""
    assert smollm2._backend_decode is not None
    rng = random.Random(0)
    n = len(tok.hf)
    specials = list(tok.hf.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(n) for _ in range(rng.randint(0, 12))]
        if specials and rng.random() < 0.5:
            ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        for skip in (True, False):
            assert tok.decode(ids, skip) == tok.hf.decode(ids, skip_special_tokens=skip)


def test_decode_keeps_transformers_clean_up_of_spaces(smollm2):
    """A tokenizer whose decode cleans up spaces after the backend keeps transformers' decode."""
    hf = copy.copy(smollm2.hf)
    hf.clean_up_tokenization_spaces = True
    assert Tokenizer(hf)._backend_decode is None
