"""KV transports: choosing one, the protocol end to end (shm, inline, the fake), the wire kind,
NIXL reads between two agents, and CUDA IPC's refusals on CPU."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import torch

from tandem.kv import transports
from tandem.kv.cache import KVCache
from tandem.kv.layout import PoolLayout
from tandem.kv.transports import PeerLink, PeerRequest, TransferError, TransportKind, cuda_ipc
from tandem.kv.transports.fake import FakeTransport
from tandem.kv.transports.inline import InlineTransport, block_to_bytes
from tandem.kv.transports.shm import SharedPool, ShmTransport
from tandem.rpc import stages_pb2
from tests.nixl_checks import nixl_missing_in_child

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_missing = nixl_missing_in_child()
needs_nixl = pytest.mark.skipif(
    # CI installs the extra (make install): there a missing NIXL fails the tests instead.
    _missing is not None and not os.environ.get("CI"),
    reason=f"NIXL is not usable here: {_missing}",
)


@pytest.mark.parametrize(
    "requested, device, nixl, expected",
    [
        ("auto", "cpu", True, ["shm", "nixl", "inline"]),
        ("auto", "cuda", True, ["cuda_ipc", "shm", "nixl", "inline"]),
        ("auto", "cpu", False, ["shm", "inline"]),
        ("nixl", "cpu", True, ["nixl"]),
        ("inline", "cuda", True, ["inline"]),
    ],
)
def test_accept_kinds(requested, device, nixl, expected):
    kinds = transports.accept_kinds(requested, device, nixl)
    assert [TransportKind(k) for k in expected] == kinds


def test_accept_kinds_refuses_unknown_transport():
    with pytest.raises(ValueError, match="unknown KV transport 'rdma'"):
        transports.accept_kinds("rdma", "cpu", True)
    with pytest.raises(ValueError, match="unknown KV transport 'rdma'"):
        transports.check_requested("rdma")


def _owner(device: str = "cpu", shm: bool = True, nixl_missing=None, asked=None):
    """A prefill worker's transports: its pool on `device`, in shared memory or not."""
    kv = KVCache.allocate(2, 4, 4, 2, 8, torch.float32, "cpu")

    def missing():
        asked.append(True)
        return nixl_missing

    out = {
        kind: transports.create(
            kind, kv, name="owner", shared=object() if shm else None, nixl_missing=missing
        )
        for kind in TransportKind
    }
    out[TransportKind.CUDA_IPC].pool_device_type = device
    return out


def _pick(accept, same_host, device="cpu", shm=True, nixl_missing=None):
    asked: list[bool] = []
    owned = _owner(device, shm, nixl_missing, asked)
    peer = PeerRequest("decode-1", same_host)
    t, reasons = transports.pick([TransportKind(k) for k in accept], owned, peer)
    return (None if t is None else t.kind), reasons, bool(asked)


def test_auto_picks_shared_memory_on_one_host_without_loading_nixl():
    kind, _, asked = _pick(["shm", "nixl", "inline"], same_host=True)
    assert kind == "shm" and not asked
    kind, _, asked = _pick(
        ["cuda_ipc", "shm", "nixl", "inline"], same_host=True, device="cuda", shm=False
    )
    assert kind == "cuda_ipc" and not asked


def test_auto_picks_nixl_between_hosts_and_inline_without_it():
    assert _pick(["shm", "nixl", "inline"], same_host=False)[0] == "nixl"
    kind, _, _ = _pick(["shm", "nixl", "inline"], same_host=False, nixl_missing="not installed")
    assert kind == "inline"
    # A GPU prefill and a CPU decode on one host: no shared pool, NIXL moves VRAM to DRAM.
    kind, _, _ = _pick(["shm", "nixl", "inline"], same_host=True, device="cuda", shm=False)
    assert kind == "nixl"


def test_explicit_transport_that_cannot_work_says_why():
    kind, reasons, _ = _pick(["shm"], same_host=False)
    assert kind is None and reasons == ["shm: prefill and decode are on different hosts"]
    kind, reasons, _ = _pick(["cuda_ipc"], same_host=True, device="cpu")
    assert kind is None and "not on a GPU" in reasons[0]
    kind, reasons, _ = _pick(["nixl"], same_host=False, nixl_missing="NIXL is not installed")
    assert kind is None and "NIXL is not installed" in reasons[0]


