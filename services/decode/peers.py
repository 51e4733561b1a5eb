"""The decode worker's prefill peers: registered once each, their pool handles opened once.

Only the prefill workers named at start (`--prefill`) are peers: an Admit naming another address
is refused, never dialled. Registration asks for the KV transports the configuration allows,
preferred first (tandem.kv.transports.accept_kinds); under `auto`, a handle that cannot be
opened here (a GPU this process cannot see, NIXL that does not load) is dropped from the kinds
asked for, with a warning, and registration retried. Registration also offers this worker's own
pool for pushes (`push_pool`, when it lives in shared memory); a peer that mapped it says so
(`PrefillPeer.push`) and may then be handed reservations to write into.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from tandem import progress
from tandem.kv import transports
from tandem.kv.cache import KVCache
from tandem.kv.layout import PoolLayout, host_id
from tandem.kv.lease import lease_key
from tandem.kv.transports import KVTransport, PeerLink, PeerPool, TransportKind
from tandem.rpc import stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import StageCredentials, stage_channel, unreachable_hint
from tandem.rpc.convert import layout_to_proto
from tandem.rpc.lease import ReleaseBatcher
from tandem.rpc.limits import fetch_channel_options

log = logging.getLogger("tandem.decode")


@dataclass
class PrefillPeer:
    """A registered prefill worker: its pool handle, opened once."""

    address: str
    channel: grpc.aio.Channel
    stub: stages_pb2_grpc.PrefillStub
    pool: PeerPool
    pool_id: str = ""
    lease_key: bytes = b""  # checks the signatures of the peer's leases (`_lease_key`)
    layout: PoolLayout | None = None
    push: bool = False  # it mapped this worker's pool and writes reserved KV into it
    releases: ReleaseBatcher = field(init=False)  # its leases given back, in batches

    def __post_init__(self) -> None:
        self.releases = ReleaseBatcher(self.stub, f"prefill {self.address}")

    @property
    def kind(self) -> TransportKind:
        return self.pool.kind

    def close(self) -> None:
        self.pool.close()


class _HandleUnusable(Exception):
    """The pool handle a prefill worker offered cannot be opened here."""

    def __init__(self, kind: TransportKind, cause: Exception) -> None:
        super().__init__(f"{kind}: {cause}")
        self.kind = kind
        self.cause = cause


class PrefillPeers:
    """Registers with prefill workers and keeps what each offered."""

    def __init__(
        self,
        kv: KVCache,
        *,
        kv_transport: str,
        peer_id: str,
        model_name: str,
        addresses: list[str],
        stage_credentials: StageCredentials | None,
        transfer_timeout_s: float,
        push_pool: stages_pb2.PoolHandle | None = None,
        reservation_key: bytes = b"",
    ) -> None:
        """`push_pool`: this worker's pool handle, offered to each peer for pushes (None: no
        pushes); `reservation_key`: the key of its reservations, sent with it only when this
        worker has no stage secret (its peers cannot derive it then)."""
        transports.check_requested(kv_transport)  # fails at start-up, saying why
        self.kv_transport = kv_transport
        self.layout = PoolLayout.of(kv)
        self.peer_id = peer_id
        self.model_name = model_name
        self.addresses = set(addresses)
        self.stage_credentials = stage_credentials or StageCredentials()
        self.kinds = transports.accept_kinds(
            kv_transport, kv.data.device.type, transports.nixl_usable(kv_transport)
        )
        if TransportKind.NIXL not in self.kinds and len(self.kinds) > 1:
            log.info(
                "NIXL is not installed: KV from a prefill worker on another host will travel "
                "inline over gRPC (pip install 'tandem[nixl]' for NIXL)"
            )
        self.transports: dict[TransportKind, KVTransport] = {
            kind: transports.create(kind, kv, name=peer_id, timeout_s=transfer_timeout_s)
            for kind in self.kinds
        }
        self.push_pool = push_pool
        self.reservation_key = reservation_key
        self.peers: dict[str, PrefillPeer] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def __len__(self) -> int:
        return len(self.peers)

    def close(self) -> None:
        for p in self.peers.values():
            p.close()
        for t in self.transports.values():
            t.close()

    def forget(self, address: str) -> None:
        p = self.peers.pop(address, None)
        if p is not None:
            p.close()

    def get(self, address: str) -> PrefillPeer | None:
        return self.peers.get(address)

    async def peer(self, address: str) -> PrefillPeer:
        """The registered prefill peer at `address`, registering (once) on first use."""
        p = self.peers.get(address)
        if p is not None:
            return p
        if address not in self.addresses:
            known = ", ".join(sorted(self.addresses)) or "none: start it with --prefill"
            raise ValueError(
                f"prefill_address {address!r} is not a prefill peer of this decode worker "
                f"(its peers: {known})"
            )
        async with self._locks.setdefault(address, asyncio.Lock()):
            if address in self.peers:
                return self.peers[address]
            ch = stage_channel(
                address,
                self.stage_credentials,
                [
                    ("grpc.use_local_subchannel_pool", 1),
                    ("grpc.initial_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 2000),
                    *fetch_channel_options(self.layout.block_bytes),
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
        kinds = list(self.kinds)
        while True:
            try:
                return await self._register_once(address, ch, stub, kinds)
            except _HandleUnusable as e:
                if not transports.can_fall_back(self.kv_transport, e.kind):
                    raise e.cause from None
                log.warning(
                    "cannot use the %s KV transport with prefill %s (%s); trying the next one",
                    e.kind,
                    address,
                    e.cause,
                )
                kinds = [k for k in kinds if k is not e.kind]

    def _request(self, kinds: list[TransportKind]) -> stages_pb2.RegisterRequest:
        req = stages_pb2.RegisterRequest(
            peer_id=self.peer_id,
            layout=layout_to_proto(self.layout),
            accept=[k.wire for k in kinds],
            accept_kinds=[k.value for k in kinds],
            host_id=host_id(),
            model=self.model_name,
        )
        for k in kinds:
            self.transports[k].offer(req)
        if self.push_pool is not None:
            req.push_pool.CopyFrom(self.push_pool)
            if not self.stage_credentials.secret:
                req.reservation_key = self.reservation_key
        return req

    async def _register_once(self, address: str, ch, stub, kinds) -> PrefillPeer:
        req = self._request(kinds)
        resp = await stub.Register(req, timeout=10)
        layout = PoolLayout.from_proto(resp.handle.layout)
        self.layout.check_compatible(layout)
        kind = transports.handle_kind(resp.handle)
        if kind not in kinds:
            raise RuntimeError(
                f"prefill {address} offered transport {kind.value!r}, wanted "
                f"{[k.value for k in kinds]}"
            )

        async def register_again():
            return (await stub.Register(self._request(kinds), timeout=10)).handle

        link = PeerLink(address, req, resp.handle, layout, stub, register_again)
        try:
            pool = await self.transports[kind].open(link)
        except Exception as e:  # noqa: BLE001 - the caller decides: fall back or fail
            raise _HandleUnusable(kind, e) from e
        key = self._lease_key(address, resp)
        return PrefillPeer(
            address, ch, stub, pool, link.handle.pool_id, key, layout, push=resp.push
        )

    def _lease_key(self, address: str, resp: stages_pb2.RegisterResponse) -> bytes:
        """The key of the peer's lease signatures: derived from the stage secret both workers
        hold, or the one a prefill worker without a stage secret (its port open) sent."""
        if resp.lease_key:
            return resp.lease_key
        if not self.stage_credentials.secret:
            raise ConnectionError(
                f"prefill {address} derives its lease key from the stage secret, which this "
                "worker lacks: give every worker the same TANDEM_STAGE_SECRET"
            )
        return lease_key(self.stage_credentials.secret, resp.handle.pool_id)

    async def register_at_start(self, address: str, wait_s: float) -> None:
        """Register with a prefill worker named at start, waiting quietly while it starts itself;
        a worker that does not answer within `wait_s`, or refuses, stops this one with one line."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        progress.report(f"waiting for prefill {address}")
        told = None  # a TLS mismatch is said once, not at every retry
        while True:
            try:
                await self.peer(address)
                progress.report(f"registered with prefill {address}")
                return
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise ConnectionError(
                        f"registration with prefill {address} failed: "
                        f"{e.code().name}: {e.details()}"
                    ) from None
                hint = unreachable_hint(
                    e.details() or "", self.stage_credentials.tls_root is not None
                )
                if hint is not None and hint != told:
                    log.warning("prefill worker %s is unreachable: %s", address, hint)
                    told = hint
                if loop.time() > deadline:
                    raise ConnectionError(
                        f"prefill worker {address} did not answer within {wait_s:.0f}s "
                        f"(--prefill-wait): {hint or 'is it running?'}"
                    ) from None
            await asyncio.sleep(0.5)
