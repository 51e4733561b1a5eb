"""The client's side of the bidirectional streams (`Gateway.Chat`, `Decode.Session`)."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

from tandem.rpc import api_pb2, stages_pb2, stages_pb2_grpc


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


def admit_one(
    stub: stages_pb2_grpc.DecodeStub, admit: stages_pb2.Admit, timeout: float = 60.0
) -> tuple[list[int], stages_pb2.SeqFinished]:
    """Admit one sequence on a `Decode.Session` of our own, held open until it ends: (its token
    ids, its SeqFinished)."""
    outbox = Outbox()
    outbox.put(stages_pb2.DecodeIn(admit=admit))
    call = stub.Session(outbox.requests(), timeout=timeout)
    tokens: list[int] = []
    try:
        for out in call:
            for t in out.tokens:
                if t.seq_id == admit.seq_id:
                    tokens += t.token_ids
            for f in out.finished:
                if f.seq_id == admit.seq_id:
                    return tokens, f
    finally:
        outbox.close()
        call.cancel()
    raise AssertionError("the decode session ended without finishing the sequence")
