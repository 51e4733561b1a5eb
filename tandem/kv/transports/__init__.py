"""KV transports: one protocol (`base.KVTransport`), one module per kind, and the choice among them.

- `shm`: CPU pools of one host, in named shared memory;
- `cuda_ipc`: GPU pools of one host (or peer GPUs), through CUDA IPC;
- `nixl`: between hosts, one NIXL READ per request;
- `inline`: block bytes over gRPC, the portable fallback;
- `fake`: pools of one process, for tests.

A worker builds the transports its configuration allows (`create`); a decode worker asks for
them in order of preference (`accept_kinds`) and the prefill worker serves the first it can
(`pick`). Nothing outside this package needs to know which kind is which.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tandem.kv.cache import KVCache
from tandem.kv.transports.base import (
    BlockSource,
    KVTransport,
    PeerLink,
    PeerPool,
    PeerRequest,
    TransferError,
    TransportKind,
    handle_kind,
    set_handle_kind,
)

__all__ = [
    "AUTO",
    "TRANSPORTS",
    "BlockSource",
    "KVTransport",
    "PeerLink",
    "PeerPool",
    "PeerRequest",
    "TransferError",
    "TransportKind",
    "accept_kinds",
    "accepted_by",
    "can_fall_back",
    "check_requested",
    "create",
    "handle_kind",
    "nixl_usable",
    "pick",
    "set_handle_kind",
]

AUTO = "auto"
TRANSPORTS = (AUTO, *(k.value for k in TransportKind))


def check_requested(requested: str) -> None:
    """Refuse, at start-up, a `--kv-transport` that is unknown or cannot work here."""
    if requested not in TRANSPORTS:
        raise ValueError(
            f"unknown KV transport {requested!r} (choose from {', '.join(TRANSPORTS)})"
        )
    if requested == TransportKind.NIXL.value and not _nixl_installed():
        raise ValueError("--kv-transport nixl: NIXL is not installed (pip install 'tandem[nixl]')")


def nixl_usable(requested: str) -> bool:
    """Whether a reader configured with `requested` may use NIXL (installed and allowed)."""
    return requested in (AUTO, TransportKind.NIXL.value) and _nixl_installed()


def _nixl_installed() -> bool:
    from tandem.kv.transports.nixl import nixl_installed

    return nixl_installed()


def accept_kinds(requested: str, device_type: str, nixl_usable: bool) -> list[TransportKind]:
    """The pool-handle kinds a decode worker asks for at registration, preferred first.

    `auto`: CUDA IPC (GPU pool) or shared memory when the prefill worker turns out to share this
    host, NIXL otherwise, and inline only when NIXL cannot be used here. Any other value asks
    for exactly that kind (registration fails, saying why, when the prefill cannot serve it).
    """
    if requested not in TRANSPORTS:
        raise ValueError(
            f"unknown KV transport {requested!r} (choose from {', '.join(TRANSPORTS)})"
        )
    if requested != AUTO:
        return [TransportKind(requested)]
    kinds = [TransportKind.CUDA_IPC] if device_type == "cuda" else []
    kinds.append(TransportKind.SHM)
    if nixl_usable:
        kinds.append(TransportKind.NIXL)
    return [*kinds, TransportKind.INLINE]


def can_fall_back(requested: str, failed: TransportKind) -> bool:
    """Whether a reader configured with `requested` may try the next kind after `failed` could
    not be opened (only under `auto`, and never past inline, the last resort)."""
    return requested == AUTO and failed is not TransportKind.INLINE


def accepted_by(request: Any) -> tuple[list[TransportKind], list[str]]:
    """The kinds a stages_pb2.RegisterRequest accepts, preferred first (the enum list, or the
    names an older peer sent; inline when it names none), and a reason for each unknown one."""
    kinds, unknown = [], []
    if request.accept:
        for number in request.accept:
            try:
                kinds.append(TransportKind.from_wire(number))
            except ValueError as e:
                unknown.append(str(e))
        return kinds, unknown
    for name in request.accept_kinds or [TransportKind.INLINE.value]:
        try:
            kinds.append(TransportKind(name))
        except ValueError:
            unknown.append(f"{name}: unknown transport")
    return kinds, unknown


def pick(
    accept: Iterable[TransportKind], transports: Mapping[TransportKind, KVTransport], peer
) -> tuple[KVTransport | None, list[str]]:
    """The first transport of `accept` this pool's owner can serve to `peer`, or None, with
    the reason each kind before it was passed over. Kinds are asked in order, so a costly check
    (loading NIXL) runs only when every better kind failed."""
    reasons = []
    for kind in accept:
        t = transports.get(kind)
        why = "not offered by the prefill worker" if t is None else t.unavailable(peer)
        if why is None:
            return t, reasons
        reasons.append(f"{kind.value}: {why}")
    return None, reasons


def create(
    kind: TransportKind,
    kv: KVCache,
    *,
    name: str = "",
    shared: Any = None,
    timeout_s: float = 10.0,
    nixl_missing: Callable[[], str | None] | None = None,
) -> KVTransport:
    """The transport of `kind` for a worker whose pool is `kv`: `name` names its NIXL agent,
    `shared` is its shm.SharedPool (an owner whose pool lives in shared memory), `timeout_s`
    bounds a NIXL read."""
    if kind is TransportKind.SHM:
        from tandem.kv.transports.shm import ShmTransport

        return ShmTransport(kv, shared)
    if kind is TransportKind.CUDA_IPC:
        from tandem.kv.transports.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(kv)
    if kind is TransportKind.NIXL:
        from tandem.kv.transports.nixl import NixlTransport, nixl_missing_reason

        return NixlTransport(kv, name, timeout_s, nixl_missing or nixl_missing_reason)
    from tandem.kv.transports.inline import InlineTransport

    return InlineTransport(kv)
