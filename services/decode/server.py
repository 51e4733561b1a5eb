"""Decode worker: imports prefilled KV by handle and continuously batches every live sequence."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc
import torch

from services.decode.observe import DecodeTelemetry
from tandem import progress
from tandem.config import EngineConfig
from tandem.engine.engine_loop import EngineLoop
from tandem.engine.llm_engine import LLMEngine, StepOutput
from tandem.engine.speculator import Speculator
from tandem.kv import cuda_ipc
from tandem.kv.cache import KVCache
from tandem.kv.lease import check_lease
from tandem.kv.nixl_pool import (
    NixlEndpoint,
    NixlPeerPool,
    NixlPoolInfo,
    NixlTransferError,
    nixl_installed,
)
from tandem.kv.transport import (
    DTYPES,
    PoolLayout,
    SharedPool,
    accept_kinds,
    gather_copy,
    host_id,
)
from tandem.metrics import serve_metrics
from tandem.model.loader import load_model
from tandem.rpc import stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import count_refusals, server_interceptors, stage_channel
from tandem.rpc.convert import (
    layout_from_proto,
    layout_to_proto,
    logprob_to_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
    status_for,
)
from tandem.rpc.health import add_health, set_serving
from tandem.rpc.lease import release_until_acknowledged

log = logging.getLogger("tandem.decode")
SERVICE = "tandem.v1.Decode"


@dataclass
class PrefillPeer:
    """A registered prefill worker: its pool handle, opened once."""

    address: str
    channel: grpc.aio.Channel
    stub: stages_pb2_grpc.PrefillStub
    kind: str = "inline"
    pool_id: str = ""
    lease_key: bytes = b""  # checks the signatures of the peer's leases
    layout: PoolLayout | None = None
    shared: SharedPool | None = None
    src_kv: KVCache | None = None  # shm, cuda_ipc: the peer's pool, mapped here
    nixl: NixlPeerPool | None = None

    def close(self) -> None:
        self.src_kv = None
        if self.nixl is not None:
            self.nixl.close()
        if self.shared is not None:
            self.shared.close()


class _HandleUnusable(Exception):
    """The pool handle a prefill worker offered cannot be opened here."""

    def __init__(self, kind: str, cause: Exception) -> None:
        super().__init__(f"{kind}: {cause}")
        self.kind = kind
        self.cause = cause


@dataclass
class Session:
    """One gateway's stream: its outgoing queue and the sequences it admitted."""

    out: asyncio.Queue
    seqs: set[str] = field(default_factory=set)
    closed: bool = False  # the gateway went away: admissions still on their way are dropped


class DraftClient:
    """The decode worker's long-lived Propose stream to a draft worker.

    `propose` is called from the engine thread once per step; it waits at most `timeout_s` for
    the answer and returns None when the draft is slow or down, so that step decodes plainly.
    """

    def __init__(
        self,
        address: str,
        loop: asyncio.AbstractEventLoop,
        timeout_s: float,
        secret: bytes | None = None,
    ) -> None:
        self.address = address
        self.loop = loop
        self.timeout_s = timeout_s
        self.channel = stage_channel(
            address,
            secret,
            [
                ("grpc.use_local_subchannel_pool", 1),
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ],
        )
        self.stub = stages_pb2_grpc.DraftStub(self.channel)
        self._send: asyncio.Queue | None = None
        self._waiting: dict[int, asyncio.Future] = {}
        self._step = 0
        self._retry_at = 0.0
        self.failures = 0

    def _ensure_stream(self) -> asyncio.Queue | None:
        if self._send is not None:
            return self._send
        if time.monotonic() < self._retry_at:
            return None
        send: asyncio.Queue = asyncio.Queue()

        async def requests():
            while True:
                m = await send.get()
                if m is None:
                    return
                yield m

        call = self.stub.Propose(requests())
        self._send = send
        asyncio.ensure_future(self._read(call, send))
        return send

    async def _read(self, call, send) -> None:
        try:
            async for resp in call:
                fut = self._waiting.pop(resp.step, None)
                if fut is not None and not fut.done():
                    fut.set_result(resp)
        except grpc.aio.AioRpcError as e:
            log.warning(
                "draft worker %s unavailable (%s); decoding without speculation",
                self.address,
                e.code().name,
            )
        if self._send is send:
            self._send = None
            self._retry_at = time.monotonic() + 1.0
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_result(None)
        self._waiting.clear()

    async def _propose(self, req: stages_pb2.ProposeRequest):
        send = self._ensure_stream()
        if send is None:
            return None
        fut = self.loop.create_future()
        self._waiting[req.step] = fut
        send.put_nowait(req)
        try:
            return await asyncio.wait_for(fut, self.timeout_s)
        except TimeoutError:
            self._waiting.pop(req.step, None)
            return None

    def propose(self, batch, dropped):
        """Backend for `Speculator`: runs on the engine thread."""
        self._step += 1
        req = stages_pb2.ProposeRequest(
            step=self._step,
            seqs=[stages_pb2.DraftSync(seq_id=s, start=a, tokens=t, k=k) for s, a, t, k in batch],
            dropped=dropped,
        )
        try:
            resp = asyncio.run_coroutine_threadsafe(self._propose(req), self.loop).result(
                self.timeout_s + 1.0
            )
        except Exception:  # noqa: BLE001 - any failure means: no proposals this step
            resp = None
        if resp is None:
            self.failures += 1
            return None
        return {p.seq_id: (list(p.tokens) if p.known else None) for p in resp.proposals}


