"""The client's side of the bidirectional streams (`Gateway.Chat`, `Decode.Session`)."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

from tandem.rpc import api_pb2


class Outbox:
    """Messages of a client stream, sent as they are put: pass `requests()` to the call and
    `put` messages while reading its responses; `close()` ends the client's side."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()

    def put(self, message: Any) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)

    def requests(self) -> Iterator[Any]:
        while (m := self._queue.get()) is not None:
            yield m


def chat_turn(text: str, **sampling) -> api_pb2.ChatRequest:
    """A `Gateway.Chat` turn: one user message and its sampling parameters."""
    return api_pb2.ChatRequest(
        turn=api_pb2.ChatTurn(
            messages=[api_pb2.ChatMessage(role="user", content=text)],
            sampling=api_pb2.SamplingParams(**sampling),
        )
    )
