"""Decode worker: imports prefilled KV by handle and continuously batches every live sequence.

Prefilled KV arrives two ways: pulled (an Admit names a prefill worker's lease; this worker
copies the blocks) or pushed (the gateway reserved blocks here with `Reserve`, the prefill worker
wrote into them through this worker's pool handle, and the Admit names the reservation). On a CPU
host the pool lives in named shared memory so that prefill workers can map it for pushes; on a
GPU host they map it through CUDA IPC.

This module holds the worker's state, the engine thread's hand-off of new tokens to the gateway
streams, cancellation and the RPCs. The service composes its parts: the engine and its loop, the
prefill peers (services/decode/peers.py), the telemetry (observe.py) and the admission
(admission.py: `Admission`, handed the maps it shares with the service).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field

import grpc
import numpy as np

from services.decode.admission import Admission, PushTarget
from services.decode.draft_client import DraftClient
from services.decode.observe import DecodeTelemetry
from services.decode.peers import PrefillPeers
from services.worker import KvEventsServicer, run_worker, worker_stats
from tandem import telemetry as tel
from tandem.config import EngineConfig
from tandem.device import resolved_device, resolved_dtype
from tandem.engine.engine_loop import EngineLoop
from tandem.engine.llm_engine import LLMEngine, StepOutput
from tandem.engine.sequence import Sequence
from tandem.engine.speculator import Speculator
from tandem.kv import transports
from tandem.kv.block_copy import DeviceCopy
from tandem.kv.events import KvEventFeed
from tandem.kv.layout import PoolLayout, host_id
from tandem.kv.names import block_hashes_in_slices
from tandem.kv.reservation import prompt_digest, reservation_key, sign_reservation
from tandem.kv.transports import TransportKind
from tandem.kv.transports.cuda_ipc import device_uuid, export_pool
from tandem.kv.transports.shm import SharedPool
from tandem.model.info import context_length
from tandem.model.loader import load_model
from tandem.rpc import stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import StageCredentials
from tandem.rpc.convert import (
    layout_to_proto,
    logprob_to_proto,
    prompt_logprobs_to_proto,
    status_for,
)
from tandem.rpc.limits import decode_limits

log = logging.getLogger("tandem.decode")
SERVICE = "tandem.v1.Decode"


def finish_reason(seq: Sequence) -> str:
    """A finished sequence's reason as `_dispatch` takes it: "invalid:<why>" for one the engine
    failed for its own request's fault (`Sequence.error`: a grammar past its time budget)."""
    if seq.finish_reason == "error" and seq.error is not None:
        return "invalid:" + seq.error
    return seq.finish_reason or "stop"


@dataclass
class Session:
    """One gateway's stream: its outgoing queue and the sequences it admitted."""

    out: asyncio.Queue
    seqs: set[str] = field(default_factory=set)
    closed: bool = False  # the gateway went away: admissions still on their way are dropped


