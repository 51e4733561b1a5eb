"""One request through the stages: prefill -> KV handover -> decode, detokenized as it streams.

Where the prompt is prefilled (conditional disaggregation): the decode worker is chosen first
(a Chat session's own, else nearly least loaded with the longest cached prefix); when the part
of the prompt it probably lacks is shorter than `disagg_threshold` tokens, it prefills the prompt
itself (`Admit.prefill_here`, no KV transfer). Otherwise a prefill worker computes it and the
decode worker imports the KV, copying only the blocks it does not hold already.

The KV moves by push where both workers support it: the decode worker reserves the prompt's
blocks (Decode.Reserve: those its prefix cache lacks), the prefill worker writes into them
(Prefill.Run with `push_to`) and the Admit names the reservation. Otherwise, or when the
reservation is refused, the decode worker pulls the KV by its lease. A request that ends between
Reserve and Admit gives the reservation back (at its expiry when a write may still be running).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import grpc

from services.gateway.admission import SloUnreachable, Ticket, TtftAdmission
from services.gateway.router import (
    DecodeClient,
    Overloaded,
    PrefillClient,
    Router,
    StageUnavailable,
)
from tandem.api.detokenizer import IncrementalDetokenizer
from tandem.api.logprobs import TokenLogprobs
from tandem.api.sampling_params import SamplingParams
from tandem.config import GatewayConfig
from tandem.model.tokenizer import Tokenizer
from tandem.rpc import stages_pb2
from tandem.rpc.convert import logprob_from_proto, prompt_logprobs_from_proto, sampling_to_proto
from tandem.rpc.lease import release_until_acknowledged

if TYPE_CHECKING:
    from services.gateway.observe import RequestTrace

log = logging.getLogger("tandem.gateway")


@dataclass
class TextDelta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # The first delta, when the request asked for prompt logprobs: one entry per prompt token,
    # the first None (nothing comes before it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


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
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from a prefix cache
    prefill_worker: str = "prefill"  # prefill | decode (where the prompt was prefilled)


@dataclass
class Session:
    """What a Chat stream's turns share: the decode worker holding the conversation's KV."""

    decode: str | None = None


class KeyedSessions:
    """Sessions named by a client's key (OpenAI's `prompt_cache_key`), per tenant: requests
    sharing a key go to the decode worker of the last one, whose prefix cache probably holds
    their common prefix. The least recently used key is forgotten past `capacity`; keys are
    kept as digests, so a long one costs no more memory than a short one."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._sessions: OrderedDict[bytes, Session] = OrderedDict()

    def get(self, tenant: str, key: str) -> Session:
        name = hashlib.sha256(f"{tenant}\0{key}".encode()).digest()
        session = self._sessions.pop(name, None) or Session()
        self._sessions[name] = session
        if len(self._sessions) > self.capacity:
            self._sessions.popitem(last=False)
        return session


@dataclass
class Route:
    """Where a request goes: its decode worker, and its prefill worker (None: prefill there)."""

    names: list[bytes]  # prefix-cache names of the prompt's full blocks
    decode: DecodeClient
    prefill: PrefillClient | None
    uncached: int  # prompt tokens the prefilling worker probably lacks


def _continued(params: SamplingParams, out_ids: list[int]) -> SamplingParams:
    """The parameters of a sequence continuing elsewhere after `out_ids`: fewer tokens left,
    its grammar (if any) replays the tokens already generated, and its prompt logprobs (sent
    with the first token) are not computed again once that token was streamed."""
    structured = params.structured
    if structured is not None:
        structured = replace(structured, accepted=[*structured.accepted, *out_ids])
    return replace(
        params,
        max_tokens=params.max_tokens - len(out_ids),
        min_tokens=max(0, params.min_tokens - len(out_ids)),
        structured=structured,
        prompt_logprobs=None if out_ids else params.prompt_logprobs,
    )


