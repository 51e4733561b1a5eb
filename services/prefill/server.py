"""Prefill worker: batches prompts, writes their KV into its pool, leases it to decode workers."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from dataclasses import dataclass

import grpc

from services.prefill.observe import PrefillTelemetry
from tandem import progress
from tandem.config import EngineConfig
from tandem.engine.engine_loop import EngineLoop
from tandem.engine.llm_engine import LLMEngine, StepOutput
from tandem.kv import cuda_ipc
from tandem.kv.lease import sign_lease
from tandem.kv.nixl_pool import NixlEndpoint, nixl_missing_reason
from tandem.kv.transport import (
    LayoutMismatch,
    PoolLayout,
    SharedPool,
    block_to_bytes,
    host_id,
    pick_kind,
)
from tandem.metrics import serve_metrics
from tandem.model.loader import load_model
from tandem.rpc import stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import count_refusals, server_interceptors
from tandem.rpc.convert import (
    layout_from_proto,
    layout_to_proto,
    logprob_to_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
    status_for,
)
from tandem.rpc.health import add_health, set_serving

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
    expires_at: float  # Unix seconds
    blocks: list[int]
    num_tokens: int
    rng_state: bytes
    queue_ms: float
    prefill_ms: float
    cached_tokens: int = 0  # prompt tokens found in this worker's prefix cache
    prompt_logprobs: list | None = None  # sampling.prompt_logprobs: one entry per prompt token


class PrefillService(stages_pb2_grpc.PrefillServicer):
    """Prefill.Run batches prompts on the engine thread; the KV stays leased until released."""

    def __init__(
        self, config: EngineConfig, lease_ttl_s: float = 30.0, max_leases_per_peer: int = 1024
    ) -> None:
        if max_leases_per_peer < 1:
            raise ValueError(f"--max-leases-per-peer must be >= 1, got {max_leases_per_peer}")
        self.max_leases_per_peer = max_leases_per_peer
        # Prompts in progress -> the peer host that asked (counted against its lease limit).
        self.run_owner: dict[str, str] = {}
        self.refusals: dict[str, int] = {}
        loaded = load_model(config.model, config.resolved_dtype())
        self.model_name = loaded.config.name
        device = config.resolved_device()
        self.pool_id = f"prefill-{uuid.uuid4().hex[:8]}"
        # Signs every lease of this pool (KvRef.lease_signature); registered peers get it.
        self.lease_key = secrets.token_bytes(32)
        self.shared: SharedPool | None = None
        kv = None
        if device.type == "cpu":
            # On a CPU host the pool lives in named shared memory so decode workers can map it.
            probe = LLMEngine.pool_layout(loaded, config)
            self.shared = SharedPool.create(probe)
            kv = self.shared.kv
        self.engine = LLMEngine(loaded, config, kv=kv, lease_ttl_s=lease_ttl_s)
        self.layout = PoolLayout.of(self.engine.kv)
        self.loop = asyncio.get_running_loop()
        self.pending: dict[str, asyncio.Future[PrefillResult]] = {}
        self.peers: set[str] = set()
        self.inline_bytes_sent = 0
        self.nixl: NixlEndpoint | None = None  # created by the first peer that asks for NIXL
        self._nixl_lock = asyncio.Lock()
        self.transfer_failures = 0  # handovers a decode worker reported as failed
        self.obs = PrefillTelemetry(self.engine, self.loop)
        self.engine_loop = EngineLoop(self.engine, self._on_outputs, self._on_error)
        self.obs.metrics.watch_progress(lambda: self.engine_loop.stalled_s)
        self.engine_loop.start()

    def close(self) -> None:
        self.engine_loop.stop()
        if self.nixl is not None:
            self.nixl.close()
        if self.shared is not None:
            self.shared.close()

    # ---- engine thread -> event loop ----------------------------------------------------------
    def _on_outputs(self, outs: list[StepOutput]) -> None:
        self.obs.on_step(outs, self.engine_loop.last_step)
        now = time.monotonic()
        for o in outs:
            seq = o.seq
            if seq.lease_id is None:
                continue
            lease = self.engine.leases.leases[seq.lease_id]
            lease.owner = self.run_owner.get(seq.seq_id, "")
            state = (
                seq.generator.get_state().numpy().tobytes() if seq.generator is not None else b""
            )
            res = PrefillResult(
                first_token=o.new_token_ids[0],
                logprob=o.new_logprobs[0],
                lease_id=seq.lease_id,
                token=lease.token,
                token_ids=lease.token_ids,
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
            self.loop.call_soon_threadsafe(self._fail, sid, message)

    def _resolve(self, seq_id: str, res: PrefillResult) -> None:
        self.run_owner.pop(seq_id, None)  # the lease itself counts from now on
        fut = self.pending.pop(seq_id, None)
        if fut is None or fut.done():
            # The caller went away: nobody will collect these blocks.
            self.engine_loop.submit(lambda e: e.leases.release(res.lease_id))
            return
        fut.set_result(res)

    def _fail(self, seq_id: str, message: str) -> None:
        self.obs.forget(seq_id)
        self.run_owner.pop(seq_id, None)
        fut = self.pending.pop(seq_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(RuntimeError(f"prefill failed: {message}"))

    # ---- RPCs ---------------------------------------------------------------------------------
    async def Register(self, request, context):
        peer_layout = layout_from_proto(request.layout)
        try:
            self.layout.check_compatible(peer_layout)
        except LayoutMismatch as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        if request.model and request.model != self.model_name:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"model mismatch: prefill serves {self.model_name!r}, peer serves {request.model!r}",
            )
        kinds = list(request.accept_kinds) or ["inline"]
        same_host = request.host_id == host_id()
        kind, reasons = pick_kind(
            kinds,
            same_host=same_host,
            pool_device_type=self.engine.kv.data.device.type,
            has_shared_pool=self.shared is not None,
            nixl_missing=nixl_missing_reason,
        )
        if kind is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "no KV transport both workers can use (" + "; ".join(reasons) + ")",
            )
        if kind == "inline" and "nixl" in kinds:
            log.warning(
                "decode peer %s gets the inline KV transport: %s",
                request.peer_id,
                nixl_missing_reason(),
            )
        handle = stages_pb2.PoolHandle(
            kind=kind,
            pool_id=self.pool_id,
            layout=layout_to_proto(self.layout),
            shm_name=self.shared.name if kind == "shm" else "",
            host_id=host_id(),
        )
        try:
            if kind == "nixl":
                handle.nixl.CopyFrom(await self._nixl_pool(request))
            elif kind == "cuda_ipc":
                handle.cuda_ipc = cuda_ipc.export_pool(self.engine.kv)
                handle.device_uuid = cuda_ipc.device_uuid(self.engine.kv.data.device)
        except Exception as e:  # noqa: BLE001 - reported to the peer
            log.exception("exporting the KV pool for %s failed", kind)
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{kind} KV transport unavailable: {e}"
            )
        self.peers.add(request.peer_id)
        log.info("registered decode peer %s (transport %s)", request.peer_id, kind)
        return stages_pb2.RegisterResponse(
            handle=handle, model=self.model_name, lease_key=self.lease_key
        )

    async def _nixl_pool(self, request) -> stages_pb2.NixlPool:
        """This worker's pool as a NIXL peer sees it (the agent is created on first use) and the
        decode agent's metadata loaded, so the two agents know each other."""
        async with self._nixl_lock:
            if self.nixl is None:
                self.nixl = await asyncio.to_thread(NixlEndpoint, self.pool_id, self.engine.kv)
                log.info(
                    "NIXL agent %s registered the KV pool (%s)", self.pool_id, self.nixl.mem_type
                )
            if request.nixl_agent_metadata:
                await asyncio.to_thread(
                    self.nixl.add_peer, request.peer_id, request.nixl_agent_metadata
                )
        info = self.nixl.info
        return stages_pb2.NixlPool(
            agent_metadata=info.agent_metadata,
            mem_type=info.mem_type,
            device_id=info.device_id,
            data_addr=info.data_addr,
            scales_addr=info.scales_addr,
        )

    def refuse(self, reason: str) -> None:
        """Count a refused call by its reason (WorkerStats.refusals, /metrics)."""
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        self.obs.metrics.refusals.labels(reason).inc()

    async def Run(self, request, context):
        rid = request.request_id or uuid.uuid4().hex
        if rid in self.pending:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is already being prefilled"
            )
        params = sampling_from_proto(request.sampling)
        ids = list(request.prompt_token_ids)
        owner = peer_host(context.peer() or "")
        fut: asyncio.Future[PrefillResult] = self.loop.create_future()

        def add(e: LLMEngine) -> None:
            held = e.leases.owned_by(owner) + sum(1 for o in self.run_owner.values() if o == owner)
            if held >= self.max_leases_per_peer:
                raise LeaseLimit(
                    f"this client holds {held} KV leases (max_leases_per_peer="
                    f"{self.max_leases_per_peer}): release some or let them expire, then retry"
                )
            e.add_request(ids, params, rid, prefill_only=True, tenant=request.tenant)
            self.run_owner[rid] = owner

        self.pending[rid] = fut
        self.obs.begin(rid, context)
        try:
            await asyncio.wrap_future(self.engine_loop.submit(add))
        except Exception as e:  # noqa: BLE001 - mapped to a status
            self.pending.pop(rid, None)
            self.obs.forget(rid)
            if isinstance(e, LeaseLimit):
                self.refuse("lease_limit")
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            await context.abort(status_for(e), str(e))
        try:
            res = await fut
        except asyncio.CancelledError:
            # Client cancelled or its deadline passed: drop the prompt from the queue, or give
            # back the KV if the prefill finished in the same instant (nobody will collect it).
            self.pending.pop(rid, None)
            self.obs.forget(rid)
            self.run_owner.pop(rid, None)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                lease_id = fut.result().lease_id
                self.engine_loop.submit(lambda e: e.leases.release(lease_id))
            else:
                self.engine_loop.submit(lambda e: e.abort(rid))
            raise
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        signature = sign_lease(
            self.lease_key,
            self.pool_id,
            res.token,
            res.blocks,
            res.num_tokens,
            res.expires_at,
            res.token_ids,
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
            ),
            rng_state=res.rng_state,
            queue_ms=res.queue_ms,
            prefill_ms=res.prefill_ms,
            cached_tokens=res.cached_tokens,
        )
        if res.prompt_logprobs is not None:
            out.prompt_logprobs.extend(prompt_logprobs_to_proto(res.prompt_logprobs))
        if res.logprob is not None:
            out.first_logprob.CopyFrom(logprob_to_proto(res.logprob))
            out.has_logprob = True
        return out

    async def Release(self, request, context):
        ids = list(request.lease_ids)
        if request.transfer_error:
            # The decode worker's negative acknowledgement: the blocks did not reach it.
            self.transfer_failures += 1
            log.warning(
                "KV handover of %s failed at the decode worker: %s", ids, request.transfer_error
            )
        n = await asyncio.wrap_future(
            self.engine_loop.submit(lambda e: sum(e.leases.release_token(i) for i in ids))
        )
        return stages_pb2.ReleaseResponse(released=n)

    async def _lease(self, token: str, context):
        """The live lease a peer's token names, or the call ends with NOT_FOUND."""
        lease = await asyncio.wrap_future(self.engine_loop.submit(lambda e: e.leases.get(token)))
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
            data = block_to_bytes(self.engine.kv, b)
            self.inline_bytes_sent += len(data)
            yield stages_pb2.BlockBytes(index=i, data=data)

    async def Stats(self, request, context):
        def snap(e: LLMEngine):
            return stages_pb2.WorkerStats(
                running=e.num_running,
                waiting=e.num_waiting,
                used_blocks=e.pool.num_used,
                total_blocks=e.pool.num_blocks,
                leased_blocks=e.leases.num_blocks,
                inline_bytes_sent=self.inline_bytes_sent,
                registered_peers=len(self.peers),
                kv_transfer_failures=self.transfer_failures,
                cached_free_blocks=e.pool.num_cached_free,
                prefix_query_tokens=e.prefix_cache.query_tokens if e.prefix_cache else 0,
                prefix_hit_tokens=e.prefix_cache.hit_tokens if e.prefix_cache else 0,
                block_size=e.config.block_size,
                leases=len(e.leases.leases),
                refusals=self.refusals,
            )

        return await asyncio.wrap_future(self.engine_loop.submit(snap))