class DecodeService(KvEventsServicer, stages_pb2_grpc.DecodeServicer):
    def __init__(
        self,
        config: EngineConfig,
        kv_transport: str = "auto",
        draft: list[str] | None = None,
        spec: dict | None = None,
        kv_transfer_timeout_s: float = 10.0,
        prefill: list[str] | None = None,
        stage_credentials: StageCredentials | None = None,
        reservation_ttl_s: float = 10.0,
    ) -> None:
        transports.check_requested(kv_transport)  # fails here, before the model loads
        if kv_transfer_timeout_s <= 0:
            raise ValueError(f"--kv-transfer-timeout must be > 0, got {kv_transfer_timeout_s}")
        if reservation_ttl_s < 0:
            raise ValueError(f"--kv-reservation-ttl must be >= 0, got {reservation_ttl_s}")
        loaded = load_model(config.model, resolved_dtype(config))
        self.model_name = loaded.config.name
        self.max_model_len = context_length(
            config.max_model_len, loaded.config.max_position_embeddings
        )
        self.reservation_ttl_s = reservation_ttl_s
        self.pool_id = f"decode-{uuid.uuid4().hex[:8]}"
        self.shared: SharedPool | None = None
        if reservation_ttl_s > 0 and resolved_device(config).type == "cpu":
            # Pushes: prefill workers on this host map the pool and write reserved KV into it.
            self.shared = SharedPool.create(LLMEngine.pool_layout(loaded, config))
        # (With --kv-transport inline or nixl the segment is not offered; it costs nothing more
        # than the private pool it replaces.)
        self.engine = LLMEngine(loaded, config, kv=self.shared.kv if self.shared else None)
        self.layout = PoolLayout.of(self.engine.kv)
        secret = stage_credentials.secret if stage_credentials is not None else None
        # Signs this pool's reservations: derived from the stage secret (each prefill worker
        # derives it too), or drawn here and sent at registration without one.
        key = reservation_key(secret, self.pool_id) if secret else secrets.token_bytes(32)
        push_pool = None
        self.push: PushTarget | None = None
        kv = self.engine.kv
        kind = TransportKind.SHM if self.shared is not None else TransportKind.CUDA_IPC
        # Pushed KV comes the way pulled KV would: only through a transport --kv-transport allows.
        allowed = transports.accept_kinds(kv_transport, kv.data.device.type, False)
        if (
            reservation_ttl_s > 0
            and (self.shared is not None or kv.data.is_cuda)
            and kind in allowed
        ):
            push_pool = stages_pb2.PoolHandle(
                pool_id=self.pool_id, layout=layout_to_proto(self.layout), host_id=host_id()
            )
            if kind is TransportKind.SHM:
                push_pool.shm_name = self.shared.name
            else:
                push_pool.cuda_ipc = export_pool(kv)
                push_pool.device_uuid = device_uuid(kv.data.device)
            transports.set_handle_kind(push_pool, kind)
            self.push = PushTarget(self.pool_id, key, self.layout.block_size, f"{kind.value}_push")
        self.peers = PrefillPeers(
            self.engine.kv,
            kv_transport=kv_transport,
            peer_id=self.pool_id,
            model_name=self.model_name,
            addresses=prefill or [],
            stage_credentials=stage_credentials,
            transfer_timeout_s=kv_transfer_timeout_s,
            push_pool=push_pool,
            reservation_key=key,
        )
        self.loop = asyncio.get_running_loop()
        self.refusals: dict[str, int] = {}  # admissions refused, by status code
        self.owner: dict[str, Session] = {}
        self.transfer: dict[str, tuple[float, str]] = {}
        # GPU copies of imported KV (seq id -> the copy, the Admit's arrival on the monotonic
        # clock): the handover lasts until they ran.
        self.copies: dict[str, tuple[DeviceCopy, float]] = {}
        # Per sequence, noted at its first step here: (prompt tokens found in the prefix cache,
        # queue ms, prefill ms); the last two only mean something for prefill_here sequences.
        self.prefill_info: dict[str, tuple[int, float, float]] = {}
        self.obs = DecodeTelemetry(self.engine, self.loop, self.layout.block_bytes)
        self.draft = None
        self.speculator = None
        self.spec_totals: dict[str, tuple[int, int]] = {}
        self._spec_seen = (0, 0, 0)
        if draft:
            spec = spec or {}
            self.draft = DraftClient(
                draft[0], self.loop, spec.get("timeout_s", 0.2), stage_credentials
            )
            self.speculator = Speculator(
                self.draft.propose,
                k_min=spec.get("k_min", 1),
                k_max=spec.get("k_max", 8),
                fixed_k=spec.get("fixed_k"),
            )
        # What the prefix cache holds, streamed to the gateway's router (KvEvents).
        self.kv_events = KvEventFeed()
        self.engine.add_kv_listener(self.kv_events.on_event)
        self.engine_loop = EngineLoop(
            self.engine, self._on_outputs, self._on_error, speculator=self.speculator
        )
        self.obs.metrics.watch_engine_loop(self.engine_loop)
        self.admission = Admission(
            self.engine_loop,
            self.engine.prepare_matcher,
            self.peers,
            self.obs,
            self.owner,
            self.transfer,
            self.copies,
            self._finished,
            self.refuse,
            self.push,
        )
        self.engine_loop.start()

    def close(self) -> None:
        self.engine_loop.stop()
        self.peers.close()
        if self.shared is not None:
            self.shared.close()

    def refuse(self, reason: str) -> None:
        """Count a refused call or admission by its reason (WorkerStats.refusals, /metrics)."""
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        self.obs.metrics.refusals.labels(reason).inc()

    def receive_limits(self) -> dict[str, int]:
        """The largest request each method takes (tandem.rpc.limits)."""
        return decode_limits(self.max_model_len, self.layout.block_size)

    # ---- engine thread -> event loop ----------------------------------------------------------
    def _on_outputs(self, outs: list[StepOutput]) -> None:
        self.obs.on_step(outs, self.engine_loop.last_step)
        if len(self.admission.room):  # sequences wait for room: this step may have freed blocks
            self.loop.call_soon_threadsafe(self.admission.room.wake, self.engine.pool.num_free)
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
                finish_reason(o.seq) if o.finished else None,
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
        step_ended_at = tel.epoch_ns(self.engine_loop.last_step[1]) / 1e9
        self.loop.call_soon_threadsafe(self._dispatch, items, step_ended_at)

    def _on_error(self, seq_ids: list[str], message: str) -> None:
        items = [(sid, [], [], "error:" + message, (0, 0), None) for sid in seq_ids]
        self.loop.call_soon_threadsafe(self._dispatch, items)

    def _dispatch(self, items, step_ended_at: float = 0.0) -> None:
        per_session: dict[int, tuple[Session, stages_pb2.DecodeOut]] = {}
        for sid, toks, lps, reason, (proposed, accepted), prompt_lps in items:
            sess = self.owner.get(sid)
            if sess is None:
                if reason is not None:
                    self.prefill_info.pop(sid, None)
                continue
            _, msg = per_session.setdefault(
                id(sess), (sess, stages_pb2.DecodeOut(step_ended_at=step_ended_at))
            )
            if toks:
                # Only the fields a sequence has are set: for most, its id and one token (an
                # empty list given to the constructor costs as much as a field).
                seq = msg.tokens.add(seq_id=sid, token_ids=toks)
                if lps:
                    seq.logprobs.extend(logprob_to_proto(lp) for lp in lps if lp is not None)
                if proposed:
                    seq.proposed_draft_tokens = proposed
                    seq.accepted_draft_tokens = accepted
                if prompt_lps is not None:
                    seq.prompt_logprobs.extend(prompt_logprobs_to_proto(prompt_lps))
            if reason is not None:
                self.obs.finished(sid, reason)
                msg.finished.append(self._finished(sid, reason))
                sess.seqs.discard(sid)
                self.owner.pop(sid, None)
        for sess, msg in per_session.values():
            sess.out.put_nowait(msg)

    def _finished(self, sid: str, reason: str) -> stages_pb2.SeqFinished:
        ms, kind = self.transfer.pop(sid, (0.0, ""))
        copy, t0 = self.copies.pop(sid, (None, 0.0))
        if copy is not None and copy.passed():
            # It ran before this sequence's steps, on the same stream (a sequence cancelled
            # before its first step may end while it still runs: then its host time alone).
            ms = max(ms, (copy.passed_at() - t0) * 1e3)
        proposed, accepted = self.spec_totals.pop(sid, (0, 0))
        cached, queue_ms, prefill_ms = self.prefill_info.pop(sid, (0, 0.0, 0.0))
        err, code = "", ""
        if reason.startswith("error:"):
            reason, err = "error", reason[len("error:") :]
        elif reason.startswith("invalid:"):  # the request's own fault: the gateway says 400
            reason, err, code = "error", reason[len("invalid:") :], "INVALID_ARGUMENT"
        return stages_pb2.SeqFinished(
            seq_id=sid,
            finish_reason=reason,
            error=err,
            error_code=code,
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
                        asyncio.ensure_future(self.admission.admit(msg.admit, session))
                    elif kind == "cancel":
                        # Not awaited: the abort waits for the engine's step to end, and the
                        # admissions and cancels behind it on this stream must not.
                        asyncio.ensure_future(self._cancel(msg.cancel.seq_id, session))
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
            # One on its way in is dropped by `admit` when its transfer or compile ends.
            if not self.admission.joining(sid, False) and self.owner.get(sid) is session:
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
            self.copies.pop(sid, None)
            self.spec_totals.pop(sid, None)

    async def _cancel(self, sid: str, session: Session, notify: bool = True) -> None:
        if self.admission.joining(sid, notify):
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

    async def Reserve(self, request, context):
        """Reserve blocks for a prompt whose KV the named prefill worker will write into them;
        an answer without a reservation says why there is no push for it (the caller pulls)."""
        sid = request.seq_id
        if not sid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "seq_id is empty")
        address = request.prefill_address
        if address not in self.peers.addresses:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prefill_address {address!r} is not a prefill peer of this decode worker",
            )
        push = self.push
        if push is None:
            return stages_pb2.ReserveResponse(
                refused="this decode worker takes no pushes (--kv-reservation-ttl 0, or a "
                "--kv-transport that rules out its pool's kind)"
            )
        peer = self.peers.get(address)
        if peer is None or not peer.push:
            return stages_pb2.ReserveResponse(
                refused=f"prefill {address} does not write into this worker's pool"
            )
        ids = np.array(request.prompt_token_ids, dtype=np.uint32)
        ttl = self.reservation_ttl_s
        # Named here, not on the engine thread: neither the reservation's prefix lookup nor the
        # admission (the handover) hashes the prompt. A long prompt in slices, between which
        # the other streams of this loop run.
        names = (
            await block_hashes_in_slices(ids, self.layout.block_size)
            if self.engine.prefix_cache is not None
            else None
        )
        try:
            res = await asyncio.wrap_future(
                self.engine_loop.submit(
                    lambda e: e.reserve(ids, sid, ttl, request.tenant or None, block_names=names)
                )
            )
        except Exception as e:  # noqa: BLE001 - mapped to a status
            await context.abort(status_for(e), f"Reserve: {e}")
        if res is None:
            return stages_pb2.ReserveResponse(refused="no room for the prompt's blocks now")
        out = stages_pb2.KvReservation(
            pool_id=push.pool_id,
            writer_pool_id=peer.pool_id,
            token=res.token,
            seq_id=sid,
            first_block=res.first,
            block_ids=res.table.blocks[res.first :],
            num_tokens=len(ids),
            expires_at=time.time() + (res.expires_at - time.monotonic()),
            prompt_digest=prompt_digest(ids),
        )
        out.signature = sign_reservation(push.key, out)
        return stages_pb2.ReserveResponse(reservation=out)

    async def Unreserve(self, request, context):
        token, in_flight = request.token, request.write_may_be_in_flight
        released = await asyncio.wrap_future(
            self.engine_loop.submit(lambda e: e.unreserve(token, in_flight))
        )
        return stages_pb2.UnreserveResponse(released=released)

    async def Stats(self, request, context):
        # The engine's figures come from its thread; this worker's own counters (changed by
        # the event loop) are read here, on the loop.
        st, (reservations, reserved_blocks) = await asyncio.wrap_future(
            self.engine_loop.submit(lambda e: (e.stats(), e.reservation_stats()))
        )
        adm = self.admission
        return worker_stats(
            st,
            registered_peers=len(self.peers),
            kv_imports=sum(adm.imports_by_transport.values()),
            imports_by_transport=adm.imports_by_transport,
            kv_transfer_failures=adm.transfer_failures,
            kv_transfers_in_flight=len(adm.importing),
            local_prefills=adm.local_prefills,
            max_seq_tokens=st.max_seq_tokens,
            max_sequences=st.max_sequences,
            refusals=self.refusals,
            reservations=reservations,
            reserved_blocks=reserved_blocks,
        )


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
    stage_credentials: StageCredentials | None = None,
    metrics_token: bytes | None = None,
    reservation_ttl_s: float = 10.0,
) -> None:
    """Run the decode worker until cancelled; registers with the given prefill workers, the only
    ones whose KV it takes (waiting up to `prefill_wait_s` for them), before it reports SERVING.

    Prometheus text is served on `metrics_port` (None: no metrics endpoint), to scrapes that
    carry `metrics_token` when given. With a stage secret
    in `stage_credentials`, every call but health checks must carry it (or, for Session and
    Stats, the gateway secret), every call to the prefill and draft workers sends it, and the
    prefill pools' lease keys are derived from it; with a certificate there, the port serves
    TLS only, and
    with a CA bundle, the calls to the prefill and draft workers are TLS (tandem.rpc.auth).
    """

    async def register(service: DecodeService) -> None:
        for addr in prefill or []:
            await service.peers.register_at_start(addr, prefill_wait_s)

    await run_worker(
        "decode",
        SERVICE,
        lambda: DecodeService(
            config,
            kv_transport,
            draft,
            spec,
            kv_transfer_timeout_s,
            prefill or [],
            stage_credentials,
            reservation_ttl_s,
        ),
        stages_pb2_grpc.add_DecodeServicer_to_server,
        host,
        port,
        metrics_port,
        stage_credentials,
        before_serving=register,
        ready_message=lambda s, _: f"(model {s.model_name})",
        metrics_token=metrics_token,
    )
