"""Tokenizer and chat template, backed by a Hugging Face fast tokenizer built from local files."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from functools import cache, cached_property
from typing import Any

# Token ids whose text and bytes a Tokenizer remembers for logprobs (a few MB).
PIECES_CACHED = 1 << 16

# SentencePiece's byte-fallback pieces: one byte each.
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


# Where transformers' decode of a fast tokenizer is defined, in the versions we run: what it
# does there is the Rust backend's decode, then a clean-up that is off by default.
_PLAIN_DECODE_MODULES = (
    "transformers.tokenization_utils_base",
    "transformers.tokenization_utils_tokenizers",
    "transformers.tokenization_utils_fast",
)


def _backend_decode(hf_tokenizer: Any) -> Callable[..., str] | None:
    """The Rust backend's `decode` when transformers' would return just what it returns (a fast
    tokenizer whose class overrides neither `decode` nor `_decode`, without the clean-up of
    spaces), else None. The gateway decodes twice per streamed token; transformers' wrapper
    (argument conversion, batch checks) took about twice the backend's own time."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(hf_tokenizer, "clean_up_tokenization_spaces", True):
        return None
    cls = type(hf_tokenizer)
    for name in ("decode", "_decode"):
        fn = getattr(cls, name, None)
        if getattr(fn, "__module__", None) not in _PLAIN_DECODE_MODULES:
            return None
    return backend.decode


class Tokenizer:
    """Encodes text, decodes ids and applies the model's chat template."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        eos = list(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None and hf_tokenizer.eos_token_id not in eos:
            eos.append(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: list[int] = eos
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self._backend_decode = _backend_decode(hf_tokenizer)
        self._pieces: dict[int, tuple[str, list[int]]] = {}  # token_pieces' memory

    @classmethod
    def from_dir(cls, path: str, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Load `tokenizer.json` / `tokenizer_config.json` from a local model directory."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path, local_files_only=True), eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(ids))

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """The bytes of each token's text, as the model's vocabulary defines it: part of a
        character's UTF-8 bytes where the vocabulary splits a character over several tokens
        (where `decode` of that token alone gives U+FFFD). A special token's bytes are those of
        its text."""
        kind, added = self._vocab_kind, self._added_tokens
        out = []
        for t, piece in zip(ids, self.convert_ids_to_tokens(ids), strict=True):
            if piece is None or t in added:
                out.append(self.decode([t], skip_special_tokens=False).encode())
            elif kind == "byte_level":
                chars = _byte_level_chars()
                out.append(
                    bytes(chars[c] for c in piece)
                    if all(c in chars for c in piece)
                    else piece.encode()
                )
            elif kind == "metaspace" and (m := _BYTE_PIECE.fullmatch(piece)):
                out.append(bytes([int(m.group(1), 16)]))
            elif kind == "metaspace":
                out.append(piece.replace("\u2581", " ").encode())
            else:
                out.append(self.decode([t], skip_special_tokens=False).encode())
        return out

    def token_pieces(self, ids: Sequence[int]) -> list[tuple[str, list[int]]]:
        """Each token's text alone (`decode([t])`, special tokens kept) and its bytes
        (`token_bytes`) as a list, as the logprobs of the chat API report them. Remembered per id
        (up to PIECES_CACHED ids), so that a response of many tokens, each with its top
        alternatives, costs a lookup per entry. The lists are shared: read, never change them."""
        cache = self._pieces
        missing = [t for t in dict.fromkeys(ids) if t not in cache]
        if missing:
            if len(cache) + len(missing) > PIECES_CACHED:
                cache.clear()
            for t, raw in zip(missing, self.token_bytes(missing), strict=True):
                cache[t] = (self.decode([t], skip_special_tokens=False), list(raw))
        return [cache[t] for t in ids]

    @cached_property
    def _vocab_kind(self) -> str:
        """The vocabulary's kind, from the tokenizer's decoder: byte_level (GPT-2's byte
        alphabet), metaspace (SentencePiece: U+2581 for a space, <0xNN> byte pieces) or other."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        if decoder is None:
            return "other"
        # The decoder's own JSON (a few bytes), not the whole tokenizer's (megabytes).
        dec = json.loads(decoder.__getstate__())
        types = {dec.get("type")} | {d.get("type") for d in dec.get("decoders") or []}
        if "ByteLevel" in types:
            return "byte_level"
        if "Metaspace" in types or "ByteFallback" in types:
            return "metaspace"
        return "other"

    @cached_property
    def _added_tokens(self) -> frozenset[int]:
        """Ids of tokens added beside the vocabulary (special tokens): their text is literal."""
        return frozenset(int(i) for i in (getattr(self.hf, "added_tokens_decoder", None) or {}))

    @property
    def chat_template(self) -> str | None:
        t = getattr(self.hf, "chat_template", None)
        return t if isinstance(t, str) else None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Render chat messages (and the tools a template takes) and tokenize the result."""
        if not self.has_chat_template:
            # No template: a plain transcript, so base models still answer something sensible.
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            if add_generation_prompt:
                text += "assistant:"
            return self.encode(text)
        extra = {"tools": tools} if tools else {}
        text = self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
        # The template already holds BOS where the model wants it.
        return self.encode(text, add_special_tokens=False)
