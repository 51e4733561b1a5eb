"""Clients of the prefill and decode workers, and the choice between them.

A worker is chosen among the healthy ones that are nearly the least loaded (within
`LOAD_SLACK` requests of it) by a score: the prompt tokens it holds in its prefix cache (a block
on its host tier worth `HOST_WEIGHT` of one on its device) minus `LOAD_PENALTY_TOKENS` per
request it has beyond the least loaded. What a worker holds comes from the KV events it
publishes (`KvEvents`, kept in its `WorkerKv`); for a worker that publishes none, from the
gateway's own guess (`PrefixIndex`: what it routed there). A Chat session's later turns, and
requests sharing a `prompt_cache_key`, go to the decode worker of their earlier ones while it is
healthy: it holds the whole conversation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.decode_stream import DecodeStream
from services.gateway.kv_index import WorkerKv
from services.gateway.prefix_index import PrefixIndex
from tandem import progress
from tandem.rpc import stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import StageCredentials, stage_channel, unreachable_hint
from tandem.rpc.health import probe

log = logging.getLogger("tandem.gateway")


# Seconds a refused client is asked to wait before it tries again: `Retry-After` on every HTTP
# 429 and 503, `retry-after` (and gRPC's own `grpc-retry-pushback-ms`) on every
# RESOURCE_EXHAUSTED and UNAVAILABLE. Workers come back, and queues drain, within about that.
RETRY_AFTER_S = 1


class StageUnavailable(RuntimeError):
    """A worker could not be reached or failed the request; the message names the stage."""


class Overloaded(RuntimeError):
    """The gateway is at a configured limit; the request is refused at once."""


PROBE_INTERVAL_S = 0.5
# Seconds a worker may take to answer a health check before it is taken for stopped (a frozen
# process, a blocked event loop): GatewayConfig.stage_health_timeout_s.
HEALTH_TIMEOUT_S = 2.0
# Prefix affinity never sends a request to a worker busier than the least loaded by more than
# this many requests: a cache hit is not worth an unbounded queue.
LOAD_SLACK = 2
# Within that bound, each request a worker has beyond the least loaded costs it this many cached
# prompt tokens in the choice: a one-block hit does not outweigh a queue.
LOAD_PENALTY_TOKENS = 32
# Seconds between attempts to follow a worker's KV events after its stream failed.
KV_EVENTS_RETRY_S = 1.0
# Each worker channel owns its subchannels (a replaced channel must not inherit the old one's
# reconnect backoff), and reconnects quickly once a restarted worker listens again.
CHANNEL_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 << 20),
]


class Worker:
    """Health bookkeeping shared by both kinds of worker client.

    A worker is routed to once its health check answers SERVING, and then checked every
    `PROBE_INTERVAL_S` over its own channel: one that does not answer within
    `health_timeout_s` (a frozen process, an event loop that stopped) is marked down like one
    whose connection broke, so that no request waits on it, and routed to again once it answers.
    A check that goes unanswered while the worker's answers to requests keep coming (`heard`)
    marks nothing down: that worker is busy, not frozen.
    """

    stage = "worker"
    stub_class: Any = None  # the stage's gRPC stub, opened on the worker's channel

    def __init__(
        self,
        address: str,
        credentials: StageCredentials | None = None,
        health_timeout_s: float = HEALTH_TIMEOUT_S,
    ) -> None:
        self.address = address
        # The stage secret sent on every call, and the CA bundle that makes the calls TLS.
        self.credentials = credentials or StageCredentials()
        self.health_timeout_s = health_timeout_s
        # Not routed to until its health check answers SERVING (`watch`): a worker that is still
        # loading cannot serve, and the gateway's readiness says so.
        self.healthy = False
        self.seen_up = False  # it answered SERVING once: a later failure is worth a warning
        # Marked down because its connection failed (it may have restarted: a fresh channel when
        # it is back), not only because it stopped answering (its calls may still complete).
        self._broken = False
        self._probe: asyncio.Task | None = None
        self._lost: asyncio.Future[str] | None = None  # see `lost`
        self.channel: grpc.aio.Channel | None = None  # opened by the subclass (`_open`)
        self.index: PrefixIndex | None = None  # set by the router
        # What its prefix cache holds, from the KV events it publishes (`follow_kv`); None once
        # it turned out to publish none (the router guesses with `index` instead).
        self.kv: WorkerKv | None = WorkerKv()
        self._kv_task: asyncio.Task | None = None
        # Answers that came from this worker (token messages, prefill answers): a worker whose
        # answers keep coming is alive, whatever a slow health check says.
        self.heard = 0
        self._open()

    def watch(self) -> None:
        """Probe `grpc.health.v1` until the worker answers SERVING, route to it, and keep
        checking that it answers in time."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._watch())

    def mark_down(self, reason: str, broken: bool = True) -> None:
        """Stop routing here until `grpc.health.v1` answers SERVING again. `broken`: its
        connection failed (rather than a health check that went unanswered)."""
        if self.healthy:
            log.warning("%s worker %s is down: %s", self.stage, self.address, reason)
        self.healthy = False
        self._broken = self._broken or broken
        if broken and self.index is not None:
            self.index.forget(self.address)  # it comes back with an empty cache
        if broken:
            # It may come back another build, one that publishes KV events: follow them anew.
            self.kv = WorkerKv()
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(reason)
        self.watch()

    def lost(self) -> asyncio.Future[str]:
        """A future that resolves (with the reason) when this worker is next marked down, at
        once when it is down now: a call to it is waited for together with this one."""
        if self._lost is None or self._lost.done():
            self._lost = asyncio.get_running_loop().create_future()
            if not self.healthy:
                self._lost.set_result(f"{self.stage} worker is down")
        return self._lost

    async def _watch(self) -> None:
        while True:
            if not self.healthy:
                await self._probe_until_up()
            await asyncio.sleep(PROBE_INTERVAL_S)
            heard = self.heard
            why = await self._check()
            if why is None or not self.healthy:
                continue
            broken = why.startswith(grpc.StatusCode.UNAVAILABLE.name)
            if not broken and self.heard != heard:
                # Unanswered in time, yet it answered requests meanwhile: a loaded worker (or a
                # loaded gateway), not a frozen one. Its streams go on where they are.
                continue
            self.mark_down(why, broken=broken)

    async def _check(self) -> str | None:
        """Why the worker failed its health check over its own channel (None: it answered
        SERVING within `health_timeout_s`)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            r = await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.health_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return (
                    f"it did not answer its health check within {self.health_timeout_s:g}s "
                    "(stage_health_timeout_s)"
                )
            return f"{e.code().name}: {e.details()}"
        if r.status == health_pb2.HealthCheckResponse.SERVING:
            return None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    async def _probe_until_up(self) -> None:
        tls = self.credentials.tls_root is not None
        told = None  # a TLS mismatch is said once, not at every probe
        timeout = self.health_timeout_s
        while (
            why := await probe(
                self.address, timeout, self.credentials.tls_root, self.credentials.presented
            )
        ) is not None:
            hint = unreachable_hint(why, tls)
            if hint is not None and hint != told:
                log.warning("%s worker %s is unreachable: %s", self.stage, self.address, hint)
                told = hint
            await asyncio.sleep(PROBE_INTERVAL_S)
        if self.seen_up:
            log.info("%s worker %s is back", self.stage, self.address)
            if self._broken:
                # The old channel may sit in reconnect backoff and fail fast for a while: start
                # afresh. (One that only stopped answering keeps its channel and its streams.)
                await self.reconnect()
        else:
            progress.report(f"{self.stage} worker {self.address} is serving")
        self._broken = False
        self.seen_up = True
        self.healthy = True
        self.follow_kv()

    def follow_kv(self) -> None:
        """Follow this worker's KV events (unless it publishes none, or already followed)."""
        if self.kv is not None and (self._kv_task is None or self._kv_task.done()):
            self._kv_task = asyncio.ensure_future(self._follow_kv())

    async def _follow_kv(self) -> None:
        kv = self.kv
        while kv is not None and self.healthy:
            try:
                async for batch in self.stub.KvEvents(stages_pb2.KvEventsRequest()):
                    kv.apply(batch)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("%s worker %s publishes no KV events", self.stage, self.address)
                    self.kv = None
                    return
                log.debug("KV events of %s worker %s: %s", self.stage, self.address, e.details())
            except ValueError as e:
                log.warning("KV events of %s worker %s: %s", self.stage, self.address, e)
            kv.lost()
            await asyncio.sleep(KV_EVENTS_RETRY_S)

    def _open(self) -> None:
        """A channel to this worker and the stage's stub on it."""
        self.channel = stage_channel(self.address, self.credentials, CHANNEL_OPTIONS)
        self.stub = self.stub_class(self.channel)

    async def reconnect(self) -> None:
        """Replace the channel to this worker."""
        old = self.channel
        self._open()
        if old is not None:
            await old.close()

    def stop_probe(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        if self._kv_task is not None:
            self._kv_task.cancel()


class PrefillClient(Worker):
    stage = "prefill"
    stub_class = stages_pb2_grpc.PrefillStub
    inflight = 0  # requests sent to it and not yet answered

    async def close(self) -> None:
        await self.channel.close()


class DecodeClient(Worker):
    """One long-lived bidirectional Session stream to a decode worker, shared by all requests
    (read on a thread of its own: services/gateway/decode_stream.py)."""

    stage = "decode"
    stub_class = stages_pb2_grpc.DecodeStub

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.queues: dict[str, asyncio.Queue] = {}
        self._stream: DecodeStream | None = None
        # The most tokens (prompt + output) one sequence fits in this worker's KV pool; learned
        # from its Stats on first use and again after it comes back (it may have restarted).
        self.max_seq_tokens: int | None = None
        self.max_sequences: int | None = None  # running + queued it takes (also from Stats)

    async def reconnect(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self.max_seq_tokens = None
        await super().reconnect()

    async def capacity(self) -> int | None:
        """`max_seq_tokens` of this worker (asked once); None when it does not answer."""
        if self.max_seq_tokens is None and self.healthy:
            try:
                st = await self.stub.Stats(stages_pb2.StatsRequest(), timeout=5)
            except grpc.aio.AioRpcError:
                return None
            self.max_seq_tokens = st.max_seq_tokens or None
            self.max_sequences = st.max_sequences or None
        return self.max_seq_tokens

    @property
    def full(self) -> bool:
        """This gateway alone has as many sequences there as the worker takes."""
        return self.max_sequences is not None and self.load >= self.max_sequences

    @property
    def load(self) -> int:
        return len(self.queues)

    def _ensure_stream(self) -> DecodeStream:
        if self._stream is None or self._stream.ended:
            self._stream = DecodeStream(
                self.address, self.credentials, CHANNEL_OPTIONS, self._dispatch, self._ended
            )
        return self._stream

    def _dispatch(self, out: stages_pb2.DecodeOut) -> None:
        """A step's message: each sequence's tokens and finish to its request's queue."""
        self.heard += 1
        at = out.step_ended_at
        queues = self.queues
        for t in out.tokens:
            q = queues.get(t.seq_id)
            if q is not None:
                q.put_nowait(("tokens", t, at))
        for f in out.finished:
            q = queues.get(f.seq_id)
            if q is not None:
                q.put_nowait(("finished", f, 0.0))

    def _ended(self, stream: DecodeStream, reason: str, public: str) -> None:
        if self._stream is stream:
            self._stream = None
        self.mark_down(reason)
        self._fail_sequences(public)

    def mark_down(self, reason: str, broken: bool = True) -> None:
        super().mark_down(reason, broken)
        if not broken:
            # Its stream is open but nothing comes: its sequences continue elsewhere (the
            # pipeline resumes them), and are cancelled here should it come back.
            self._fail_sequences("decode worker stopped responding")

    def _fail_sequences(self, message: str) -> None:
        """Tell every sequence on this worker that it will get nothing more from it."""
        for q in self.queues.values():
            q.put_nowait(("error", message, 0.0))

    async def open(self, seq_id: str, admit: stages_pb2.Admit) -> asyncio.Queue:
        """Admit a sequence; its token batches and finish event arrive on the returned queue as
        (kind, message, when its step ended in Unix seconds: 0 but for tokens)."""
        stream = self._ensure_stream()
        q: asyncio.Queue = asyncio.Queue()
        self.queues[seq_id] = q
        stream.send(stages_pb2.DecodeIn(admit=admit))
        return q

    def cancel(self, seq_id: str) -> None:
        if self._stream is not None:
            self._stream.send(stages_pb2.DecodeIn(cancel=stages_pb2.CancelSeq(seq_id=seq_id)))

    def close_seq(self, seq_id: str) -> None:
        self.queues.pop(seq_id, None)

    async def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        await self.channel.close()


class DraftAdmitter:
    """Admits sequences to a draft worker, fire-and-forget (speculation is optional)."""

    def __init__(self, address: str, credentials: StageCredentials | None = None) -> None:
        self.address = address
        self.channel = stage_channel(address, credentials, CHANNEL_OPTIONS)
        self.stub = stages_pb2_grpc.DraftStub(self.channel)
        self.failures = 0

    def admit(self, seq_id: str, ids: list[int], metadata=None) -> None:
        async def call() -> None:
            try:
                await self.stub.Admit(
                    stages_pb2.DraftAdmitRequest(seq_id=seq_id, prompt_token_ids=ids),
                    timeout=10,
                    metadata=metadata,
                )
            except grpc.aio.AioRpcError:
                self.failures += 1

        asyncio.ensure_future(call())

    def stop_probe(self) -> None:
        pass

    async def close(self) -> None:
        await self.channel.close()


W = TypeVar("W", bound=Worker)


class Router:
    """Chooses a worker of each stage: nearly least loaded, then longest cached prefix.

    `policy`: "kv" (the choice above) or "round_robin" (every healthy worker in turn, blind to
    load and prefixes: the baseline bench/kv_routing.py measures the choice against)."""

    policy = "kv"

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        draft: list[str] | None = None,
        index: PrefixIndex | None = None,
        stage_credentials: StageCredentials | None = None,
        health_timeout_s: float = HEALTH_TIMEOUT_S,
    ) -> None:
        if not decode:
            # (No prefill worker is fine: the decode workers prefill every prompt.)
            raise ValueError("the gateway needs at least one decode address")
        creds, timeout = stage_credentials, health_timeout_s
        self.prefill = [PrefillClient(a, creds, timeout) for a in prefill]
        self.decode = [DecodeClient(a, creds, timeout) for a in decode]
        self.draft = [DraftAdmitter(a, stage_credentials) for a in draft or []]
        self.index = index or PrefixIndex(16)
        for w in [*self.prefill, *self.decode]:
            w.index = self.index
        self._turn = 0
        # Per stage: prompt tokens routed, and of those, tokens the chosen worker held cached.
        self.routed_tokens = {"prefill": 0, "decode": 0}
        self.routed_hit_tokens = {"prefill": 0, "decode": 0}

    def _known(self, w: Worker) -> WorkerKv | None:
        """`w`'s published picture when it is complete and names blocks as this gateway does."""
        kv = w.kv
        if kv is None or not kv.synced or kv.block_size != self.index.block_size:
            return None
        return kv

    def cached_tokens(self, w: Worker, names: Sequence[bytes]) -> int:
        """Prompt tokens of `names` that `w` holds on any tier (from its events, else guessed)."""
        kv = self._known(w)
        if kv is None:
            return self.index.matched_tokens(w.address, list(names))
        d, h = kv.held(names)
        return (d + h) * self.index.block_size

    def score(self, w: Worker, names: Sequence[bytes]) -> float:
        """Cached prompt tokens of `names` on `w`, a host-tier block weighted below one on the
        device (the load penalty is the caller's)."""
        kv = self._known(w)
        if kv is None:
            return float(self.index.matched_tokens(w.address, list(names)))
        return kv.weighted_tokens(names, self.index.block_size)

    def count_route(self, stage: str, prompt_tokens: int, hit_tokens: int) -> None:
        """A request routed to a `stage` worker holding `hit_tokens` of its prompt cached."""
        self.routed_tokens[stage] += prompt_tokens
        self.routed_hit_tokens[stage] += min(hit_tokens, prompt_tokens)

    def pick_draft(self) -> DraftAdmitter | None:
        return self.draft[0] if self.draft else None

    def _pick(
        self, workers: list[W], load: Callable[[W], int], names: Sequence[bytes], stage: str
    ) -> W:
        up = [c for c in workers if c.healthy]
        if not up:
            # The workers' addresses are in the log (mark_down), not in a client's error.
            raise StageUnavailable(f"no {stage} worker is available; retry later")
        if self.policy == "round_robin":
            self._turn += 1
            return up[self._turn % len(up)]
        least = min(load(c) for c in up)
        near = [c for c in up if load(c) <= least + LOAD_SLACK]
        if not names or len(near) == 1:
            return min(near, key=load)
        return max(
            near,
            key=lambda c: (
                self.score(c, names) - LOAD_PENALTY_TOKENS * (load(c) - least),
                -load(c),
            ),
        )

    @property
    def prefill_serving(self) -> bool:
        """A prefill worker is up (else decode workers prefill every prompt themselves)."""
        return any(c.healthy for c in self.prefill)

    def pick_prefill(self, names: Sequence[bytes] = ()) -> PrefillClient:
        return self._pick(self.prefill, lambda c: c.inflight, names, "prefill")

    def pick_decode(self, names: Sequence[bytes] = (), affinity: str | None = None) -> DecodeClient:
        """`affinity`: the decode worker of a Chat session's earlier turns, kept while healthy."""
        if affinity is not None and self.policy != "round_robin":
            for c in self.decode:
                if c.address == affinity and c.healthy:
                    return c
        return self._pick(self.decode, lambda c: c.load, names, "decode")

    def watch(self) -> None:
        """Start probing every prefill and decode worker; each is routed to once it serves."""
        for w in [*self.prefill, *self.decode]:
            w.watch()

    @property
    def serving(self) -> bool:
        """The gateway can take work: a decode worker is up (it prefills prompts itself while
        no prefill worker is)."""
        return self.not_ready_reason() is None

    def not_ready_reason(self) -> str | None:
        """Why a request cannot be served now (None: it can): no decode worker serves."""
        if any(c.healthy for c in self.decode):
            return None
        seen = any(c.seen_up for c in self.decode)
        return f"no decode worker is serving ({'down' if seen else 'starting'})"

    async def close(self) -> None:
        for c in [*self.prefill, *self.decode, *self.draft]:
            c.stop_probe()
            await c.close()
