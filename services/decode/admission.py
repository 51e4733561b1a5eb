"""How a sequence joins the decode worker: its KV handed over from a prefill worker, or prefilled here.

`Admission` is a part of `DecodeService` (services/decode/server.py), built with what it uses:
the engine loop, the engine's `prepare_matcher`, the prefill peers, the telemetry, the maps it
shares with the service (which gateway session owns a sequence, each sequence's KV handover
and the GPU copies still running), and two callbacks (a finished message for a sequence, a
refusal counted). It owns the state of sequences still on their way in (KV in transfer, grammar
compiling) and its counters.

An Admit naming a prefill worker goes through five steps, each a method below:
1. `_verified_peer`: the registered peer (registering again when it restarted) and a check of
   the lease's signature against the prompt: the peer, not the caller, says which blocks hold it;
   a lease is taken once (a reference replayed after its release is refused);
2. `_prepared_matcher`: a constrained sequence's grammar compiled and replayed off the engine
   thread (the batch keeps running while it waits); a cancel meanwhile drops it;
3. `_fetch`: the transport readies the blocks (the inline transport streams them, NIXL reads them
   into blocks the engine reserved); a cancel meanwhile is noted, and honoured when it ends;
4. `_join`: on the engine thread, the sequence joins (copying the blocks its prefix cache lacks,
   or starting the reserved sequence);
5. telemetry (`obs.admitted`), and the lease released whatever happened (with the failure, if
   any, so the prefill worker counts it).

When this pool has no room for the prompt's blocks (a decode worker behind its prefill workers),
the sequence waits for room with its KV still under its lease at the prefill worker
(`RoomWaiters`: in arrival order, woken after steps that freed blocks), and is recomputed here
only if the lease's deadline comes first.

An Admit naming a reservation (`_admit_pushed`: the prefill worker wrote the KV straight into
blocks this worker reserved, Decode.Reserve) only checks this worker's own signature and the
prefill worker's proof of the write, and starts the sequence: nothing is copied, and the prompt's
ids are not hashed (the engine compares them with those it reserved).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from services.decode.observe import DecodeTelemetry
from services.decode.peers import PrefillPeer, PrefillPeers
from tandem.api.sampling_params import SamplingParams
from tandem.engine.llm_engine import LLMEngine
from tandem.kv.block_copy import DeviceCopy
from tandem.kv.lease import SpentLeases, check_lease
from tandem.kv.names import split_names
from tandem.kv.reservation import check_push_proof, check_reservation
from tandem.kv.transports import BlockSource, TransferError
from tandem.rpc import stages_pb2
from tandem.rpc.convert import sampling_from_proto, status_for

if TYPE_CHECKING:
    from services.decode.server import Session
    from tandem.engine.engine_loop import EngineLoop

log = logging.getLogger("tandem.decode")


@dataclass
class _Request:
    """One Admit, parsed."""

    msg: stages_pb2.Admit
    ids: np.ndarray  # the prompt's ids, uint32
    params: SamplingParams
    rng: torch.Tensor | None
    t0: float
    matcher: Any = None  # a constrained sequence's grammar matcher, once prepared

    @property
    def sid(self) -> str:
        return self.msg.seq_id


@dataclass(frozen=True)
class PushTarget:
    """This worker's pool as prefill workers write into it: what checks its reservations."""

    pool_id: str
    key: bytes  # signs its reservations (tandem/kv/reservation.py)
    block_size: int
    kind: str  # the transport name reported for pushed KV, e.g. shm_push


# A sequence waiting for room stops this long before its lease expires (the prefill worker then
# reclaims the blocks) and is queued to be recomputed here instead.
LEASE_MARGIN_S = 2.0
# Waiters look again at least this often, should no step wake them (blocks freed by an abort).
ROOM_POLL_S = 0.25