@needs_nixl
@pytest.mark.parametrize(
    "check",
    [
        "plugin_dir_points_into_the_installed_package",
        "read_copies_exactly_the_listed_blocks:float32",
        "read_copies_exactly_the_listed_blocks:float8_e4m3fn",
        "refuses_a_peer_with_another_layout",
    ],
)
def test_nixl(check):
    """Each NIXL check runs in a child process (tests/nixl_checks.py says why)."""
    name, _, arg = check.partition(":")
    code = f"import tests.nixl_checks as c; c.{name}(*{[arg] if arg else []!r})"
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_cuda_ipc_refuses_cpu_pools_clearly():
    kv = KVCache.allocate(2, 4, 4, 2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="only a KV pool on a GPU"):
        cuda_ipc.export_pool(kv)
    if not torch.cuda.is_available():
        with pytest.raises(cuda_ipc.CudaIpcUnavailable, match="needs CUDA"):
            cuda_ipc.open_pool(b"{}", PoolLayout.of(kv), "GPU-0")
        assert cuda_ipc.device_uuid() == ""


def test_block_runs_merge_blocks_adjacent_in_both_pools_in_any_order():
    # Imported here without loading NIXL itself (tests/nixl_checks.py says why that matters).
    from tandem.kv.block_copy import block_runs

    src, dst, n = block_runs([12, 11, 10, 3, 4, 7, 8], [2, 1, 0, 5, 6, 9, 20])
    # 10-12 -> 0-2 (listed backwards), 3-4 -> 5-6, then 7 -> 9 and 8 -> 20 do not line up.
    assert src.tolist() == [3, 7, 8, 10] and dst.tolist() == [5, 9, 20, 0]
    assert n.tolist() == [2, 1, 1, 3]
    src, dst, n = block_runs(list(range(512))[::-1], list(range(100, 612))[::-1])
    assert (src.tolist(), dst.tolist(), n.tolist()) == ([0], [100], [512])
    assert block_runs([], [])[2].size == 0


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=["f32", "int8"])
@pytest.mark.parametrize(
    "src, dst",
    [
        (list(range(3, 19)), list(range(20, 36))),  # one run: slice copies, no temporary
        ([9, 8, 7, 2, 3], [4, 3, 2, 30, 31]),  # two runs listed backwards
        ([5, 17, 2, 30, 11, 23, 8, 1, 27, 14], [0, 9, 3, 21, 6, 12, 30, 18, 24, 15]),  # scattered
    ],
)
def test_gather_copy_equals_block_by_block(kv_dtype, src, dst):
    from tandem.kv.block_copy import gather_copy

    g = torch.Generator().manual_seed(len(src))
    a = KVCache.allocate(3, 40, 4, 2, 8, kv_dtype, "cpu")
    b = KVCache.allocate(3, 40, 4, 2, 8, kv_dtype, "cpu")
    for kv in (a, b):
        kv.data.view(torch.uint8).copy_(
            torch.randint(0, 120, kv.data.view(torch.uint8).shape, generator=g)
        )
        if kv.scales is not None:
            kv.scales.copy_(torch.rand(kv.scales.shape, generator=g))
    expect = b.data.clone()
    expect_scales = None if b.scales is None else b.scales.clone()
    for s, d in zip(src, dst, strict=True):
        expect[:, :, d] = a.data[:, :, s]
        if expect_scales is not None:
            expect_scales[:, :, d] = a.scales[:, :, s]
    gather_copy(b, dst, a, src)
    assert torch.equal(b.data.view(torch.uint8), expect.view(torch.uint8))
    if expect_scales is not None:
        assert torch.equal(b.scales, expect_scales)


def _filled(blocks: int, seed: int, dtype=torch.float32) -> KVCache:
    kv = KVCache.allocate(2, blocks, 4, 2, 8, dtype, "cpu")
    g = torch.Generator().manual_seed(seed)
    kv.data.view(torch.uint8).copy_(
        torch.randint(0, 120, kv.data.view(torch.uint8).shape, generator=g)
    )
    return kv


def _expected(dst: KVCache, src: KVCache, src_ids, dst_ids) -> torch.Tensor:
    out = dst.data.clone()
    for s, d in zip(src_ids, dst_ids, strict=True):
        out[:, :, d] = src.data[:, :, s]
    return out


async def _register(owner, reader, *, same_host=True, stub=None) -> tuple:
    """One registration through the protocol: the owner exports, the reader opens."""
    peer = PeerRequest("decode-1", same_host)
    assert owner.unavailable(peer) is None
    handle = stages_pb2.PoolHandle(pool_id="prefill-test")
    transports.set_handle_kind(handle, owner.kind)
    await owner.export(handle, peer)
    req = stages_pb2.RegisterRequest()
    reader.offer(req)
    layout = PoolLayout.of(owner.kv)

    async def again():
        return handle

    pool = await reader.open(PeerLink("prefill:1", req, handle, layout, stub, again))
    assert pool.kind is transports.handle_kind(handle) is owner.kind
    return handle, pool