async def serve(
    config: EngineConfig,
    host: str,
    port: int,
    lease_ttl_s: float = 30.0,
    metrics_port: int | None = None,
    stage_secret: bytes | None = None,
    max_leases_per_peer: int = 1024,
) -> None:
    """Run the prefill worker until cancelled; Prometheus text on `metrics_port` (None: off).

    With `stage_secret`, every call but health checks must carry it (tandem.rpc.auth)."""
    auth = server_interceptors(stage_secret)
    server = grpc.aio.server(
        interceptors=auth, options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    service = PrefillService(config, lease_ttl_s, max_leases_per_peer)
    count_refusals(auth, service.refuse)
    stages_pb2_grpc.add_PrefillServicer_to_server(service, server)
    health = await add_health(server, [SERVICE])
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"prefill: cannot bind {host}:{port}")
    await server.start()
    try:
        metrics = serve_metrics(service.obs.metrics.registry, host, metrics_port, "prefill")
    except OSError:
        await server.stop(None)
        service.close()
        raise
    await set_serving(health, [SERVICE], True)
    progress.report("ready")
    log.info(
        "prefill serving on %s:%d (model %s, pool %s)",
        host,
        bound,
        service.model_name,
        service.pool_id,
    )
    try:
        await server.wait_for_termination()
    finally:
        try:
            # Cancelled by SIGTERM, the stop itself may be cancelled: close the service anyway
            # (a shared-memory pool is unlinked there).
            await server.stop(1.0)
        finally:
            service.close()
            if metrics is not None:
                metrics.close()