class RoomWaiters:
    """Sequences prefilled elsewhere waiting for room in this pool, in arrival order; their KV
    stays with the prefill worker meanwhile. `wake(free)` (on the event loop, after a step)
    lets go those at the head whose blocks fit, together, in `free`."""

    def __init__(self) -> None:
        self.queue: deque[tuple[int, asyncio.Future[None]]] = deque()
        self.waits = 0  # sequences that waited, ever

    def __len__(self) -> int:
        return len(self.queue)

    async def wait(self, blocks: int, timeout: float) -> None:
        """Until woken (room for `blocks` may be there) or `timeout` seconds."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.queue.append((blocks, fut))
        try:
            await asyncio.wait_for(fut, max(0.0, timeout))
        except TimeoutError:
            pass
        finally:
            if not fut.done():
                fut.cancel()

    def wake(self, free: int) -> None:
        queue = self.queue
        while queue:
            blocks, fut = queue[0]
            if fut.done():
                queue.popleft()  # timed out or cancelled
                continue
            if blocks > free:
                break
            free -= blocks
            queue.popleft()
            fut.set_result(None)


class Admission:
    """Admits sequences into the decode worker's engine; see the module docstring."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        prepare_matcher: Callable[..., Awaitable[Any]],
        peers: PrefillPeers,
        obs: DecodeTelemetry,
        owner: dict[str, Session],
        transfer: dict[str, tuple[float, str]],
        copies: dict[str, tuple[DeviceCopy, float]],
        finished: Callable[[str, str], stages_pb2.SeqFinished],
        refuse: Callable[[str], None],
        push: PushTarget | None = None,
    ) -> None:
        self.engine_loop = engine_loop
        self.prepare_matcher = prepare_matcher
        self.peers = peers
        self.obs = obs
        # Shared with the service: the session each sequence streams to, each sequence's KV
        # handover (ms, transport) until it finishes, and GPU copies of imported KV (seq id ->
        # the copy, the Admit's arrival on the monotonic clock) until they ran.
        self.owner = owner
        self.transfer = transfer
        self.copies = copies
        self.finished = finished
        self.refuse = refuse
        self.push = push  # None: this worker takes no pushes
        # Sequences whose KV is on its way -> None, or (cancelled) whether to notify.
        self.importing: dict[str, bool | None] = {}
        # Sequences whose grammar is compiling, likewise (they are in no engine yet).
        self.compiling: dict[str, bool | None] = {}
        self.spent_leases = SpentLeases()  # lease tokens admitted, until they expire
        self.transfer_failures = 0
        self.imports_by_transport: dict[str, int] = {}
        self.local_prefills = 0  # sequences admitted with prefill_here
        self.room = RoomWaiters()
        self.block_size = engine_loop.engine.config.block_size

    def joining(self, sid: str, notify: bool) -> bool:
        """Note the cancel of a sequence still on its way in (its KV in transfer, or its grammar
        compiling): `admit` drops it when that ends (a READ may be writing into its blocks).
        False when it is not on its way in."""
        for pending in (self.importing, self.compiling):
            if sid in pending:
                pending[sid] = notify
                return True
        return False

    async def admit(self, msg: stages_pb2.Admit, session: Session) -> None:
        rng = (
            torch.frombuffer(bytearray(msg.rng_state), dtype=torch.uint8) if msg.rng_state else None
        )
        # Copied out of the message once, in C: the lease signs the array's bytes, the engine
        # checks the array and makes the sequence's list.
        ids = np.array(msg.prompt_token_ids, dtype=np.uint32)
        req = _Request(msg, ids, sampling_from_proto(msg.sampling), rng, time.monotonic())
        self.obs.begin(msg)
        if msg.prefill_here:
            await self._prefill_here(req, session)
            return
        if msg.HasField("reservation"):
            await self._admit_pushed(req, session)
            return
        sid = msg.seq_id
        failure = ""
        verified = False  # the caller proved it holds the lease: it is released whatever happens
        source = None
        try:
            peer = await self._verified_peer(req)
            verified = True
            if session.closed:
                return  # the gateway went away meanwhile (the lease is released below)
            session.seqs.add(sid)  # a gateway that goes away meanwhile cancels it too
            self.owner[sid] = session
            if not await self._prepared_matcher(req, session, [msg.first_token]):
                return  # cancelled while its grammar compiled
            fetched = await self._fetch(peer, req, session)
            if fetched is None:
                return  # cancelled while its KV was on the way
            source, reserved = fetched
            joined = [0.0]
            if peer.pool.reads_into_reserved_blocks:
                imported = await asyncio.wrap_future(
                    self.engine_loop.submit(
                        lambda e: self._join(e, peer, source, reserved, req, joined, True)
                    )
                )
            else:
                imported = await self._when_room(
                    req,
                    lambda last: self.engine_loop.submit(
                        lambda e: self._join(e, peer, source, None, req, joined, last)
                    ),
                )
                if imported is None:  # cancelled while it waited
                    self._drop_cancelled(sid, session, bool(self.importing.pop(sid, None)))
                    return
            kind = peer.kind.value if imported else "recompute"
            ended = joined[0]
            if source.pending is not None and imported:
                # A GPU copy: the handover ends when the device has run it (the steps behind it
                # on the stream see the blocks then), not when this loop hears of it.
                await source.pending.wait()
                ended = max(ended, source.pending.passed_at())
                if self.copies.pop(sid, None) is not None and sid in self.transfer:
                    self.transfer[sid] = ((ended - req.t0) * 1e3, kind)
            self.obs.admitted(sid, req.t0, ended, kind, source.blocks_moved if imported else 0)
            if imported:
                self.imports_by_transport[kind] = self.imports_by_transport.get(kind, 0) + 1
        except Exception as e:  # noqa: BLE001 - reported on the stream, the session goes on
            log.warning("admit %s failed: %s", sid, e)
            failure = str(e) or type(e).__name__
            if isinstance(e, TransferError):
                self.transfer_failures += 1
            self._refuse(sid, session, req.t0, e)
        finally:
            # The blocks were copied (or will be recomputed, or never will be: then `failure`
            # tells the prefill side so): it may reuse them.
            if verified:
                if source is not None and source.pending is not None:
                    await source.pending.wait()  # the peer's blocks stay put until it has run
                self._release(msg.prefill_address, msg.kv.lease_id, failure)

    async def _verified_peer(self, req: _Request) -> PrefillPeer:
        """The prefill peer the Admit names, once its lease checks out against the prompt."""
        msg = req.msg
        peer = await self.peers.peer(msg.prefill_address)
        if peer.pool_id != msg.kv.pool_id:
            # The prefill worker restarted since we registered: register again.
            self.peers.forget(msg.prefill_address)
            peer = await self.peers.peer(msg.prefill_address)
            if peer.pool_id != msg.kv.pool_id:
                raise ValueError(
                    f"KV reference names pool {msg.kv.pool_id!r}, unknown at its prefill worker"
                )
        kv = msg.kv
        check_lease(
            peer.lease_key,
            kv.lease_signature,
            kv.pool_id,
            kv.lease_id,
            kv.block_ids,
            kv.num_tokens,
            kv.expires_at,
            req.ids,
            kv.block_names,
        )
        self.spent_leases.take(kv.pool_id, kv.lease_id, kv.expires_at)
        return peer

    async def _fetch(
        self, peer: PrefillPeer, req: _Request, session
    ) -> tuple[BlockSource, tuple[int, list[int]] | None] | None:
        """Ready the blocks: (source, the blocks reserved and read when the transport reads into
        reserved blocks). None when the sequence was cancelled meanwhile (then it is dropped)."""
        sid = req.sid
        self.importing[sid] = None
        reserved = None
        try:
            source = await peer.pool.fetch(req.msg.kv)
            if peer.pool.reads_into_reserved_blocks:
                reserved = await self._read_reserved(source, req)
        finally:
            cancelled = self.importing.pop(sid, None)
        if cancelled is None:
            return source, reserved
        # Cancelled while its KV was on the way: drop it (and the blocks it reserved).
        await asyncio.wrap_future(self.engine_loop.submit(lambda e: e.abort(sid)))
        self._drop_cancelled(sid, session, cancelled)
        return None

    async def _prepared_matcher(self, req: _Request, session, replay: list[int]) -> bool:
        """Prepare a constrained sequence's grammar matcher (`req.matcher`) off the engine
        thread, the grammar compiled within the pool's budgets (their errors are raised). False
        when the sequence was cancelled meanwhile: it is dropped (it is in no engine yet)."""
        if req.params.structured is None:
            return True
        sid = req.sid
        self.compiling[sid] = None
        try:
            req.matcher = await self.prepare_matcher(req.ids, req.params, replay)
        finally:
            cancelled = self.compiling.pop(sid, None)
        if cancelled is None:
            return True
        self._drop_cancelled(sid, session, cancelled)
        return False

    def _drop_cancelled(self, sid: str, session, notify: bool) -> None:
        """Forget a sequence cancelled before it joined; tell the gateway when it asked."""
        session.seqs.discard(sid)
        self.owner.pop(sid, None)
        self.obs.finished(sid, "abort")
        if notify:
            session.out.put_nowait(stages_pb2.DecodeOut(finished=[self.finished(sid, "abort")]))

    async def _when_room(self, req: _Request, attempt: Callable[[bool], Any]) -> Any:
        """`attempt(last)` (a concurrent future of the engine thread) until it gives a result:
        None means this pool had no room and nothing was queued. Meanwhile the sequence waits
        (`self.room`), its KV under its lease at the prefill worker. At the lease's deadline it
        is tried a last time with `last` set (queued to be recomputed here when there is still
        no room). Returns None when it was cancelled while it waited: the cancel stays noted in
        `importing` for the caller."""
        sid = req.sid
        deadline = req.msg.kv.expires_at - LEASE_MARGIN_S
        blocks = -(-(len(req.ids) + 1) // self.block_size)
        owned = sid not in self.importing  # else `_fetch` notes (and takes back) its cancel
        if owned:
            self.importing[sid] = None
        waited = False
        try:
            while True:
                last = time.time() >= deadline
                got = await asyncio.wrap_future(attempt(last))
                if got is not None or last:
                    return got
                if not waited:
                    waited = True
                    self.room.waits += 1
                await self.room.wait(blocks, min(ROOM_POLL_S, deadline - time.time()))
                if self.importing.get(sid) is not None:
                    return None
        finally:
            if owned and self.importing.get(sid) is None:
                self.importing.pop(sid, None)

    async def _read_reserved(
        self, source: BlockSource, req: _Request
    ) -> tuple[int, list[int]] | None:
        """Reserve the sequence's blocks, then fill those its prefix cache lacks with one read
        waited for off the engine thread (the running sequences keep decoding). None when this
        pool has no room: the sequence is then queued and recomputed here, nothing is read."""
        sid, msg = req.sid, req.msg
        peer_blocks = list(msg.kv.block_ids)

        def reserve(e: LLMEngine, last: bool) -> tuple[int, list[int]] | None:
            got = e.reserve_prefilled(
                req.ids,
                msg.first_token,
                req.params,
                sid,
                req.rng,
                peer_blocks,
                tenant=msg.tenant,
                block_names=split_names(msg.kv.block_names),
                matcher=req.matcher,
                queue_when_full=last,
            )
            if got is None and last:
                self.transfer[sid] = ((time.monotonic() - req.t0) * 1e3, "recompute")
            return got

        got = await self._when_room(
            req, lambda last: self.engine_loop.submit(lambda e: reserve(e, last))
        )
        if got is None:
            return None
        first, blocks = got
        src = peer_blocks[first : first + len(blocks)]
        try:
            await asyncio.to_thread(source.read_blocks, src, blocks)
        except BaseException as e:
            if getattr(e, "blocks_safe", True):
                await asyncio.wrap_future(self.engine_loop.submit(lambda en: en.abort(sid)))
            else:
                # The read could not be cancelled: it may still write into these blocks, so
                # they stay out of circulation rather than corrupt another sequence's KV.
                log.error(
                    "a KV read could not be cancelled; %d KV blocks are withheld", len(blocks)
                )
                await asyncio.wrap_future(self.engine_loop.submit(lambda en: en.withhold(sid)))
            raise
        return got

    def _join(
        self,
        e: LLMEngine,
        peer: PrefillPeer,
        source: BlockSource,
        reserved: tuple[int, list[int]] | None,
        req: _Request,
        joined: list[float],
        queue_when_full: bool,
    ) -> bool | None:
        """On the engine thread: the sequence joins the batch with its KV, or is recomputed (the
        pool had no room for it: queued unless `queue_when_full` is False, which returns None
        with nothing done)."""
        sid, msg = req.sid, req.msg
        src_blocks = list(msg.kv.block_ids)
        if peer.pool.reads_into_reserved_blocks:
            imported = reserved is not None and e.start_prefilled(sid)
        else:

            def copy_in(dst_blocks: list[int], first: int = 0) -> None:
                # dst_blocks[j] receives the prompt's block first + j.
                source.read_blocks(src_blocks[first : first + len(dst_blocks)], dst_blocks)

            _, imported = e.admit_prefilled(
                req.ids,
                msg.first_token,
                req.params,
                sid,
                copy_in,
                req.rng,
                tenant=msg.tenant,
                block_names=split_names(msg.kv.block_names),
                matcher=req.matcher,
                queue_when_full=queue_when_full,
            )
            if not imported and not queue_when_full:
                return None
        # Noted on the engine thread, before a step can finish the sequence and report its
        # transfer (a short sequence can finish before the admission resumes), and before a step
        # can start it (the time its KV handover ended).
        joined[0] = time.monotonic()
        kind = peer.kind.value if imported else "recompute"
        self.transfer[sid] = ((joined[0] - req.t0) * 1e3, kind)
        if imported and source.pending is not None:
            # Until the admission sees the copy done and notes the handover's end (should the
            # sequence finish first, the copy's end replaces the host time noted here).
            self.copies[sid] = (source.pending, req.t0)
        return imported

    def _release(self, address: str, lease_id: str, failure: str = "") -> None:
        """Give the lease back to its prefill worker (batched with the others given back
        meanwhile)."""
        p = self.peers.get(address)
        if p is not None and lease_id:
            p.releases.release(lease_id, failure)

    def _refuse(self, sid: str, session, t0: float, e: Exception) -> None:
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

    async def _admit_pushed(self, req: _Request, session) -> None:
        """A sequence whose KV a prefill worker wrote into blocks reserved here: checked (this
        worker's signature over the reservation and the prompt, the writer's proof) and started,
        without a copy. A reservation that checked out is given back on every way out but the
        sequence's start."""
        sid, msg = req.sid, req.msg
        res = msg.reservation
        token = ""  # set once the reservation checked out: given back unless the sequence starts
        written = False  # the writer's proof checked out: no write into the blocks can follow
        try:
            push = self.push
            if push is None:
                raise ValueError(
                    "this decode worker takes no pushed KV (--kv-reservation-ttl 0): admit the "
                    "sequence with a lease"
                )
            if res.pool_id != push.pool_id:
                raise ValueError(
                    f"the reservation names pool {res.pool_id!r}, not this worker's "
                    f"({push.pool_id!r}): it restarted since Reserve"
                )
            # Signed by this worker; its prompt is the one the engine compares at
            # `admit_reserved`, so the check hashes no ids.
            check_reservation(
                push.key, res, sid, req.ids, push.block_size, time.time(), prompt_compared=True
            )
            token = res.token
            check_push_proof(push.key, res, msg.push_proof)
            written = True
            if session.closed:
                return  # the gateway went away meanwhile (the reservation is given back below)
            session.seqs.add(sid)
            self.owner[sid] = session
            if not await self._prepared_matcher(req, session, [msg.first_token]):
                return  # cancelled while its grammar compiled

            def join(e: LLMEngine) -> float:
                e.admit_reserved(
                    sid, res.token, req.ids, msg.first_token, req.params, req.rng, req.matcher
                )
                # Noted on the engine thread, before a step can finish the sequence and
                # report its handover.
                joined = time.monotonic()
                self.transfer[sid] = ((joined - req.t0) * 1e3, push.kind)
                return joined

            ended = await asyncio.wrap_future(self.engine_loop.submit(join))
            token = ""  # the sequence owns the blocks now
            self.obs.admitted(sid, req.t0, ended, push.kind, len(res.block_ids))
            self.imports_by_transport[push.kind] = self.imports_by_transport.get(push.kind, 0) + 1
        except Exception as e:  # noqa: BLE001 - reported on the stream, the session goes on
            log.warning("admit %s (pushed KV) failed: %s", sid, e)
            self._refuse(sid, session, req.t0, e)
        finally:
            if token:
                # The write done, the blocks return now; without its proof a write may still
                # come, and they return at the reservation's expiry. One the engine refused is
                # already back (False here).
                self.engine_loop.submit(lambda e: e.unreserve(token, not written))

    async def _prefill_here(self, req: _Request, session) -> None:
        """Conditional disaggregation: this worker prefills the prompt itself (no KV transfer),
        computing only what its prefix cache lacks, in chunks mixed with its decodes."""
        sid = req.sid
        if session.closed:
            return
        session.seqs.add(sid)
        self.owner[sid] = session
        try:
            if not await self._prepared_matcher(req, session, []):
                return  # cancelled while its grammar compiled
            await asyncio.wrap_future(
                self.engine_loop.submit(
                    lambda e: e.add_request(
                        req.ids, req.params, sid, tenant=req.msg.tenant, matcher=req.matcher
                    )
                )
            )
        except Exception as e:  # noqa: BLE001 - reported on the stream, the session goes on
            log.warning("admit %s (prefill here) failed: %s", sid, e)
            self._refuse(sid, session, req.t0, e)
            return
        self.local_prefills += 1
        self.transfer[sid] = (0.0, "none")
        self.obs.prefill_here(sid, req.t0)
