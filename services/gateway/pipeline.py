"""One request through the stages: prefill -> KV handover -> decode, detokenized as it streams."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from services.gateway.router import Overloaded, Router, StageUnavailable
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.sampler import TokenLogprobs
from tandem.engine.sampling_params import SamplingParams
from tandem.model.tokenizer import Tokenizer
from tandem.rpc import stages_pb2
from tandem.rpc.convert import logprob_from_proto, sampling_to_proto

if TYPE_CHECKING:
    from services.gateway.observe import RequestTrace


@dataclass
class TextDelta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class Finished:
    reason: str  # stop | length | abort
    prompt_tokens: int
    completion_tokens: int
    timings: dict[str, float]
    stop_string: str | None = None
    kv_transport: str = "none"
    request_id: str = ""
    accepted_draft_tokens: int = 0
    proposed_draft_tokens: int = 0


class Pipeline:
    """Runs requests across the router's workers."""

    def __init__(
        self,
        router: Router,
        tokenizer: Tokenizer,
        eos_token_ids: set[int],
        max_model_len: int,
        max_waiting: int = 256,
        max_inflight: int = 1024,
    ) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.eos = eos_token_ids
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.max_inflight = max_inflight
        self.waiting = 0  # admitted, no first token yet
        self.inflight = 0  # admitted, not finished
        self._background: set[asyncio.Task] = set()

    def admit(self) -> None:
        """Refuse at once (rather than queue without bound) when a limit is reached."""
        if self.inflight >= self.max_inflight:
            raise Overloaded(
                f"gateway is at its limit of {self.max_inflight} requests in progress; retry later"
            )
        if self.waiting >= self.max_waiting:
            raise Overloaded(
                f"gateway is at its limit of {self.max_waiting} requests waiting for a first "
                "token; retry later"
            )

    def _stop_reason(
        self, params: SamplingParams, tok: int, n_out: int, n_total: int
    ) -> str | None:
        if tok in params.stop_token_ids or (not params.ignore_eos and tok in self.eos):
            return "stop"
        if n_out >= params.max_tokens or n_total >= self.max_model_len:
            return "length"
        return None

    async def run(
        self,
        ids: list[int],
        params: SamplingParams,
        request_id: str = "",
        trace: RequestTrace | None = None,
    ) -> AsyncIterator[TextDelta | Finished]:
        """Stream text deltas, then one `Finished`. Closing the iterator early cancels the request.

        Raises `Overloaded` before doing anything when a gateway limit is reached.
        """
        self.admit()
        self.inflight += 1
        self.waiting += 1
        state = {"waiting": True}
        try:
            async with aclosing(self._run(ids, params, request_id, state, trace)) as events:
                async for ev in events:
                    yield ev
        finally:
            self.inflight -= 1
            if state["waiting"]:
                self.waiting -= 1

    def _first_token_seen(self, state: dict) -> None:
        if state["waiting"]:
            state["waiting"] = False
            self.waiting -= 1

    async def _run(
        self,
        ids: list[int],
        params: SamplingParams,
        request_id: str,
        state: dict,
        trace: RequestTrace | None = None,
    ) -> AsyncIterator[TextDelta | Finished]:
        t0 = time.monotonic()
        seq_id = uuid.uuid4().hex
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop)
        if trace is not None:  # spans of this request: parent context, timed detokenizer
            detok = trace.detokenizer(detok)
        prefill = self.router.pick_prefill()  # raises StageUnavailable when none is up
        draft = self.router.pick_draft()
        if draft is not None:
            # The draft prefills its own state while the target prefills; failures only cost
            # speculation (the decode worker resends the whole sequence when the draft lacks it).
            draft.admit(seq_id, ids, trace.metadata() if trace is not None else None)
        prefill.inflight += 1
        # The prefill worker names the lease after `seq_id`; until a decode worker takes it over,
        # this request owns it and gives it back on every way out (cancel, stop, error).
        lease = {"owned": True, "id": seq_id}
        try:
            async with aclosing(
                self._stream(
                    ids, params, request_id, state, trace, t0, seq_id, detok, prefill, lease
                )
            ) as events:
                async for ev in events:
                    yield ev
        finally:
            if lease["owned"]:
                self._release_lease(prefill, lease["id"])

    def _release_lease(self, prefill, lease_id: str) -> None:
        async def release() -> None:
            try:
                await prefill.stub.Release(
                    stages_pb2.ReleaseRequest(lease_ids=[lease_id]), timeout=5
                )
            except grpc.aio.AioRpcError:
                pass  # the lease expires on its own

        # A task, not an await: this runs while a cancelled generator is being closed.
        task = asyncio.ensure_future(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _stream(
        self, ids, params, request_id, state, trace, t0, seq_id, detok, prefill, lease
    ) -> AsyncIterator[TextDelta | Finished]:
        try:
            resp = await prefill.stub.Run(
                stages_pb2.PrefillRequest(
                    request_id=seq_id, prompt_token_ids=ids, sampling=sampling_to_proto(params)
                ),
                metadata=trace.metadata() if trace is not None else None,
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from e
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise Overloaded(f"prefill worker {prefill.address} is full: {e.details()}") from e
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                prefill.mark_down(e.details() or "unavailable")
            raise StageUnavailable(
                f"prefill worker {prefill.address} failed: {e.code().name}: {e.details()}"
            ) from e
        finally:
            prefill.inflight -= 1
            self._first_token_seen(state)
        t_first = time.monotonic()
        lease["id"] = resp.kv.lease_id or seq_id
        first = resp.first_token
        n_out = 1
        reason = self._stop_reason(params, first, n_out, len(ids) + 1)
        text = detok.add([first])
        if detok.stopped_by is not None:
            reason = "stop"
        lps = [logprob_from_proto(resp.first_logprob)] if resp.has_logprob else []
        yield TextDelta(text, [first], lps)
        timings = {
            "queue_ms": resp.queue_ms,
            "prefill_ms": resp.prefill_ms,
            "ttft_ms": (t_first - t0) * 1e3,
            "kv_transfer_ms": 0.0,
        }
        transport = "none"
        spec = (0, 0)  # draft tokens proposed and accepted for this sequence
        if reason is None:
            decode = self.router.pick_decode()  # raises StageUnavailable when none is up
            admit = stages_pb2.Admit(
                seq_id=seq_id,
                prompt_token_ids=ids,
                first_token=first,
                sampling=sampling_to_proto(params),
                kv=resp.kv,
                prefill_address=prefill.address,
                rng_state=resp.rng_state,
                trace_context=trace.carrier() if trace is not None else {},
            )
            done = False
            try:
                q = await decode.open(seq_id, admit)
                lease["owned"] = False  # the decode worker releases it after its copy
                while not done:
                    kind, msg = await q.get()
                    if kind == "tokens":
                        toks = list(msg.token_ids)
                        n_out += len(toks)
                        text = detok.add(toks)
                        lps = [logprob_from_proto(m) for m in msg.logprobs]
                        if detok.stopped_by is not None:
                            reason, done = "stop", True
                        if text or toks:
                            yield TextDelta(text, toks, lps)
                    elif kind == "finished":
                        done = True
                        if msg.finish_reason == "error":
                            raise StageUnavailable(
                                f"decode worker {decode.address} failed: {msg.error}"
                            )
                        reason = reason or msg.finish_reason
                        timings["kv_transfer_ms"] = msg.kv_transfer_ms
                        transport = msg.kv_transport or transport
                        spec = (msg.proposed_draft_tokens, msg.accepted_draft_tokens)
                    else:  # the stream to the decode worker broke
                        done = True
                        raise StageUnavailable(msg)
            finally:
                if not done or reason == "stop" and detok.stopped_by is not None:
                    decode.cancel(seq_id)
                decode.close_seq(seq_id)
        tail = detok.finish()
        if tail:
            yield TextDelta(tail, [])
        t_end = time.monotonic()
        timings["total_ms"] = (t_end - t0) * 1e3
        timings["mean_tpot_ms"] = (t_end - t_first) * 1e3 / (n_out - 1) if n_out > 1 else 0.0
        proposed, accepted = spec
        yield Finished(
            accepted_draft_tokens=accepted,
            proposed_draft_tokens=proposed,
            reason=reason or "stop",
            prompt_tokens=len(ids),
            completion_tokens=n_out,
            timings=timings,
            stop_string=detok.stopped_by,
            kv_transport=transport,
            request_id=request_id,
        )