class Pipeline:
    """Runs requests across the router's workers."""

    def __init__(
        self,
        router: Router,
        tokenizer: Tokenizer,
        eos_token_ids: set[int],
        max_model_len: int,
        max_waiting: int = 1024,
        max_inflight: int = 1024,
        disagg_threshold: int = GatewayConfig.disagg_threshold,
        admission: TtftAdmission | None = None,
        resume_budget_s: float = 0.0,
    ) -> None:
        self.router = router
        self.resume_budget_s = resume_budget_s
        self.resumed = 0  # streams continued on another decode worker after theirs died
        self.tokenizer = tokenizer
        self.eos = eos_token_ids
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.max_inflight = max_inflight
        self.disagg_threshold = disagg_threshold
        self.admission = admission or TtftAdmission()
        self.waiting = 0  # admitted, no first token yet
        self.inflight = 0  # admitted, not finished
        self.prefills = {"prefill": 0, "decode": 0}  # requests by where they were prefilled
        self._background: set[asyncio.Task] = set()
        self._no_push: set[str] = set()  # decode workers without Decode.Reserve (older ones)

    def admit(
        self, ids: list[int] | None = None, session: Session | None = None, scored: bool = False
    ) -> Route | None:
        """Refuse at once (rather than queue without bound) when a limit is reached, or (with
        `ids`, when shedding load) when the prompt's time-to-first-token target is out of reach.
        Returns the route the prompt would take now (`scored`: see `route`)."""
        if self.inflight >= self.max_inflight:
            raise Overloaded(
                f"gateway is at its limit of {self.max_inflight} requests in progress; retry later"
            )
        if self.waiting >= self.max_waiting:
            raise Overloaded(
                f"gateway is at its limit of {self.max_waiting} requests waiting for a first "
                "token; retry later"
            )
        if ids is None:
            return None
        route = self.route(ids, session, scored)
        if route.decode.full:
            raise Overloaded(
                f"the decode worker is full ({route.decode.load} sequences running or queued); "
                "retry later"
            )
        worker = route.prefill or route.decode
        try:
            self.admission.check(worker.address, route.uncached)
        except SloUnreachable as e:
            raise Overloaded(str(e)) from e
        return route

    async def check_fits(self, ids: list[int], params: SamplingParams) -> None:
        """Refuse (ValueError naming max_tokens) a request that no decode worker's KV pool can
        hold even alone: it would run out of blocks with nothing left to wait for."""
        caps = [await c.capacity() for c in self.router.decode if c.healthy]
        caps = [c for c in caps if c]
        if not caps:
            return  # no worker answers: the request fails at routing, or is checked there
        fits = max(caps)
        if len(ids) + params.max_tokens > fits:
            raise ValueError(
                f"max_tokens ({params.max_tokens}) plus the prompt ({len(ids)} tokens) is more "
                f"than one sequence can hold in the decode worker's KV cache ({fits} tokens); "
                f"lower max_tokens to at most {max(0, fits - len(ids))}"
            )

    async def check_choices(self, n: int, prompts: int = 1) -> None:
        """Refuse (ValueError naming n, or the prompts) a request for more choices than can
        ever run at once: its choices (n per prompt) run side by side, so past a decode
        worker's sequence limit (running plus queued) or the gateway's own limits some would
        always be refused."""
        await asyncio.gather(*(c.capacity() for c in self.router.decode if c.healthy))
        takes = [c.max_sequences for c in self.router.decode if c.healthy and c.max_sequences]
        limits = [
            (self.max_inflight, "the gateway's max_inflight"),
            # The first choice runs alone to its first token, then the others wait together.
            (self.max_waiting + 1, "the gateway's max_waiting plus one"),
        ]
        if takes:
            limits.append((max(takes), "a decode worker's max_num_seqs plus max_queued_seqs"))
        limit, what = min(limits)
        asked = f"n ({n})" if prompts == 1 else f"{prompts} prompts times n ({prompts * n})"
        if prompts * n > limit:
            raise ValueError(
                f"{asked} is more choices than can run at once: {limit} ({what}); ask for at "
                f"most {limit}"
            )

    def route(self, ids: list[int], session: Session | None = None, scored: bool = False) -> Route:
        """Choose the workers of a prompt (raises `StageUnavailable` when a stage is down).
        `scored`: the prompt's logprobs are asked for, so it is computed whole wherever it goes
        (a cached prefix is not reused: tandem/engine/prompt_logprobs.py)."""
        router = self.router
        names = router.index.names(ids)
        decode = router.pick_decode(names, session.decode if session else None)
        held = router.cached_tokens(decode, names)
        router.count_route("decode", len(ids), held)
        # The worker computes at least the last token, however much it holds.
        uncached = max(1, len(ids) - held)
        if scored:
            uncached = len(ids)
        if uncached < self.disagg_threshold or not router.prefill_serving:
            # Short, or no prefill worker serves: the decode worker prefills it itself.
            return Route(names, decode, None, uncached)
        prefill = router.pick_prefill(names)
        held = router.cached_tokens(prefill, names)
        router.count_route("prefill", len(ids), held)
        uncached = max(1, len(ids) - held)
        return Route(names, decode, prefill, len(ids) if scored else uncached)

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
        session: Session | None = None,
        tenant: str = "",
    ) -> AsyncIterator[TextDelta | Finished]:
        """Stream text deltas, then one `Finished`. Closing the iterator early cancels the request.
        `tenant`: whose KV quota on the workers the request counts against ("": `default`).

        Raises `Overloaded` before doing anything when a gateway limit is reached or the request
        cannot meet its time-to-first-token target (with load shedding).
        """
        await self.check_fits(ids, params)
        # No await between the limits' check and the count: concurrent requests see each other.
        route = self.admit(ids, session, scored=params.prompt_logprobs is not None)
        self.inflight += 1
        self.waiting += 1
        state = {"waiting": True}
        try:
            async with aclosing(
                self._run(ids, params, request_id, state, route, trace, session, tenant)
            ) as events:
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
        route: Route,
        trace: RequestTrace | None = None,
        session: Session | None = None,
        tenant: str = "",
    ) -> AsyncIterator[TextDelta | Finished]:
        t0 = time.monotonic()
        seq_id = uuid.uuid4().hex
        detok = IncrementalDetokenizer(
            self.tokenizer, ids, params.stop, min_tokens=params.min_tokens
        )
        if trace is not None:  # spans of this request: parent context, timed detokenizer
            detok = trace.detokenizer(detok)
        draft = self.router.pick_draft()
        if draft is not None:
            # The draft prefills its own state while the target prefills; failures only cost
            # speculation (the decode worker resends the whole sequence when the draft lacks it).
            draft.admit(seq_id, ids, trace.metadata() if trace is not None else None)
        prefill = route.prefill
        ticket = self.admission.sent((prefill or route.decode).address, route.uncached)
        # The lease token comes with the prefill's answer; until a decode worker takes the lease
        # over, this request owns it and gives it back on every way out (cancel, stop, error).
        # Without an answer there is no token: the prefill worker gives back what nobody took.
        # `reserved`: the token of decode blocks reserved for a push, until the Admit naming them
        # is sent (then the decode worker owns them); `in_flight`: a prefill worker may still be
        # writing into them.
        lease = {"owned": prefill is not None, "id": "", "reserved": "", "in_flight": False}
        try:
            async with aclosing(
                self._stream(
                    ids,
                    params,
                    request_id,
                    state,
                    trace,
                    t0,
                    seq_id,
                    detok,
                    route,
                    lease,
                    ticket,
                    tenant,
                )
            ) as events:
                async for ev in events:
                    yield ev
        finally:
            self.admission.done(ticket)
            if lease["owned"] and lease["id"]:
                # The prefill worker that answered (another than the first, had that one failed).
                self._release_lease(route.prefill, lease["id"])
            if lease["reserved"]:
                self._unreserve(route.decode, lease)
            if session is not None:
                session.decode = route.decode.address

    async def _decode_for_resume(self, route: Route):
        """A live decode worker for a stream whose worker died, waited for up to the resume
        budget (a restarted worker comes back healthy); None when none came in time."""
        deadline = time.monotonic() + self.resume_budget_s
        while True:
            try:
                return self.router.pick_decode(route.names)
            except StageUnavailable:
                if time.monotonic() >= deadline:
                    return None
            await asyncio.sleep(0.2)

    def _abandon(self, prefill: PrefillClient, answer: asyncio.Future) -> None:
        """Cancel a prefill call nobody waits for, giving back the lease of an answer that came
        all the same."""
        answer.cancel()  # cancels the call, unless its answer came already
        answer.add_done_callback(lambda t: self._release_answered(prefill, t))

    def _release_answered(self, prefill, answer: asyncio.Future) -> None:
        """Give back the lease of a prefill answer that came for a request already cancelled."""
        if not answer.cancelled() and answer.exception() is None and answer.result().kv.lease_id:
            self._release_lease(prefill, answer.result().kv.lease_id)

    def _release_lease(self, prefill, lease_id: str) -> None:
        async def release() -> None:
            await release_until_acknowledged(
                prefill.stub, stages_pb2.ReleaseRequest(lease_ids=[lease_id]), "prefill worker"
            )

        # A task, not an await: this runs while a cancelled generator is being closed.
        task = asyncio.ensure_future(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _unreserve(self, decode: DecodeClient, lease: dict) -> None:
        """Give back the decode blocks reserved for a push that will not be admitted."""
        req = stages_pb2.UnreserveRequest(
            token=lease["reserved"], write_may_be_in_flight=lease["in_flight"]
        )
        lease["reserved"] = ""

        async def unreserve() -> None:
            try:
                await decode.stub.Unreserve(req, timeout=10)
            except grpc.aio.AioRpcError as e:  # it expires there all the same
                log.info("decode worker %s: Unreserve failed: %s", decode.address, e.code().name)

        # A task, not an await: this runs while a cancelled generator is being closed.
        task = asyncio.ensure_future(unreserve())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reserve(
        self, route: Route, ids: list[int], seq_id: str, tenant: str, lease: dict
    ) -> stages_pb2.KvReservation | None:
        """Decode blocks reserved for the prompt's KV, for the prefill worker to push into; None
        when there is no push for it (the decode worker then pulls the KV)."""
        decode, prefill = route.decode, route.prefill
        if prefill is None or not decode.healthy or decode.address in self._no_push:
            return None  # (an unhealthy decode worker is replaced after the prefill)
        req = stages_pb2.ReserveRequest(
            seq_id=seq_id, prompt_token_ids=ids, tenant=tenant, prefill_address=prefill.address
        )
        try:
            resp = await decode.stub.Reserve(req, timeout=5)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._no_push.add(decode.address)  # an older worker: it pulls
            else:
                log.info("decode worker %s: Reserve failed: %s", decode.address, e.details())
            return None
        if not resp.HasField("reservation"):
            log.debug("no push for %s: %s", seq_id, resp.refused)
            return None
        lease["reserved"] = resp.reservation.token
        return resp.reservation

    async def _prefill_anywhere(
        self,
        route: Route,
        ids,
        params,
        seq_id,
        trace,
        state,
        ticket: Ticket,
        tenant="",
        lease: dict | None = None,
        push_to: stages_pb2.KvReservation | None = None,
    ) -> stages_pb2.PrefillResponse | None:
        """The prompt prefilled by `route.prefill`, or by another prefill worker should that one
        fail or stop responding; None (and `route.prefill` None) when none serves: the decode
        worker then prefills it itself. `push_to`: decode blocks reserved for the first worker
        to write the KV into (`lease["in_flight"]` set while it may be writing)."""
        while route.prefill is not None:
            try:
                if push_to is not None and lease is not None:
                    lease["in_flight"] = True
                resp = await self._prefill(
                    route.prefill, ids, params, seq_id, trace, state, tenant, push_to
                )
                if lease is not None:
                    lease["in_flight"] = False  # answered: written, or refused and leased
                return resp
            except StageUnavailable as e:
                push_to = None  # the reservation names the worker that failed
                failed = route.prefill
                route.prefill = (
                    self.router.pick_prefill(route.names) if self.router.prefill_serving else None
                )
                where = route.prefill or route.decode
                log.warning(
                    "prefill worker %s failed a request (%s); it is prefilled on %s %s instead",
                    failed.address,
                    e,
                    where.stage,
                    where.address,
                )
                self.admission.moved(ticket, where.address, route.uncached)
        return None

    async def _prefill(
        self, prefill: PrefillClient, ids, params, seq_id, trace, state, tenant="", push_to=None
    ):
        prefill.inflight += 1
        call = prefill.stub.Run(
            stages_pb2.PrefillRequest(
                request_id=seq_id,
                prompt_token_ids=ids,
                sampling=sampling_to_proto(params),
                tenant=tenant,
                push_to=push_to,
            ),
            metadata=trace.metadata() if trace is not None else None,
        )
        # The answer is awaited through a task of its own: a request cancelled in the instant
        # its answer arrives would otherwise drop the answer, and with it the lease token that
        # gives the prompt's KV back (held until its time to live ran out).
        answer = asyncio.ensure_future(call)
        lost = prefill.lost()  # a worker that stops responding ends the wait
        try:
            # Neither is cancelled when this is (a shield for the answer, as for `lost`).
            await asyncio.wait((answer, lost), return_when=asyncio.FIRST_COMPLETED)
            if not answer.done():
                self._abandon(prefill, answer)
                raise StageUnavailable(f"prefill worker stopped responding ({lost.result()})")
            prefill.heard += 1
            return answer.result()
        except asyncio.CancelledError:
            self._abandon(prefill, answer)
            raise
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from e
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise Overloaded(f"prefill worker cannot take it now: {e.details()}") from e
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                prefill.mark_down(e.details() or "unavailable")
            # Clients learn what failed, not where: the worker's address and gRPC's own details
            # (connection errors name addresses) go to the log.
            log.warning(
                "prefill worker %s failed: %s: %s", prefill.address, e.code().name, e.details()
            )
            raise StageUnavailable(f"prefill worker failed ({e.code().name}); retry later") from e
        finally:
            prefill.inflight -= 1
            self._first_token_seen(state)

    async def _stream(
        self,
        ids: list[int],
        params: SamplingParams,
        request_id: str,
        state: dict,
        trace: RequestTrace | None,
        t0: float,
        seq_id: str,
        detok,
        route: Route,
        lease: dict,
        ticket: Ticket,
        tenant: str = "",
    ) -> AsyncIterator[TextDelta | Finished]:
        prefill = route.prefill
        timings = {"queue_ms": 0.0, "prefill_ms": 0.0, "ttft_ms": 0.0, "kv_transfer_ms": 0.0}
        out_ids: list[int] = []
        reason = None
        cached = 0
        t_first = None
        carrier = trace.carrier() if trace is not None else {}
        resp = None
        pushed = None  # the reservation the prefill worker wrote the KV into
        if prefill is not None:
            push_to = await self._reserve(route, ids, seq_id, tenant, lease)
            resp = await self._prefill_anywhere(
                route, ids, params, seq_id, trace, state, ticket, tenant, lease, push_to
            )
            prefill = route.prefill
            if resp is not None and resp.push_proof and lease["reserved"]:
                pushed = push_to
            elif lease["reserved"]:
                if resp is not None and resp.push_refused:
                    log.info("prefill worker did not push %s: %s", seq_id, resp.push_refused)
                self._unreserve(route.decode, lease)  # pulled (or recomputed) instead
        self.prefills["decode" if prefill is None else "prefill"] += 1
        if resp is not None:
            t_first = time.monotonic()
            self.admission.first_token(ticket)
            self.router.index.record(prefill.address, route.names)
            lease["id"] = resp.kv.lease_id
            first = resp.first_token
            out_ids.append(first)
            cached = resp.cached_tokens
            reason = self._stop_reason(params, first, 1, len(ids) + 1)
            text = detok.add([first])
            if detok.stopped_by is not None:
                reason = "stop"
            lps = [logprob_from_proto(resp.first_logprob)] if resp.has_logprob else []
            prompt_lps = None
            if params.prompt_logprobs is not None:
                prompt_lps = prompt_logprobs_from_proto(resp.prompt_logprobs)
            yield TextDelta(text, [first], lps, prompt_lps)
            timings.update(
                queue_ms=resp.queue_ms, prefill_ms=resp.prefill_ms, ttft_ms=(t_first - t0) * 1e3
            )
            admit = stages_pb2.Admit(
                seq_id=seq_id,
                prompt_token_ids=ids,
                first_token=first,
                # The prompt was scored by the prefill worker: the decode worker only continues.
                sampling=sampling_to_proto(replace(params, prompt_logprobs=None)),
                prefill_address=prefill.address,
                rng_state=resp.rng_state,
                trace_context=carrier,
                tenant=tenant,
            )
            if pushed is not None:
                admit.reservation.CopyFrom(pushed)
                admit.push_proof = resp.push_proof
            else:
                admit.kv.CopyFrom(resp.kv)
        else:
            admit = stages_pb2.Admit(
                seq_id=seq_id,
                prompt_token_ids=ids,
                sampling=sampling_to_proto(params),
                trace_context=carrier,
                prefill_here=True,
                tenant=tenant,
            )
        transport = "none"
        spec = (0, 0)  # draft tokens proposed and accepted for this sequence
        decode = route.decode
        if reason is None:
            if not decode.healthy and prefill is not None and pushed is None:
                # (Pushed KV is in that worker's pool: the Admit goes there or fails.)
                decode = route.decode = self.router.pick_decode(route.names)
            done = False
            # Prefilled on the decode worker: its first tokens message carries them.
            awaiting_prompt_lps = prefill is None and params.prompt_logprobs is not None
            traced = trace is not None and trace.span is not None  # time deliveries then
            try:
                q = await decode.open(seq_id, admit)
                lease["owned"] = False  # the decode worker releases it after its copy
                lease["reserved"] = ""  # and the reservation is its own
                held: list[tuple] = []  # an event taken from `q` behind token messages
                while not done:
                    kind, msg, step_ended_at = held.pop() if held else await q.get()
                    if kind == "tokens":
                        # Token messages that queued up while this loop was busy go out as one
                        # delta: one detokenization and one write for all of them.
                        msgs = [msg]
                        while not q.empty():
                            nxt = q.get_nowait()
                            if nxt[0] != "tokens":
                                held.append(nxt)
                                break
                            msgs.append(nxt[1])
                            if traced and nxt[2]:
                                trace.delivered(nxt[2])
                        if traced and step_ended_at:
                            trace.delivered(step_ended_at)
                        msg = msgs[-1]  # the draft totals are running totals: the last holds
                        toks = [t for m in msgs for t in m.token_ids]
                        if t_first is None and toks:  # prefilled here: the first token
                            t_first = time.monotonic()
                            timings["ttft_ms"] = (t_first - t0) * 1e3
                            self._first_token_seen(state)
                            self.admission.first_token(ticket)
                        # Several ids in one message (an accepted draft run) may run past a
                        # stop string: only those up to the one completing it are output.
                        text, n = detok.add_until_stop(toks)
                        toks = toks[:n]
                        out_ids.extend(toks)
                        lps = [logprob_from_proto(x) for m in msgs for x in m.logprobs][:n]
                        prompt_lps = None
                        if awaiting_prompt_lps and toks:
                            # Prefilled there: the prompt's logprobs come with the first token.
                            prompt_lps = prompt_logprobs_from_proto(msgs[0].prompt_logprobs)
                            awaiting_prompt_lps = False
                        if msg.proposed_draft_tokens:  # running totals; SeqFinished has the last
                            spec = (msg.proposed_draft_tokens, msg.accepted_draft_tokens)
                        if detok.stopped_by is not None:
                            reason, done = "stop", True
                        if text or toks or prompt_lps is not None:
                            yield TextDelta(text, toks, lps, prompt_lps)
                    elif kind == "finished":
                        done = True
                        if msg.finish_reason == "error":
                            if msg.error_code == "RESOURCE_EXHAUSTED":
                                raise Overloaded(f"decode worker is full: {msg.error}")
                            if msg.error_code == "INVALID_ARGUMENT":
                                # The request's own fault (a grammar past its compile budget):
                                # a 400 with the worker's message, as from a prefill worker.
                                raise ValueError(msg.error.removeprefix("decode admit: "))
                            log.warning("decode worker %s failed: %s", decode.address, msg.error)
                            raise StageUnavailable(f"decode worker failed: {msg.error}")
                        reason = reason or msg.finish_reason
                        # Pushed: the prefill worker's write, then the decode worker's admission.
                        push_ms = resp.push_ms if pushed is not None else 0.0
                        timings["kv_transfer_ms"] = push_ms + msg.kv_transfer_ms
                        transport = msg.kv_transport or transport
                        spec = (msg.proposed_draft_tokens, msg.accepted_draft_tokens)
                        if prefill is None:
                            cached = msg.cached_prompt_tokens
                            timings["queue_ms"] = msg.queue_ms
                            timings["prefill_ms"] = msg.prefill_ms
                    else:  # the stream to the decode worker broke, or the worker stopped
                        decode.cancel(seq_id)  # one that only stalled drops it when it resumes
                        decode.close_seq(seq_id)
                        left = params.max_tokens - len(out_ids)
                        new = await self._decode_for_resume(route) if left > 0 else None
                        if new is None:
                            done = True
                            raise StageUnavailable(
                                f"{msg}; no decode worker served again within "
                                f"{self.resume_budget_s:g}s (resume_budget_s)"
                            )
                        # Continue where it stopped: the prompt and the tokens streamed so far
                        # are prefilled on the new worker, which generates the rest. Under a new
                        # id: the old one may still be cancelling on a worker that came back.
                        decode = route.decode = new
                        seq_id = uuid.uuid4().hex
                        resumed = sampling_to_proto(_continued(params, out_ids))
                        admit = stages_pb2.Admit(
                            seq_id=seq_id,
                            prompt_token_ids=ids + out_ids,
                            sampling=resumed,
                            trace_context=carrier,
                            prefill_here=True,
                            tenant=tenant,
                        )
                        self.resumed += 1
                        log.warning(
                            "resuming a stream on decode worker %s after %d tokens",
                            decode.address,
                            len(out_ids),
                        )
                        q = await decode.open(seq_id, admit)
            finally:
                if not done or reason == "stop" and detok.stopped_by is not None:
                    decode.cancel(seq_id)
                decode.close_seq(seq_id)
                # It holds the prompt and the output but the last token (whose KV is never
                # computed), named block by block as they filled.
                self.router.index.record(
                    decode.address, self.router.index.names(ids + out_ids[:-1])
                )
        tail = detok.finish()
        if tail:
            yield TextDelta(tail, [])
        t_end = time.monotonic()
        n_out = len(out_ids)
        t_first = t_first if t_first is not None else t_end
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
            cached_prompt_tokens=cached,
            prefill_worker="decode" if prefill is None else "prefill",
        )
