"""The gateway's fan-out of a decode worker's token messages to a request: messages that queued
up while the request's task was busy go out as one delta, with every token, its logprobs and
the text, in order, and the event behind them (the finish) still comes after."""

from __future__ import annotations

import asyncio

from services.gateway.pipeline import Finished, TextDelta
from tandem.api.sampling_params import SamplingParams
from tandem.rpc import api_pb2, stages_pb2
from tests.test_gateway_lease import _pipeline


class _NoPushStub:
    async def Reserve(self, request, timeout=None):
        return stages_pb2.ReserveResponse(refused="this stand-in takes no pushes")


class QueuedDecode:
    """A decode worker whose whole answer is already queued when the request opens it (it
    takes no pushed KV: the KV is pulled)."""

    address = "decode:0"
    healthy = True
    full = False
    stub = _NoPushStub()

    def __init__(self, events: list[tuple]) -> None:
        self.events = events
        self.cancelled: list[str] = []

    async def open(self, seq_id, admit):
        q: asyncio.Queue = asyncio.Queue()
        for ev in self.events:
            q.put_nowait(ev)
        return q

    def cancel(self, seq_id):
        self.cancelled.append(seq_id)

    def close_seq(self, seq_id):
        pass

    async def capacity(self):
        return 0


def _tokens(ids: list[int], logprob: float, proposed: int) -> tuple:
    lps = [api_pb2.TokenLogprob(token_id=t, logprob=logprob) for t in ids]
    msg = stages_pb2.SeqTokens(token_ids=ids, logprobs=lps, proposed_draft_tokens=proposed)
    return ("tokens", msg, 0.0)


def test_queued_token_messages_go_out_as_one_delta():
    async def go():
        pipe, router = _pipeline()
        batches = [[6, 7], [8], [9, 10, 11], [12]]
        events = [_tokens(b, -0.5 * i, proposed=i + 1) for i, b in enumerate(batches)]
        done = stages_pb2.SeqFinished(finish_reason="length", proposed_draft_tokens=9)
        router.decode[0] = QueuedDecode([*events, ("finished", done, 0.0)])
        params = SamplingParams(max_tokens=8, logprobs=0)
        out = [ev async for ev in pipe.run([1, 2, 3], params)]
        deltas = [ev for ev in out if isinstance(ev, TextDelta)]
        # The prefill worker's first token, then every queued message in one delta.
        assert [d.token_ids for d in deltas] == [[5], [6, 7, 8, 9, 10, 11, 12]]
        lps = deltas[1].logprobs
        assert [lp.token_id for lp in lps] == [6, 7, 8, 9, 10, 11, 12]
        assert [lp.logprob for lp in lps] == [0.0, 0.0, -0.5, -1.0, -1.0, -1.0, -1.5]
        text = router_text(list(range(5, 13)))
        assert "".join(d.text for d in deltas) == text
        assert isinstance(out[-1], Finished) and out[-1].reason == "length"
        assert out[-1].completion_tokens == 8 and out[-1].proposed_draft_tokens == 9

    asyncio.run(go())


def router_text(ids: list[int]) -> str:
    return "".join(chr(97 + i % 26) for i in ids)  # FakeTokenizer's text of `ids`
