"""The prefill worker's map of decode pools it pushes into (services/prefill/push.py): which
offers it maps and why it refuses the others, the write (checked against the blocks it copies),
and mappings dropped once their owner ended."""

from __future__ import annotations

import torch

from services.prefill.push import PushTargets
from tandem.kv.layout import PoolLayout
from tandem.kv.reservation import reservation_key
from tandem.kv.transports import PeerRequest, TransportKind, set_handle_kind
from tandem.kv.transports.shm import SharedPool
from tandem.rpc import stages_pb2
from tandem.rpc.convert import layout_to_proto

LAYOUT = PoolLayout(2, 8, 4, 2, 8, "float32")
HERE = PeerRequest(peer_id="d", same_host=True)


def _offer(pool: SharedPool, pool_id: str = "decode-1", kind=TransportKind.SHM, key=b""):
    handle = stages_pb2.PoolHandle(
        pool_id=pool_id, layout=layout_to_proto(pool.layout), shm_name=pool.name
    )
    set_handle_kind(handle, kind)
    return stages_pb2.RegisterRequest(peer_id="d", push_pool=handle, reservation_key=key)


def test_maps_a_shared_pool_and_writes_into_it():
    own, decode = SharedPool.create(LAYOUT), SharedPool.create(LAYOUT)
    try:
        targets = PushTargets(own.kv, LAYOUT, b"secret")
        assert targets.map(_offer(decode), HERE)
        pool = targets.get("decode-1")
        assert pool.key == reservation_key(b"secret", "decode-1")
        own.kv.data.copy_(torch.randn(own.kv.data.shape))
        before = decode.kv.data.clone()
        targets.write(pool, [5, 2, 3], [0, 1, 7])
        for d, s in ((5, 0), (2, 1), (3, 7)):
            assert torch.equal(decode.kv.data[:, :, d], own.kv.data[:, :, s])
        untouched = [b for b in range(LAYOUT.num_blocks) if b not in (5, 2, 3)]
        assert torch.equal(decode.kv.data[:, :, untouched], before[:, :, untouched])
        targets.close()
    finally:
        own.close()
        decode.close()


def test_refuses_what_it_cannot_write():
    own, decode = SharedPool.create(LAYOUT), SharedPool.create(LAYOUT)
    try:
        with_secret = PushTargets(own.kv, LAYOUT, b"secret")
        assert not with_secret.map(stages_pb2.RegisterRequest(peer_id="d"), HERE)  # no offer
        assert not with_secret.map(_offer(decode), PeerRequest(peer_id="d", same_host=False))
        assert not with_secret.map(_offer(decode, kind=TransportKind.CUDA_IPC), HERE)  # CPU pool
        other = PoolLayout(2, 8, 4, 2, 16, "float32")
        bad = _offer(decode)
        bad.push_pool.layout.CopyFrom(layout_to_proto(other))
        assert not with_secret.map(bad, HERE)  # another head_dim
        # Without a stage secret it needs the decode worker's key, sent with the offer.
        open_port = PushTargets(own.kv, LAYOUT, None)
        assert not open_port.map(_offer(decode), HERE)
        assert open_port.map(_offer(decode, key=b"k" * 32), HERE)
        assert open_port.get("decode-1").key == b"k" * 32
        assert with_secret.pools == {}
        open_port.close()
    finally:
        own.close()
        decode.close()


def test_drops_the_pool_of_a_decode_worker_that_ended():
    own, decode, later = (SharedPool.create(LAYOUT) for _ in range(3))
    try:
        targets = PushTargets(own.kv, LAYOUT, b"secret")
        assert targets.map(_offer(decode, "decode-1"), HERE)
        decode.close()  # its owner unlinks the segment
        assert targets.map(_offer(later, "decode-2"), HERE)  # the next registration sweeps
        assert set(targets.pools) == {"decode-2"}
        targets.close()
    finally:
        own.close()
        later.close()