def test_shm_transport_reads_exactly_the_listed_blocks():
    layout = PoolLayout(2, 10, 4, 2, 8, "float32")
    shared = SharedPool.create(layout)
    try:
        shared.kv.data.copy_(_filled(10, 1).data)
        mine = _filled(7, 2)
        src_ids, dst_ids = [9, 2, 3, 5], [0, 6, 1, 4]
        want = _expected(mine, shared.kv, src_ids, dst_ids)

        async def go():
            _, pool = await _register(ShmTransport(shared.kv, shared), ShmTransport(mine))
            assert not pool.reads_into_reserved_blocks
            source = await pool.fetch(stages_pb2.KvRef(block_ids=src_ids))
            source.read_blocks(src_ids[:2], dst_ids[:2])
            source.read_blocks(src_ids[2:], dst_ids[2:])
            pool.close()
            return source.blocks_moved

        assert asyncio.run(go()) == 4
        assert torch.equal(mine.data, want)
    finally:
        shared.close()


def test_shm_is_refused_between_hosts_and_for_gpu_pools():
    kv = _filled(4, 0)
    assert "different hosts" in ShmTransport(kv, object()).unavailable(PeerRequest("d", False))
    assert "not in shared memory" in ShmTransport(kv, None).unavailable(PeerRequest("d", True))


class _FetchStub:
    """Prefill.FetchBlocks of a pool, in process."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv

    async def FetchBlocks(self, request, timeout=None):
        for i, b in enumerate(request.kv.block_ids):
            yield stages_pb2.BlockBytes(index=i, data=block_to_bytes(self.kv, b))


def test_inline_transport_fetches_whole_and_copies_what_is_asked():
    theirs, mine = _filled(10, 3), _filled(8, 4)
    block_ids = [4, 7, 1, 8]  # the lease's blocks, in prompt order
    # The reader's prefix cache held the first block: only the rest are copied.
    want = _expected(mine, theirs, block_ids[1:], [2, 5, 0])

    async def go():
        _, pool = await _register(
            InlineTransport(theirs), InlineTransport(mine), same_host=False, stub=_FetchStub(theirs)
        )
        source = await pool.fetch(stages_pb2.KvRef(block_ids=block_ids))
        source.read_blocks(block_ids[1:], [2, 5, 0])
        return source.blocks_moved

    assert asyncio.run(go()) == 4  # fetched whole, whatever the cache held
    assert torch.equal(mine.data, want)


def test_fake_transport_records_reads_and_fails_like_a_network():
    theirs, mine = _filled(6, 5), _filled(6, 6)
    reader = FakeTransport(mine)
    want = _expected(mine, theirs, [5, 0], [1, 2])

    async def go():
        _, pool = await _register(FakeTransport(theirs), reader)
        source = await pool.fetch(stages_pb2.KvRef(block_ids=[5, 0]))
        source.read_blocks([5, 0], [1, 2])
        reader.fail_reads = TransferError("link down")
        with pytest.raises(TransferError, match="link down"):
            source.read_blocks([1], [3])

    asyncio.run(go())
    assert reader.reads == [([5, 0], [1, 2])]
    assert torch.equal(mine.data, want)
    assert FakeTransport(theirs, refuse="no fabric").unavailable(PeerRequest("d", True))


def test_pool_handle_kind_travels_as_enum_and_as_name_for_older_peers():
    for kind in TransportKind:
        h = stages_pb2.PoolHandle()
        transports.set_handle_kind(h, kind)
        assert h.kind == kind.value and h.transport == kind.wire
        back = stages_pb2.PoolHandle.FromString(h.SerializeToString())
        assert transports.handle_kind(back) is kind
        # A peer that only writes the name (the field it has always had).
        assert transports.handle_kind(stages_pb2.PoolHandle(kind=kind.value)) is kind
        assert stages_pb2.KvTransport.Name(kind.wire) == "KV_TRANSPORT_" + kind.name
    with pytest.raises(ValueError, match="unknown KV transport 'rdma'"):
        transports.handle_kind(stages_pb2.PoolHandle(kind="rdma"))


def test_registration_accepts_enum_list_or_names_of_older_peers():
    new = stages_pb2.RegisterRequest(accept=[TransportKind.SHM.wire, TransportKind.INLINE.wire])
    assert transports.accepted_by(new) == ([TransportKind.SHM, TransportKind.INLINE], [])
    old = stages_pb2.RegisterRequest(accept_kinds=["nixl", "rdma"])
    assert transports.accepted_by(old) == ([TransportKind.NIXL], ["rdma: unknown transport"])
    assert transports.accepted_by(stages_pb2.RegisterRequest()) == ([TransportKind.INLINE], [])