class DecodeService(stages_pb2_grpc.DecodeServicer):
    def __init__(
        self,
        config: EngineConfig,
        kv_transport: str = "auto",
        draft: list[str] | None = None,
        spec: dict | None = None,
        kv_transfer_timeout_s: float = 10.0,
        prefill: list[str] | None = None,
        stage_secret: bytes | None = None,
    ) -> None:
        accept_kinds(kv_transport, "cpu", True)  # an unknown transport fails here, at start-up
        if kv_transport == "nixl" and not nixl_installed():
            raise ValueError(
                "--kv-transport nixl: NIXL is not installed (pip install 'tandem[nixl]')"
            )
        if kv_transfer_timeout_s <= 0:
            raise ValueError(f"--kv-transfer-timeout must be > 0, got {kv_transfer_timeout_s}")
        loaded = load_model(config.model, config.resolved_dtype())
        self.model_name = loaded.config.name
        self.engine = LLMEngine(loaded, config)
        self.layout = PoolLayout.of(self.engine.kv)
        self.kv_transport = kv_transport
        self.kv_transfer_timeout_s = kv_transfer_timeout_s
        self.nixl_usable = kv_transport in ("auto", "nixl") and nixl_installed()
        if kv_transport == "auto" and not self.nixl_usable:
            log.info(
                "NIXL is not installed: KV from a prefill worker on another host will travel "
                "inline over gRPC (pip install 'tandem[nixl]' for NIXL)"
            )
        self.nixl_endpoint: NixlEndpoint | None = None  # created when a peer first uses NIXL
        self._nixl_lock = asyncio.Lock()
        # Sequences whose KV is being read through NIXL -> None, or (cancelled) whether to notify.
        self.importing: dict[str, bool | None] = {}
        self.transfer_failures = 0
        self.peer_id = f"decode-{uuid.uuid4().hex[:8]}"
        self.loop = asyncio.get_running_loop()
        self.peers: dict[str, PrefillPeer] = {}
        # The prefill workers whose KV this worker takes (its --prefill list): an Admit naming
        # another address is refused, never dialled.
        self.prefill_addresses = set(prefill or [])
        self.stage_secret = stage_secret
        self.refusals: dict[str, int] = {}  # admissions refused, by status code
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self.owner: dict[str, Session] = {}
        # seq id -> (handover ms on the host, transport, CUDA events around the copy or None)
        self.transfer: dict[str, tuple[float, str, list | None]] = {}
        self.imports_by_transport: dict[str, int] = {}
        # Per sequence, noted at its first step here: (prompt tokens found in the prefix cache,
        # queue ms, prefill ms); the last two only mean something for prefill_here sequences.
        self.prefill_info: dict[str, tuple[int, float, float]] = {}
        self.local_prefills = 0  # sequences admitted with prefill_here
        self.obs = DecodeTelemetry(self.engine, self.loop, self.layout.block_bytes)
        self.draft = None
        self.speculator = None
        self.spec_totals: dict[str, tuple[int, int]] = {}
        self._spec_seen = (0, 0, 0)
        if draft:
            spec = spec or {}
            self.draft = DraftClient(draft[0], self.loop, spec.get("timeout_s", 0.2), stage_secret)
            self.speculator = Speculator(
                self.draft.propose,
                k_min=spec.get("k_min", 1),
                k_max=spec.get("k_max", 8),
                fixed_k=spec.get("fixed_k"),
            )
        self.engine_loop = EngineLoop(
            self.engine, self._on_outputs, self._on_error, speculator=self.speculator
        )
        self.obs.metrics.watch_progress(lambda: self.engine_loop.stalled_s)
        self.engine_loop.start()

    def close(self) -> None:
        self.engine_loop.stop()
        for p in self.peers.values():
            p.close()
        if self.nixl_endpoint is not None:
            self.nixl_endpoint.close()

    # ---- peers --------------------------------------------------------------------------------
    async def peer(self, address: str) -> PrefillPeer:
        """The registered prefill peer at `address`, registering (once) on first use."""
        p = self.peers.get(address)
        if p is not None:
            return p
        if address not in self.prefill_addresses:
            known = ", ".join(sorted(self.prefill_addresses)) or "none: start it with --prefill"
            raise ValueError(
                f"prefill_address {address!r} is not a prefill peer of this decode worker "
                f"(its peers: {known})"
            )
        lock = self._peer_locks.setdefault(address, asyncio.Lock())
        async with lock:
            if address in self.peers:
                return self.peers[address]
            ch = stage_channel(
                address,
                self.stage_secret,
                [
                    ("grpc.use_local_subchannel_pool", 1),
                    ("grpc.initial_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 2000),
                    ("grpc.max_receive_message_length", 64 << 20),
                ],
            )
            stub = stages_pb2_grpc.PrefillStub(ch)
            try:
                p = await self._register(address, ch, stub)
            except BaseException:
                await ch.close()
                raise
            self.peers[address] = p
            log.info(
                "registered with prefill %s (pool %s, transport %s)", address, p.pool_id, p.kind
            )
            return p

    async def _register(self, address: str, ch, stub) -> PrefillPeer:
        """Register with one prefill worker and open the pool handle it offers. Under `auto`, a
        handle that cannot be opened here (a GPU this process cannot see, NIXL that does not
        load) is dropped from the kinds asked for, with a warning, and registration retried."""
        kinds = accept_kinds(self.kv_transport, self.engine.kv.data.device.type, self.nixl_usable)
        while True:
            try:
                return await self._register_once(address, ch, stub, kinds)
            except _HandleUnusable as e:
                if self.kv_transport != "auto" or e.kind == "inline":
                    raise e.cause from None
                log.warning(
                    "cannot use the %s KV transport with prefill %s (%s); trying the next one",
                    e.kind,
                    address,
                    e.cause,
                )
                kinds = [k for k in kinds if k != e.kind]

    async def _register_once(self, address: str, ch, stub, kinds: list[str]) -> PrefillPeer:
        req = stages_pb2.RegisterRequest(
            peer_id=self.peer_id,
            layout=layout_to_proto(self.layout),
            accept_kinds=kinds,
            host_id=host_id(),
            model=self.model_name,
        )
        if "cuda_ipc" in kinds:
            req.device_uuid = cuda_ipc.device_uuid(self.engine.kv.data.device)
        if self.nixl_endpoint is not None:
            req.nixl_agent_metadata = self.nixl_endpoint.info.agent_metadata
        resp = await stub.Register(req, timeout=10)
        h = resp.handle
        layout = layout_from_proto(h.layout)
        self.layout.check_compatible(layout)
        if h.kind not in kinds:
            raise RuntimeError(f"prefill {address} offered transport {h.kind!r}, wanted {kinds}")
        p = PrefillPeer(address, ch, stub, h.kind, h.pool_id, resp.lease_key, layout)
        try:
            await self._open_handle(p, h, req, stub, address)
        except Exception as e:  # noqa: BLE001 - the caller decides: fall back or fail
            p.close()
            raise _HandleUnusable(h.kind, e) from e
        return p

    async def _open_handle(self, p: PrefillPeer, h, req, stub, address: str) -> None:
        layout = p.layout
        if h.kind == "shm":
            p.shared = SharedPool.open(h.shm_name, layout)
            p.src_kv = p.shared.kv
        elif h.kind == "cuda_ipc":
            p.src_kv = cuda_ipc.open_pool(
                h.cuda_ipc, layout, h.device_uuid, self.engine.kv.data.device
            )
        elif h.kind == "nixl":
            if not req.nixl_agent_metadata:
                # Our agent exists from now on: register again so that the prefill agent loads
                # its metadata too (the two agents know each other, whichever side connects).
                req.nixl_agent_metadata = (await self._nixl()).info.agent_metadata
                h = (await stub.Register(req, timeout=10)).handle
                if h.kind != "nixl":
                    raise RuntimeError(f"prefill {address} changed transport to {h.kind!r}")
                p.pool_id = h.pool_id
            info = NixlPoolInfo(
                agent_metadata=h.nixl.agent_metadata,
                mem_type=h.nixl.mem_type,
                device_id=h.nixl.device_id,
                data_addr=h.nixl.data_addr,
                scales_addr=h.nixl.scales_addr,
            )
            p.nixl = await asyncio.to_thread(self.nixl_endpoint.open_peer, h.pool_id, info, layout)

    async def _nixl(self) -> NixlEndpoint:
        """This worker's NIXL agent with its pool registered (created once, on first use)."""
        async with self._nixl_lock:
            if self.nixl_endpoint is None:
                self.nixl_endpoint = await asyncio.to_thread(
                    NixlEndpoint, self.peer_id, self.engine.kv
                )
                log.info("NIXL agent %s registered the KV pool", self.peer_id)
            return self.nixl_endpoint

    def forget_peer(self, address: str) -> None:
        p = self.peers.pop(address, None)
        if p is not None:
            p.close()

    # ---- admission ----------------------------------------------------------------------------
    async def admit(self, msg: stages_pb2.Admit, session: Session) -> None:
        sid = msg.seq_id
        params = sampling_from_proto(msg.sampling)
        ids = list(msg.prompt_token_ids)
        rng = (
            torch.frombuffer(bytearray(msg.rng_state), dtype=torch.uint8) if msg.rng_state else None
        )
        t0 = time.monotonic()
        self.obs.begin(msg)
        if msg.prefill_here:
            await self._prefill_here(msg, session, params, t0)
            return
        failure = ""
        verified = False  # the caller proved it holds the lease: it is released whatever happens
        copied: list = []  # CUDA: events around the KV copy (its device time; the lease's end)
        try:
            peer = await self.peer(msg.prefill_address)
            if peer.pool_id != msg.kv.pool_id:
                # The prefill worker restarted since we registered: register again.
                self.forget_peer(msg.prefill_address)
                peer = await self.peer(msg.prefill_address)
                if peer.pool_id != msg.kv.pool_id:
                    raise ValueError(
                        f"KV reference names pool {msg.kv.pool_id!r}, unknown at its prefill worker"
                    )
            # The prefill worker's signature, not the caller, says which blocks hold this
            # prompt's KV: other blocks, or other prompt tokens, are refused.
            kv_ref = msg.kv
            check_lease(
                peer.lease_key,
                kv_ref.lease_signature,
                kv_ref.pool_id,
                kv_ref.lease_id,
                kv_ref.block_ids,
                kv_ref.num_tokens,
                kv_ref.expires_at,
                ids,
            )
            verified = True
            src_blocks = list(kv_ref.block_ids)
            kv = self.engine.kv
            staging = None  # inline: the blocks' bytes
            read: int | None = None  # nixl: blocks the READ filled (reserved in the engine)
            moved = [0]  # blocks whose KV this worker copied in (its prefix cache held the rest)
            if session.closed:
                return  # the gateway went away meanwhile (the lease is released below)
            session.seqs.add(sid)  # a gateway that goes away meanwhile cancels it too
            self.owner[sid] = session
            self.importing[sid] = None
            try:
                if peer.kind == "inline":
                    staging = await self._fetch_inline(peer, kv_ref)
                    moved[0] = len(src_blocks)  # fetched whole, whatever the cache holds
                elif peer.kind == "nixl":
                    read = await self._read_nixl(peer, msg, src_blocks, ids, params, rng, t0)
                    moved[0] = read or 0
            finally:
                cancelled = self.importing.pop(sid, None)
            if cancelled is not None:
                # Cancelled while its KV was on the way: drop it (and the blocks it reserved).
                await asyncio.wrap_future(self.engine_loop.submit(lambda e: e.abort(sid)))
                session.seqs.discard(sid)
                self.owner.pop(sid, None)
                self.obs.finished(sid, "abort")
                if cancelled:
                    session.out.put_nowait(
                        stages_pb2.DecodeOut(finished=[self._finished(sid, "abort")])
                    )
                return

            def copy_in(dst_blocks: list[int], first: int = 0) -> None:
                # dst_blocks[j] receives the prompt's block first + j.
                n = len(dst_blocks)
                if staging is not None:
                    idx = torch.tensor(dst_blocks, dtype=torch.long, device=kv.data.device)
                    kv.data.index_copy_(2, idx, staging[:, :, first : first + n].to(kv.data.device))
                elif kv.data.is_cuda:
                    # Enqueued, not waited for: the steps that read these blocks follow on the
                    # same stream, and the lease is released once `copied` has passed.
                    copied[:] = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                    copied[0].record()
                    gather_copy(kv, dst_blocks, peer.src_kv, src_blocks[first : first + n])
                    copied[1].record()
                    moved[0] += n
                else:
                    gather_copy(kv, dst_blocks, peer.src_kv, src_blocks[first : first + n])
                    moved[0] += n

            def join(e: LLMEngine) -> bool:
                if peer.kind == "nixl":
                    imported = read is not None and e.start_prefilled(sid)
                else:
                    _, imported = e.admit_prefilled(
                        ids, msg.first_token, params, sid, copy_in, rng, tenant=msg.tenant
                    )
                # Noted on the engine thread, before a step can finish the sequence and report
                # its transfer (a short sequence can finish before this coroutine resumes), and
                # before a step can start it (the time its KV handover ended).
                joined[0] = time.monotonic()
                self.transfer[sid] = (
                    (joined[0] - t0) * 1e3,
                    peer.kind if imported else "recompute",
                    copied if imported else None,
                )
                return imported

            joined = [0.0]
            imported = await asyncio.wrap_future(self.engine_loop.submit(join))
            device_s = 0.0
            if copied:
                await _passed(copied[1])
                device_s = copied[0].elapsed_time(copied[1]) / 1e3
            self.obs.admitted(
                sid,
                t0,
                joined[0] + device_s,
                peer.kind if imported else "recompute",
                moved[0] if imported else 0,
            )
            if imported:
                self.imports_by_transport[peer.kind] = (
                    self.imports_by_transport.get(peer.kind, 0) + 1
                )
        except Exception as e:  # noqa: BLE001 - reported on the stream, the session goes on
            log.warning("admit %s failed: %s", sid, e)
            failure = str(e) or type(e).__name__
            if isinstance(e, NixlTransferError):
                self.transfer_failures += 1
            self._refuse(sid, session, t0, e)
        finally:
            # The blocks were copied (or will be recomputed, or never will be: then `failure`
            # tells the prefill side so): it may reuse them.
            if verified:
                if copied:  # the prefill worker may reuse its blocks once the copy has run
                    await _passed(copied[1])
                asyncio.ensure_future(self._release(msg.prefill_address, msg.kv.lease_id, failure))

    def _refuse(self, sid: str, session: Session, t0: float, e: Exception) -> None:
        """End a sequence whose admission failed, telling the gateway why (and how: its code)."""
        code = status_for(e)
        self.refuse(code.name.lower())
        self.obs.admit_failed(sid, t0, e)
        session.seqs.discard(sid)
        self.owner.pop(sid, None)
        session.out.put_nowait(
            stages_pb2.DecodeOut(
                finished=[
                    stages_pb2.SeqFinished(
                        seq_id=sid,
                        finish_reason="error",
                        error=f"decode admit: {e}",
                        error_code=code.name,
                    )
                ]
            )
        )

    def refuse(self, reason: str) -> None:
        """Count a refused call or admission by its reason (WorkerStats.refusals, /metrics)."""
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        self.obs.metrics.refusals.labels(reason).inc()

    async def _prefill_here(
        self, msg: stages_pb2.Admit, session: Session, params, t0: float
    ) -> None:
        """Conditional disaggregation: this worker prefills the prompt itself (no KV transfer),
        computing only what its prefix cache lacks, in chunks mixed with its decodes."""
        sid = msg.seq_id
        ids = list(msg.prompt_token_ids)
        if session.closed:
            return
        session.seqs.add(sid)
        self.owner[sid] = session
        try:
            await asyncio.wrap_future(
                self.engine_loop.submit(
                    lambda e: e.add_request(ids, params, sid, tenant=msg.tenant)
                )
            )
        except Exception as e:  # noqa: BLE001 - reported on the stream, the session goes on
            log.warning("admit %s (prefill here) failed: %s", sid, e)
            self._refuse(sid, session, t0, e)
            return
        self.local_prefills += 1
        self.transfer[sid] = (0.0, "none", None)
        self.obs.prefill_here(sid, t0)

    async def _read_nixl(
        self,
        peer: PrefillPeer,
        msg: stages_pb2.Admit,
        peer_blocks: list[int],
        ids: list[int],
        params,
        rng: torch.Tensor | None,
        t0: float,
    ) -> int | None:
        """Reserve the sequence's blocks, then fill those its prefix cache lacks with one NIXL
        READ waited for off the engine thread (the running sequences keep decoding); returns the
        number of blocks read. None when this pool has no room: the sequence is then queued and
        recomputed here, nothing is read."""
        sid = msg.seq_id

        def reserve(e: LLMEngine) -> tuple[int, list[int]] | None:
            got = e.reserve_prefilled(
                ids, msg.first_token, params, sid, rng, peer_blocks, tenant=msg.tenant
            )
            if got is None:
                self.transfer[sid] = ((time.monotonic() - t0) * 1e3, "recompute", None)
            return got

        got = await asyncio.wrap_future(self.engine_loop.submit(reserve))
        if got is None:
            return None
        first, blocks = got
        src = peer_blocks[first : first + len(blocks)]
        try:
            await asyncio.to_thread(peer.nixl.read, src, blocks, self.kv_transfer_timeout_s)
        except BaseException as e:
            if getattr(e, "blocks_safe", True):
                await asyncio.wrap_future(self.engine_loop.submit(lambda en: en.abort(sid)))
            else:
                # NIXL could not cancel the READ: it may still write into these blocks, so they
                # stay out of circulation rather than corrupt another sequence's KV.
                log.error(
                    "NIXL READ could not be cancelled; %d KV blocks are withheld", len(blocks)
                )
                await asyncio.wrap_future(self.engine_loop.submit(lambda en: en.seqs.pop(sid)))
            raise
        return len(blocks)

    async def _fetch_inline(self, peer: PrefillPeer, kv: stages_pb2.KvRef) -> torch.Tensor:
        lay = peer.layout
        n = len(kv.block_ids)
        staging = torch.empty(
            (lay.num_layers, 2, n, lay.block_size, lay.kv_heads, lay.head_dim),
            dtype=DTYPES[lay.dtype],
        )
        async for chunk in peer.stub.FetchBlocks(stages_pb2.FetchBlocksRequest(kv=kv), timeout=30):
            t = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8).view(staging.dtype)
            staging[:, :, chunk.index] = t.view(staging[:, :, chunk.index].shape)
        return staging

    async def _release(self, address: str, lease_id: str, failure: str = "") -> None:
        p = self.peers.get(address)
        if p is None or not lease_id:
            return
        req = stages_pb2.ReleaseRequest(lease_ids=[lease_id], transfer_error=failure)
        await release_until_acknowledged(p.stub, req, f"prefill {address}")

    # ---- engine thread -> event loop ----------------------------------------------------------
    def _on_outputs(self, outs: list[StepOutput]) -> None:
        self.obs.on_step(outs, self.engine_loop.last_step)
        now = time.monotonic()
        for o in outs:
            seq = o.seq
            if seq.seq_id not in self.prefill_info:  # its first step here
                started = seq.first_scheduled_time
                self.prefill_info[seq.seq_id] = (
                    seq.num_cached_tokens,
                    (started - seq.arrival_time) * 1e3 if started else 0.0,
                    (now - started) * 1e3 if started else 0.0,
                )
        items = [
            (
                o.seq.seq_id,
                list(o.new_token_ids),
                list(o.new_logprobs),
                o.seq.finish_reason if o.finished else None,
                (o.seq.spec_proposed, o.seq.spec_accepted),
                o.prompt_logprobs,
            )
            for o in outs
        ]
        for o in outs:
            if o.finished and o.seq.spec_proposed:
                self.spec_totals[o.seq.seq_id] = (o.seq.spec_proposed, o.seq.spec_accepted)
        if self.speculator is not None:
            st = self.speculator.stats
            last = self._spec_seen
            rounds, prop, acc = (
                st.verify_rounds - last[0],
                st.proposed - last[1],
                st.accepted - last[2],
            )
            if rounds:
                self.obs.metrics.spec_proposals.inc(rounds)
                self.obs.metrics.spec_proposed_tokens.inc(prop)
                self.obs.metrics.spec_accepted_tokens.inc(acc)
            self._spec_seen = (st.verify_rounds, st.proposed, st.accepted)
        self.loop.call_soon_threadsafe(self._dispatch, items)

    def _on_error(self, seq_ids: list[str], message: str) -> None:
        items = [(sid, [], [], "error:" + message, (0, 0), None) for sid in seq_ids]
        self.loop.call_soon_threadsafe(self._dispatch, items)

    def _dispatch(self, items) -> None:
        per_session: dict[int, tuple[Session, stages_pb2.DecodeOut]] = {}
        for sid, toks, lps, reason, (proposed, accepted), prompt_lps in items:
            sess = self.owner.get(sid)
            if sess is None:
                if reason is not None:
                    self.prefill_info.pop(sid, None)
                continue
            _, msg = per_session.setdefault(id(sess), (sess, stages_pb2.DecodeOut()))
            if toks:
                msg.tokens.append(
                    stages_pb2.SeqTokens(
                        seq_id=sid,
                        token_ids=toks,
                        logprobs=[logprob_to_proto(lp) for lp in lps if lp is not None],
                        proposed_draft_tokens=proposed,
                        accepted_draft_tokens=accepted,
                        prompt_logprobs=(
                            prompt_logprobs_to_proto(prompt_lps) if prompt_lps is not None else []
                        ),
                    )
                )
            if reason is not None:
                self.obs.finished(sid, reason)
                msg.finished.append(self._finished(sid, reason))
                sess.seqs.discard(sid)
                self.owner.pop(sid, None)
        for sess, msg in per_session.values():
            sess.out.put_nowait(msg)

    def _finished(self, sid: str, reason: str) -> stages_pb2.SeqFinished:
        ms, kind, copied = self.transfer.pop(sid, (0.0, "", None))
        if copied and copied[1].query():
            # The copy's device time (it ran before this sequence's steps, on the same stream;
            # a sequence cancelled before its first step may end while it still runs).
            ms += copied[0].elapsed_time(copied[1])
        proposed, accepted = self.spec_totals.pop(sid, (0, 0))
        cached, queue_ms, prefill_ms = self.prefill_info.pop(sid, (0, 0.0, 0.0))
        err = ""
        if reason.startswith("error:"):
            reason, err = "error", reason[len("error:") :]
        return stages_pb2.SeqFinished(
            seq_id=sid,
            finish_reason=reason,
            error=err,
            kv_transfer_ms=ms,
            kv_transport=kind,
            proposed_draft_tokens=proposed,
            accepted_draft_tokens=accepted,
            cached_prompt_tokens=cached,
            queue_ms=queue_ms,
            prefill_ms=prefill_ms,
        )

    # ---- RPCs ---------------------------------------------------------------------------------
    async def Session(self, request_iterator, context):
        session = Session(out=asyncio.Queue())

        async def read() -> None:
            try:
                async for msg in request_iterator:
                    kind = msg.WhichOneof("kind")
                    if kind == "admit":
                        asyncio.ensure_future(self.admit(msg.admit, session))
                    elif kind == "cancel":
                        await self._cancel(msg.cancel.seq_id, session)
            finally:
                session.out.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                msg = await session.out.get()
                if msg is None:
                    break
                yield msg
        finally:
            reader.cancel()
            # The gateway went away: its sequences have no one to stream to.
            self._drop_session(session)

    def _drop_session(self, session: Session) -> None:
        """Abort every sequence of a session that ended. Nothing here awaits: a handler being
        cancelled (the gateway's connection dropped) cannot stop half-way and leave sequences
        running for nobody."""
        session.closed = True
        ids = []
        for sid in list(session.seqs):
            session.seqs.discard(sid)
            if sid in self.importing:
                self.importing[sid] = False  # `admit` drops it when its transfer ends
            elif self.owner.get(sid) is session:
                self.owner.pop(sid, None)
                ids.append(sid)
        if not ids:
            return
        fut = self.engine_loop.submit(lambda e: [sid for sid in ids if e.abort(sid)])

        def aborted(f) -> None:
            if not f.cancelled() and f.exception() is None:
                self.loop.call_soon_threadsafe(self._forget_aborted, f.result())

        fut.add_done_callback(aborted)

    def _forget_aborted(self, ids: list[str]) -> None:
        for sid in ids:
            self.obs.finished(sid, "abort")
            self.prefill_info.pop(sid, None)
            self.transfer.pop(sid, None)
            self.spec_totals.pop(sid, None)

    async def _cancel(self, sid: str, session: Session, notify: bool = True) -> None:
        if sid in self.importing:
            # Its KV is still on the way (a READ may be writing into its blocks): `admit` drops
            # it when the transfer ends.
            self.importing[sid] = notify
            return
        if self.owner.get(sid) is not session:
            return
        aborted = await asyncio.wrap_future(self.engine_loop.submit(lambda e: e.abort(sid)))
        if aborted:
            self.obs.finished(sid, "abort")
        session.seqs.discard(sid)
        self.owner.pop(sid, None)
        if aborted and notify:
            session.out.put_nowait(stages_pb2.DecodeOut(finished=[self._finished(sid, "abort")]))
        else:
            self.prefill_info.pop(sid, None)

    async def Stats(self, request, context):
        def snap(e: LLMEngine):
            return stages_pb2.WorkerStats(
                running=e.num_running,
                waiting=e.num_waiting,
                used_blocks=e.pool.num_used,
                total_blocks=e.pool.num_blocks,
                registered_peers=len(self.peers),
                kv_imports=sum(self.imports_by_transport.values()),
                imports_by_transport=self.imports_by_transport,
                kv_transfer_failures=self.transfer_failures,
                kv_transfers_in_flight=len(self.importing),
                cached_free_blocks=e.pool.num_cached_free,
                prefix_query_tokens=e.prefix_cache.query_tokens if e.prefix_cache else 0,
                prefix_hit_tokens=e.prefix_cache.hit_tokens if e.prefix_cache else 0,
                block_size=e.config.block_size,
                local_prefills=self.local_prefills,
                max_seq_tokens=e.pool.num_blocks * e.config.block_size,
                max_sequences=e.config.max_num_seqs + e.config.max_queued_seqs,
                refusals=self.refusals,
            )

        return await asyncio.wrap_future(self.engine_loop.submit(snap))


