"""Recent Responses API conversations, kept in memory for `previous_response_id`.

A bounded LRU map from (tenant, response id) to the conversation that response ended: its
input messages (without the request's `instructions`, which OpenAI does not carry over) and
its output as an assistant message. The oldest entries go when a new one would pass `size`
entries or `max_chars` characters of text in all (each conversation can be as long as the
model's context: a count alone let a thousand long ones hold gigabytes); a conversation
longer than `max_chars` alone is not kept. Reading an entry makes it the newest. A tenant
never sees another tenant's responses."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


def text_size(v: Any) -> int:
    """Characters of text in a conversation (its strings, keys among them; 8 a number)."""
    if isinstance(v, str):
        return len(v)
    if isinstance(v, dict):
        return sum(len(k) + text_size(x) for k, x in v.items())
    if isinstance(v, list):
        return sum(map(text_size, v))
    return 8


class ResponseStore:
    def __init__(self, size: int, max_chars: int = 256 << 20) -> None:
        self.size = size
        self.max_chars = max_chars
        self.chars = 0  # of the entries kept
        self._entries: OrderedDict[tuple[str, str], tuple[list[dict], int]] = OrderedDict()

    def put(self, tenant: str, response_id: str, messages: list[dict]) -> None:
        key = (tenant, response_id)
        old = self._entries.pop(key, None)
        if old is not None:
            self.chars -= old[1]
        n = text_size(messages)
        if n > self.max_chars:
            return
        self._entries[key] = (messages, n)
        self.chars += n
        while len(self._entries) > self.size or self.chars > self.max_chars:
            self.chars -= self._entries.popitem(last=False)[1][1]

    def get(self, tenant: str, response_id: str) -> list[dict] | None:
        """The conversation ended by `response_id` (a copy), or None when it is not kept."""
        entry = self._entries.get((tenant, response_id))
        if entry is None:
            return None
        self._entries.move_to_end((tenant, response_id))
        return list(entry[0])
