"""A decode worker's `Session` stream, read on a thread of its own.

The token messages (one per engine step, every sequence's new tokens) are read by a thread that
blocks on the stream and hands each to the event loop as it arrives. Read from the event loop
instead, the stream yields one message per pass of the loop: once the loop is busy relaying a
step to hundreds of client streams, the next steps wait unread in the stream, every request's
queue holds one step at a time, and each token costs a client write of its own however far
behind the gateway falls. Read here, the steps that arrived meanwhile are all in the requests'
queues when their turn comes, and each request sends them as one chunk: the gateway relays more
tokens per write the busier it is.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import grpc

from tandem.rpc import stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import StageCredentials, stage_channel_sync


class DecodeStream:
    """One `Decode.Session` call on a channel of its own: `send` puts a `DecodeIn` on it (from
    any thread); each `DecodeOut` goes to `on_message` on the event loop, then once the stream
    ended (not by `close`), `on_end(stream, reason, public reason)`."""

    def __init__(
        self,
        address: str,
        credentials: StageCredentials | None,
        options: Sequence[tuple[str, object]],
        on_message: Callable[[stages_pb2.DecodeOut], None],
        on_end: Callable[[DecodeStream, str, str], None],
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_message = on_message
        self._on_end = on_end
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self.ended = False
        self._channel = stage_channel_sync(address, credentials, options)
        self._call = stages_pb2_grpc.DecodeStub(self._channel).Session(self._requests())
        self._thread = threading.Thread(
            target=self._read, name=f"decode-session {address}", daemon=True
        )
        self._thread.start()

    def _requests(self) -> Iterator[stages_pb2.DecodeIn]:
        while (msg := self._out.get()) is not None:
            yield msg

    def send(self, msg: stages_pb2.DecodeIn) -> None:
        self._out.put(msg)

    def _read(self) -> None:
        try:
            for out in self._call:
                self._loop.call_soon_threadsafe(self._on_message, out)
            reason = public = "decode worker closed the stream"
        except grpc.RpcError as e:
            reason = f"decode worker unavailable ({e.code().name}): {e.details()}"
            # Clients learn what failed, not where (gRPC's details name addresses): the log
            # (mark_down) has the rest.
            public = f"decode worker unavailable ({e.code().name}); retry later"
        finally:
            self._out.put(None)  # ends the request side too
        if not self._closed:
            try:
                self._loop.call_soon_threadsafe(self._ended, reason, public)
            except RuntimeError:
                pass  # the event loop is closed: nobody is left to tell

    def _ended(self, reason: str, public: str) -> None:
        self.ended = True
        if not self._closed:
            self._on_end(self, reason, public)

    def close(self) -> None:
        """End the stream; `on_end` is not called."""
        self._closed = self.ended = True
        self._out.put(None)
        self._call.cancel()
        self._channel.close()
