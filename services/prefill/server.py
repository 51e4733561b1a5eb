"""Prefill worker: batches prompts, writes their KV into its pool, leases it to decode workers.

A decode worker that offers its own pool at registration (shared memory or CUDA IPC, on this
host; services/prefill/push.py) may also reserve blocks for a prompt (Decode.Reserve); the Run that carries the reservation then writes
the prompt's KV straight into them (a push) and gives its own blocks back at once, leasing
nothing. A reservation it cannot write (a pool it did not map, expired, forged, replayed) is
answered with a lease as without it, and the answer says why.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, replace

import grpc
import numpy as np

from services.prefill.observe import PrefillTelemetry
from services.prefill.push import PushTargets
from services.worker import KvEventsServicer, run_worker, worker_stats
from tandem.config import EngineConfig
from tandem.device import resolved_device, resolved_dtype
from tandem.engine.engine_loop import EngineLoop
from tandem.engine.llm_engine import LLMEngine, StepOutput
from tandem.kv import transports
from tandem.kv.events import KvEventFeed
from tandem.kv.layout import LayoutMismatch, PoolLayout, host_id
from tandem.kv.lease import LeaseRefused, SpentLeases, lease_key, sign_lease
from tandem.kv.reservation import (
    WRITE_MARGIN_S,
    ReservationRefused,
    check_reservation,
    push_proof,
)
from tandem.kv.transports import PeerRequest, TransportKind
from tandem.kv.transports.inline import InlineTransport
from tandem.kv.transports.shm import SharedPool
from tandem.model.info import context_length
from tandem.model.loader import load_model
from tandem.rpc import stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import StageCredentials
from tandem.rpc.convert import (
    layout_to_proto,
    logprob_to_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
    status_for,
)
from tandem.rpc.limits import prefill_limits

log = logging.getLogger("tandem.prefill")
SERVICE = "tandem.v1.Prefill"


class LeaseLimit(RuntimeError):
    """A peer holds as many leases as it may (`max_leases_per_peer`)."""


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string (`ipv4:127.0.0.1:5432`, `ipv6:[::1]:5432`)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0]
    return peer


@dataclass
class PrefillResult:
    first_token: int
    logprob: object
    lease_id: str
    token: str
    token_ids: list[int]
    names: bytes  # the full blocks' prefix-cache names, concatenated (b"": not named)
    expires_at: float  # Unix seconds
    blocks: list[int]
    num_tokens: int
    rng_state: bytes
    queue_ms: float
    prefill_ms: float
    cached_tokens: int = 0  # prompt tokens found in this worker's prefix cache
    prompt_logprobs: list | None = None  # sampling.prompt_logprobs: one entry per prompt token


class PrefillService(KvEventsServicer, stages_pb2_grpc.PrefillServicer):
    """Prefill.Run batches prompts on the engine thread; the KV stays leased until released."""

    def __init__(
        self,
        config: EngineConfig,
        lease_ttl_s: float = 30.0,
        max_leases_per_peer: int = 1024,
        stage_secret: bytes | None = None,
    ) -> None:
        if max_leases_per_peer < 1:
            raise ValueError(f"--max-leases-per-peer must be >= 1, got {max_leases_per_peer}")
        self.max_leases_per_peer = max_leases_per_peer
        # Prompts in progress -> the peer host that asked (counted against its lease limit), and
        # how many each host has. Engine thread only: `add` counts them while the event loop
        # answers calls, so a change from the loop could come mid-count.
        self.run_owner: dict[str, str] = {}
        self.runs_by_owner: dict[str, int] = {}
        self.refusals: dict[str, int] = {}
        loaded = load_model(config.model, resolved_dtype(config))
        self.model_name = loaded.config.name
        self.max_model_len = context_length(
            config.max_model_len, loaded.config.max_position_embeddings
        )
        device = resolved_device(config)
        self.pool_id = f"prefill-{uuid.uuid4().hex[:8]}"
        # Signs every lease of this pool (KvRef.lease_signature). With a stage secret it is
        # derived from it, and each decode worker derives it too: it never travels, and only a
        # worker can make it. Without one (a port open to whoever reaches it) it is drawn here
        # and handed to each peer that registers.
        self.sends_lease_key = stage_secret is None
        self.lease_key = (
            secrets.token_bytes(32)
            if stage_secret is None
            else lease_key(stage_secret, self.pool_id)
        )
        self.shared: SharedPool | None = None
        kv = None
        if device.type == "cpu":
            # On a CPU host the pool lives in named shared memory so decode workers can map it.
            probe = LLMEngine.pool_layout(loaded, config)
            self.shared = SharedPool.create(probe)
            kv = self.shared.kv
        # Its sequences end at their first token: no decode step to capture in CUDA graphs.
        config = replace(config, cuda_graphs=False)
        self.engine = LLMEngine(loaded, config, kv=kv, lease_ttl_s=lease_ttl_s)
        self.layout = PoolLayout.of(self.engine.kv)
        # Every transport this worker can serve its pool through (a decode peer picks).
        self.transports = {
            kind: transports.create(kind, self.engine.kv, name=self.pool_id, shared=self.shared)
            for kind in TransportKind
        }
        self.inline = InlineTransport(self.engine.kv)  # serves FetchBlocks
        self.loop = asyncio.get_running_loop()
        self.pending: dict[str, asyncio.Future[PrefillResult]] = {}
        self.peers: set[str] = set()
        self.push_targets = PushTargets(self.engine.kv, self.layout, stage_secret)
        self.spent_reservations = SpentLeases()  # reservations written (each once)
        self.pushes = 0
        self.inline_bytes_sent = 0
        self.transfer_failures = 0  # handovers a decode worker reported as failed
        self.obs = PrefillTelemetry(self.engine, self.loop)
        # What the prefix cache holds, streamed to the gateway's router (KvEvents).
        self.kv_events = KvEventFeed()
        self.engine.add_kv_listener(self.kv_events.on_event)
        self.engine_loop = EngineLoop(self.engine, self._on_outputs, self._on_error)
        self.obs.metrics.watch_engine_loop(self.engine_loop)
        self.engine_loop.start()

    def close(self) -> None:
        self.engine_loop.stop()
        self.push_targets.close()
        for t in self.transports.values():
            t.close()
        if self.shared is not None:
            self.shared.close()

    # ---- engine thread ------------------------------------------------------------------------
    def _start_run(self, seq_id: str, owner: str) -> None:
        self.run_owner[seq_id] = owner
        self.runs_by_owner[owner] = self.runs_by_owner.get(owner, 0) + 1

    def _end_run(self, seq_id: str) -> str:
        """Stop counting a prompt against its peer; returns the peer ("" when unknown)."""
        owner = self.run_owner.pop(seq_id, None)
        if owner is None:
            return ""
        left = self.runs_by_owner[owner] - 1
        if left:
            self.runs_by_owner[owner] = left
        else:
            del self.runs_by_owner[owner]
        return owner

    # ---- engine thread -> event loop ----------------------------------------------------------
    def _on_outputs(self, outs: list[StepOutput]) -> None:
        self.obs.on_step(outs, self.engine_loop.last_step)
        now = time.monotonic()
        for o in outs:
            seq = o.seq
            if seq.lease_id is None:
                if o.finished:  # ended without KV to lease: its caller must not wait for one
                    self._end_run(seq.seq_id)
                    if seq.error is not None:  # the request's own fault: a 400 naming it
                        self.loop.call_soon_threadsafe(self._fail, seq.seq_id, seq.error, True)
                        continue
                    reason = f"the prompt ended without KV to lease ({seq.finish_reason})"
                    self.loop.call_soon_threadsafe(self._fail, seq.seq_id, reason)
                continue
            owner = self._end_run(seq.seq_id)  # its lease counts from now on
            lease = self.engine.lease(seq.lease_id)
            lease.owner = owner
            state = (
                seq.generator.get_state().numpy().tobytes() if seq.generator is not None else b""
            )
            res = PrefillResult(
                first_token=o.new_token_ids[0],
                logprob=o.new_logprobs[0],
                lease_id=seq.lease_id,
                token=lease.token,
                token_ids=lease.token_ids,
                names=lease.names,
                expires_at=time.time() + (lease.expires_at - now),
                blocks=list(lease.blocks),
                num_tokens=lease.num_tokens,
                rng_state=state,
                queue_ms=((seq.first_scheduled_time or now) - seq.arrival_time) * 1e3,
                prefill_ms=(now - (seq.first_scheduled_time or now)) * 1e3,
                cached_tokens=seq.num_cached_tokens,
                prompt_logprobs=o.prompt_logprobs,
            )
            self.loop.call_soon_threadsafe(self._resolve, seq.seq_id, res)

    def _on_error(self, seq_ids: list[str], message: str) -> None:
        for sid in seq_ids:
            self._end_run(sid)
            self.loop.call_soon_threadsafe(self._fail, sid, message)

    # ---- event loop ---------------------------------------------------------------------------
    def _resolve(self, seq_id: str, res: PrefillResult) -> None:
        fut = self.pending.pop(seq_id, None)
        if fut is None or fut.done():
            # The caller went away: nobody will collect these blocks.
            self.engine_loop.submit(lambda e: e.release_lease(res.lease_id))
            return
        fut.set_result(res)

    def _fail(self, seq_id: str, message: str, invalid: bool = False) -> None:
        self.obs.forget(seq_id)
        fut = self.pending.pop(seq_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(
                ValueError(message) if invalid else RuntimeError(f"prefill failed: {message}")
            )

    # ---- RPCs ---------------------------------------------------------------------------------
    async def Register(self, request, context):
        peer_layout = PoolLayout.from_proto(request.layout)
        try:
            self.layout.check_compatible(peer_layout)
        except LayoutMismatch as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        if request.model and request.model != self.model_name:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"model mismatch: prefill serves {self.model_name!r}, peer serves {request.model!r}",
            )
        kinds, unknown = transports.accepted_by(request)
        peer = PeerRequest(
            peer_id=request.peer_id,
            same_host=request.host_id == host_id(),
            nixl_agent_metadata=request.nixl_agent_metadata,
        )
        transport, reasons = transports.pick(kinds, self.transports, peer)
        if transport is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "no KV transport both workers can use (" + "; ".join(unknown + reasons) + ")",
            )
        if transport.kind is TransportKind.INLINE and reasons:
            log.warning(
                "decode peer %s gets the inline KV transport: %s",
                request.peer_id,
                "; ".join(reasons),
            )
        handle = stages_pb2.PoolHandle(
            pool_id=self.pool_id, layout=layout_to_proto(self.layout), host_id=host_id()
        )
        transports.set_handle_kind(handle, transport.kind)
        try:
            await transport.export(handle, peer)
        except Exception as e:  # noqa: BLE001 - reported to the peer
            log.exception("exporting the KV pool for %s failed", transport.kind)
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{transport.kind} KV transport unavailable: {e}",
            )
        self.peers.add(request.peer_id)
        push = self.push_targets.map(request, peer)
        log.info(
            "registered decode peer %s (%s%s)",
            request.peer_id,
            transport.describe(),
            ", pushes into its pool" if push else "",
        )
        return stages_pb2.RegisterResponse(
            handle=handle,
            model=self.model_name,
            lease_key=self.lease_key if self.sends_lease_key else b"",
            push=push,
        )

    def refuse(self, reason: str) -> None:
        """Count a refused call by its reason (WorkerStats.refusals, /metrics)."""
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        self.obs.metrics.refusals.labels(reason).inc()

    def receive_limits(self) -> dict[str, int]:
        """The largest request each method takes (tandem.rpc.limits)."""
        return prefill_limits(self.max_model_len, self.layout.block_size, self.max_leases_per_peer)

    async def Run(self, request, context):
        rid = request.request_id or uuid.uuid4().hex
        if rid in self.pending:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is already being prefilled"
            )
        params = sampling_from_proto(request.sampling)
        # One copy out of the message, in C; the engine checks the array in C too.
        ids = np.array(request.prompt_token_ids, dtype=np.uint32)
        owner = peer_host(context.peer() or "")
        fut: asyncio.Future[PrefillResult] = self.loop.create_future()
        matcher = None  # a constrained request's, compiled off the engine thread below

        def add(e: LLMEngine) -> None:
            held = e.leases_owned_by(owner) + self.runs_by_owner.get(owner, 0)
            if held >= self.max_leases_per_peer:
                raise LeaseLimit(
                    f"this client holds {held} KV leases (max_leases_per_peer="
                    f"{self.max_leases_per_peer}): release some or let them expire, then retry"
                )
            e.add_request(
                ids, params, rid, prefill_only=True, tenant=request.tenant, matcher=matcher
            )
            self._start_run(rid, owner)

        def drop(e: LLMEngine) -> None:
            e.abort(rid)
            self._end_run(rid)

        self.pending[rid] = fut
        self.obs.begin(rid, context)
        try:
            try:
                # The grammar compiles while the engine keeps prefilling other prompts.
                matcher = await self.engine.prepare_matcher(ids, params)
                await asyncio.wrap_future(self.engine_loop.submit(add))
            except Exception as e:  # noqa: BLE001 - mapped to a status
                self.pending.pop(rid, None)
                self.obs.forget(rid)
                if isinstance(e, LeaseLimit):
                    self.refuse("lease_limit")
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
                await context.abort(status_for(e), str(e))
            res = await fut
        except asyncio.CancelledError:
            # Client cancelled or its deadline passed (while queued, or even before `add` ran):
            # drop the prompt from the queue, or give back the KV if the prefill finished in
            # the same instant (nobody will collect it; `_resolve` gives back a later one).
            self.pending.pop(rid, None)
            self.obs.forget(rid)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                lease_id = fut.result().lease_id
                self.engine_loop.submit(lambda e: e.release_lease(lease_id))
            else:
                self.engine_loop.submit(drop)
            raise
        except ValueError as e:  # the request's own fault (a grammar past its time budget)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        refused = ""
        if request.HasField("push_to"):
            pushed = await self._push(request.push_to, rid, ids, res)
            if isinstance(pushed, str):
                refused = pushed
            else:
                proof, push_ms = pushed
                out = stages_pb2.PrefillResponse(
                    first_token=res.first_token,
                    rng_state=res.rng_state,
                    queue_ms=res.queue_ms,
                    prefill_ms=res.prefill_ms,
                    cached_tokens=res.cached_tokens,
                    push_proof=proof,
                    push_ms=push_ms,
                )
                return self._finish_response(out, res)
        signature = sign_lease(
            self.lease_key,
            self.pool_id,
            res.token,
            res.blocks,
            res.num_tokens,
            res.expires_at,
            res.token_ids,
            res.names,
        )
        out = stages_pb2.PrefillResponse(
            first_token=res.first_token,
            kv=stages_pb2.KvRef(
                pool_id=self.pool_id,
                block_ids=res.blocks,
                num_tokens=res.num_tokens,
                lease_id=res.token,
                lease_signature=signature,
                expires_at=res.expires_at,
                block_names=res.names,
            ),
            rng_state=res.rng_state,
            queue_ms=res.queue_ms,
            prefill_ms=res.prefill_ms,
            cached_tokens=res.cached_tokens,
            push_refused=refused,
        )
        return self._finish_response(out, res)

    def _finish_response(
        self, out: stages_pb2.PrefillResponse, res: PrefillResult
    ) -> stages_pb2.PrefillResponse:
        if res.prompt_logprobs is not None:
            out.prompt_logprobs.extend(prompt_logprobs_to_proto(res.prompt_logprobs))
        if res.logprob is not None:
            out.first_logprob.CopyFrom(logprob_to_proto(res.logprob))
            out.has_logprob = True
        return out

    async def _push(
        self, rsv, rid: str, ids: np.ndarray, res: PrefillResult
    ) -> tuple[bytes, float] | str:
        """Write a prefilled prompt's KV into the decode blocks `rsv` reserved, then give this
        worker's blocks back (nothing is leased). Returns the proof of the write and how long
        it took (ms), or why it was not written (the KV stays leased, for the decode worker to
        pull)."""
        target = self.push_targets.get(rsv.pool_id)
        if target is None:
            return (
                f"decode pool {rsv.pool_id!r} is not mapped here (its worker offered no pool for "
                "pushes at registration, or restarted)"
            )
        try:
            if rsv.writer_pool_id != self.pool_id:
                raise ReservationRefused(
                    f"the reservation is for prefill pool {rsv.writer_pool_id!r}, not this one"
                )
            check_reservation(
                target.key, rsv, rid, ids, self.layout.block_size, time.time(), WRITE_MARGIN_S
            )
            self.spent_reservations.take(rsv.pool_id, rsv.token, rsv.expires_at)
        except LeaseRefused as e:  # ReservationRefused, or a replay (SpentLeases)
            self.refuse("reservation")
            log.warning("push of %s refused: %s", rid, e)
            return str(e)
        first = rsv.first_block
        src = res.blocks[first : first + len(rsv.block_ids)]
        t0 = time.perf_counter()
        # Off the event loop: a long prompt's copy must not hold up other calls. The lease
        # keeps this worker's blocks until the copy has ended, even when the call is cancelled
        # meanwhile; then they go back, written or not. A copy that failed leaves them leased:
        # the answer carries the lease, and the decode worker pulls.
        copy = asyncio.ensure_future(
            asyncio.to_thread(self.push_targets.write, target, list(rsv.block_ids), src)
        )
        abandoned = False

        def release(f: asyncio.Future) -> None:
            if (abandoned or f.exception() is None) and self.engine.release_lease_token(res.token):
                self.engine_loop.wake()

        copy.add_done_callback(release)
        try:
            await asyncio.shield(copy)
        except asyncio.CancelledError:
            abandoned = True
            raise
        except Exception as e:  # noqa: BLE001 - answered with the lease instead
            log.exception("writing %s into decode pool %s failed", rid, rsv.pool_id)
            self.refuse("push_failed")
            return f"the write into the decode pool failed: {e}"
        self.pushes += 1
        return push_proof(target.key, rsv.token, rsv.signature), (time.perf_counter() - t0) * 1e3

    async def Release(self, request, context):
        ids = list(request.lease_ids)
        if request.transfer_error:
            # The decode worker's negative acknowledgement: the blocks did not reach it.
            self.transfer_failures += 1
            log.warning(
                "KV handover of %s failed at the decode worker: %s", ids, request.transfer_error
            )
        # Not a command queued behind the engine's step: a long step (a long prompt on a CPU)
        # outlasted the caller's deadline, which cancelled the command and left the blocks held
        # until the lease expired. The leases end now; their blocks are free for the next step.
        n = sum(self.engine.release_lease_token(i) for i in ids)
        if n:
            self.engine_loop.wake()
        return stages_pb2.ReleaseResponse(released=n)

    async def _lease(self, token: str, context):
        """The live lease a peer's token names, or the call ends with NOT_FOUND."""
        lease = await asyncio.wrap_future(
            self.engine_loop.submit(lambda e: e.lease_by_token(token))
        )
        if lease is None:
            self.refuse("unknown_lease")
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                "KV lease unknown or expired: a lease token comes only from Prefill.Run "
                "and is valid until released or its TTL passes",
            )
        return lease

    async def FetchBlocks(self, request, context):
        lease = await self._lease(request.kv.lease_id, context)
        for i, b in enumerate(lease.blocks):
            data = self.inline.block_bytes(b)
            self.inline_bytes_sent += len(data)
            yield stages_pb2.BlockBytes(index=i, data=data)

    async def Stats(self, request, context):
        # The engine's figures come from its thread; this worker's own counters (changed by
        # the event loop) are read here, on the loop.
        st = await asyncio.wrap_future(self.engine_loop.submit(lambda e: e.stats()))
        return worker_stats(
            st,
            leased_blocks=st.leased_blocks,
            inline_bytes_sent=self.inline_bytes_sent,
            registered_peers=len(self.peers),
            kv_transfer_failures=self.transfer_failures,
            leases=st.leases,
            refusals=self.refusals,
            pushes=self.pushes,
        )


async def serve(
    config: EngineConfig,
    host: str,
    port: int,
    lease_ttl_s: float = 30.0,
    metrics_port: int | None = None,
    stage_credentials: StageCredentials | None = None,
    max_leases_per_peer: int = 1024,
    metrics_token: bytes | None = None,
) -> None:
    """Run the prefill worker until cancelled; Prometheus text on `metrics_port` (None: off), to
    scrapes that carry `metrics_token` when given.

    With a stage secret in `stage_credentials`, every call but health checks must carry it (or,
    for Run, Release and Stats, the gateway secret), and the pool's lease key is derived from
    it; with a certificate there, the port serves TLS only (tandem.rpc.auth)."""
    secret = stage_credentials.secret if stage_credentials is not None else None
    await run_worker(
        "prefill",
        SERVICE,
        lambda: PrefillService(config, lease_ttl_s, max_leases_per_peer, secret),
        stages_pb2_grpc.add_PrefillServicer_to_server,
        host,
        port,
        metrics_port,
        stage_credentials,
        ready_message=lambda s, _: f"(model {s.model_name}, pool {s.pool_id})",
        metrics_token=metrics_token,
    )
