"""Tokenizer and chat template, backed by a Hugging Face fast tokenizer built from local files."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Tokenizer:
    """Encodes text, decodes ids and applies the model's chat template."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        eos = list(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None and hf_tokenizer.eos_token_id not in eos:
            eos.append(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: list[int] = eos
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id

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
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(ids))

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
