"""Recent Responses API conversations, kept in memory for `previous_response_id`.

A bounded LRU map from (tenant, response id) to the conversation that response ended: its
input messages (without the request's `instructions`, which OpenAI does not carry over) and
its output as an assistant message. The oldest entry goes when a new one would pass `size`;
reading an entry makes it the newest. A tenant never sees another tenant's responses."""

from __future__ import annotations

from collections import OrderedDict


class ResponseStore:
    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[tuple[str, str], list[dict]] = OrderedDict()

    def put(self, tenant: str, response_id: str, messages: list[dict]) -> None:
        self._entries[(tenant, response_id)] = messages
        self._entries.move_to_end((tenant, response_id))
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> list[dict] | None:
        """The conversation ended by `response_id` (a copy), or None when it is not kept."""
        messages = self._entries.get((tenant, response_id))
        if messages is None:
            return None
        self._entries.move_to_end((tenant, response_id))
        return list(messages)