async def _passed(event: torch.cuda.Event) -> None:
    """Until the device has passed `event`, polled from the event loop: a thread blocked in
    cudaEventSynchronize spins on a core, and many admissions at once would starve the engine."""
    while not event.query():
        await asyncio.sleep(2e-4)


async def _register_at_start(service: DecodeService, address: str, wait_s: float) -> None:
    """Register with a prefill worker named at start, waiting quietly while it starts itself;
    a worker that does not answer within `wait_s`, or refuses, stops this one with one line."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    progress.report(f"waiting for prefill {address}")
    while True:
        try:
            await service.peer(address)
            progress.report(f"registered with prefill {address}")
            return
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise ConnectionError(
                    f"registration with prefill {address} failed: {e.code().name}: {e.details()}"
                ) from None
            if loop.time() > deadline:
                raise ConnectionError(
                    f"prefill worker {address} did not answer within {wait_s:.0f}s "
                    "(--prefill-wait); is it running?"
                ) from None
        await asyncio.sleep(0.5)


async def serve(
    config: EngineConfig,
    host: str,
    port: int,
    kv_transport: str = "auto",
    prefill: list[str] | None = None,
    metrics_port: int | None = None,
    draft: list[str] | None = None,
    spec: dict | None = None,
    kv_transfer_timeout_s: float = 10.0,
    prefill_wait_s: float = 300.0,
    stage_secret: bytes | None = None,
) -> None:
    """Run the decode worker until cancelled; registers with the given prefill workers, the only
    ones whose KV it takes (waiting up to `prefill_wait_s` for them), before it reports SERVING.

    Prometheus text is served on `metrics_port` (None: no metrics endpoint). With
    `stage_secret`, every call but health checks must carry it, and every call to the prefill
    and draft workers sends it (tandem.rpc.auth).
    """
    auth = server_interceptors(stage_secret)
    server = grpc.aio.server(interceptors=auth)
    service = DecodeService(
        config, kv_transport, draft, spec, kv_transfer_timeout_s, prefill or [], stage_secret
    )
    count_refusals(auth, service.refuse)
    stages_pb2_grpc.add_DecodeServicer_to_server(service, server)
    health = await add_health(server, [SERVICE])
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"decode: cannot bind {host}:{port}")
    await server.start()
    try:
        metrics = serve_metrics(service.obs.metrics.registry, host, metrics_port, "decode")
    except OSError:
        await server.stop(None)
        service.close()
        raise
    try:
        for addr in prefill or []:
            await _register_at_start(service, addr, prefill_wait_s)
    except BaseException:
        await server.stop(None)
        service.close()
        if metrics is not None:
            metrics.close()
        raise
    await set_serving(health, [SERVICE], True)
    progress.report("ready")
    log.info("decode serving on %s:%d (model %s)", host, bound, service.model_name)
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
