"""Leases as capabilities: unguessable tokens, and signatures that bind blocks to tokens."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tandem.kv.block_pool import BlockPool
from tandem.kv.lease import LeaseRefused, LeaseTable, SpentLeases, check_lease, sign_lease

KEY = b"k" * 32
ARGS = ("pool-a", "tok", [3, 4, 5], 40, 2e9, list(range(40)))


def test_tokens_are_unguessable_and_name_only_their_lease():
    pool = BlockPool(8)
    table = LeaseTable(pool, ttl_s=30)
    a = table.grant(pool.allocate(2), 20, name="req-1", token_ids=list(range(20)))
    b = table.grant(pool.allocate(1), 10, name="req-2", token_ids=list(range(10)))
    assert len(a.token) >= 32 and a.token != b.token
    assert table.get(a.token) is a and table.get("req-1") is None and table.get("") is None
    assert not table.release_token("req-1")  # the request id is no capability
    assert table.release_token(a.token) and not table.release_token(a.token)
    assert pool.num_used == 1 and table.get(b.token) is b
    assert table.release("req-2") and table.get(b.token) is None and pool.num_used == 0


def test_a_signature_checks_only_what_was_signed():
    sig = sign_lease(KEY, *ARGS)
    check_lease(KEY, sig, *ARGS, now=1e9)
    pool_id, token, blocks, n, expires, ids = ARGS
    altered = [
        ("pool-b", token, blocks, n, expires, ids),
        (pool_id, "other", blocks, n, expires, ids),
        (pool_id, token, [3, 4, 6], n, expires, ids),
        (pool_id, token, blocks, 39, expires, ids),
        (pool_id, token, blocks, n, expires + 1, ids),
        (pool_id, token, blocks, n, expires, [7] * 40),
    ]
    for args in altered:
        with pytest.raises(LeaseRefused, match="signature does not match"):
            check_lease(KEY, sig, *args, now=1e9)
    with pytest.raises(LeaseRefused, match="signature does not match"):
        check_lease(b"x" * 32, sig, *ARGS, now=1e9)
    with pytest.raises(LeaseRefused, match="no lease token or signature"):
        check_lease(KEY, b"", *ARGS, now=1e9)
    with pytest.raises(LeaseRefused, match="expired"):
        check_lease(KEY, sig, *ARGS, now=time.time() + 3e9)


def test_a_uint32_array_of_the_prompt_checks_as_its_list_does():
    """The decode worker checks a lease against the prompt as a uint32 array: the same
    signature as the list the prefill worker signed, refused for any other prompt."""
    pool_id, token, blocks, n, expires, _ = ARGS
    ids = [0, 1, 49151, 2**32 - 1] + list(range(4000, 4036))
    sig = sign_lease(KEY, pool_id, token, blocks, n, expires, ids)
    as_array = np.array(ids, dtype=np.uint32)
    check_lease(KEY, sig, pool_id, token, blocks, n, expires, as_array, now=1e9)
    assert sign_lease(KEY, pool_id, token, blocks, n, expires, as_array) == sig
    for other in (as_array[:-1], as_array[::-1].copy(), np.where(as_array == 1, 2, as_array)):
        with pytest.raises(LeaseRefused, match="signature does not match"):
            check_lease(KEY, sig, pool_id, token, blocks, n, expires, other.astype(np.uint32))


def test_the_signature_covers_the_block_names():
    names = bytes(range(48))  # three 16-byte names
    sig = sign_lease(KEY, *ARGS, names)
    check_lease(KEY, sig, *ARGS, names, now=1e9)
    for other in (b"", names[:32], names[:-1] + b"x"):
        with pytest.raises(LeaseRefused, match="signature does not match"):
            check_lease(KEY, sig, *ARGS, other, now=1e9)


def test_a_lease_is_taken_once_until_it_expires():
    spent = SpentLeases()
    spent.take("pool-a", "tok", expires_at=100.0, now=10.0)
    with pytest.raises(LeaseRefused, match="already taken"):
        spent.take("pool-a", "tok", expires_at=100.0, now=50.0)
    # Another pool's token of the same spelling is another lease.
    spent.take("pool-b", "tok", expires_at=100.0, now=50.0)
    spent.take("pool-a", "later", expires_at=200.0, now=60.0)
    assert len(spent) == 3
    # Past their expiry the first two are forgotten (their signatures refuse them from then on);
    # the one still live is remembered.
    spent.take("pool-a", "new", expires_at=300.0, now=150.0)
    assert len(spent) == 2
    with pytest.raises(LeaseRefused, match="already taken"):
        spent.take("pool-a", "later", expires_at=200.0, now=150.0)
