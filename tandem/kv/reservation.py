"""Reservations: blocks of a decode pool set aside for one prompt's KV, written by a prefill worker.

A reservation is a capability, as a lease is (tandem/kv/lease.py), in the other direction: the
decode worker that owns the blocks signs what it reserved (`sign_reservation`, an HMAC under its
pool's reservation key) and the prefill worker writes into the blocks only when the signature
covers exactly them, the sequence and the prompt it was asked to prefill (through the prompt's
SHA-256, `prompt_digest`, which the reservation carries). The write done, the
prefill worker answers with a proof (`push_proof`, an HMAC under the same key) that the decode
worker checks before it starts the sequence: the gateway, which carries both but holds no stage
secret, can neither forge a reservation nor claim a write that did not happen.

The key is derived from the workers' stage secret and the decode pool (`reservation_key`); a
worker without a stage secret draws one and hands it to its peers at registration.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence

import numpy as np

from tandem.kv.lease import LeaseRefused, _u32_le, framed

# A prefill worker starts no write later than this before the reservation's expiry, so that a
# write it started is over when the decode worker reclaims the blocks at the expiry.
WRITE_MARGIN_S = 1.0


class ReservationRefused(LeaseRefused):
    """A reservation (or a push proof) that does not check out: forged, altered, for another
    prompt or sequence, expired, or already used."""


def reservation_key(stage_secret: bytes, pool_id: str) -> bytes:
    """The key that signs the reservations of the decode pool `pool_id`."""
    return hmac.new(
        stage_secret, b"tandem-reservation-key-v1\0" + pool_id.encode(), hashlib.sha256
    ).digest()


def prompt_digest(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """What a reservation signs of its prompt: the SHA-256 of its ids as little-endian uint32s."""
    return hashlib.sha256(_u32_le(token_ids)).digest()


def sign_reservation(key: bytes, res) -> bytes:
    """The HMAC-SHA256, under its pool's reservation key, of what the reservation `res` (a
    stages_pb2.KvReservation, or anything with its fields) says: its pool, the prefill pool that
    may write it (`writer_pool_id`), its token and sequence, its blocks from `first_block` on,
    the prompt's length and `prompt_digest`, and its expiry."""
    msg = framed([
        b"tandem-reservation-v2",
        res.pool_id.encode(),
        res.writer_pool_id.encode(),
        res.token.encode(),
        res.seq_id.encode(),
        struct.pack("<IId", res.first_block, res.num_tokens, res.expires_at),
        _u32_le(res.block_ids),
        res.prompt_digest,
    ])  # fmt: skip
    return hmac.new(key, msg, hashlib.sha256).digest()


def check_reservation(
    key: bytes,
    res,  # stages_pb2.KvReservation
    seq_id: str,
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    now: float,
    margin_s: float = 0.0,
    prompt_compared: bool = False,
) -> None:
    """Raise `ReservationRefused` unless `res` (a stages_pb2.KvReservation) is signed for exactly
    the sequence `seq_id` and the prompt `token_ids`, its blocks cover the prompt's blocks from
    `first_block` on (blocks of `block_size` tokens), and it expires more than `margin_s` after
    `now` (Unix seconds).

    `prompt_compared`: the caller is the decode worker that reserved the blocks, whose engine
    holds the reserved prompt and compares `token_ids` with it id for id before it uses them
    (`admit_reserved`); then the signed digest is taken as signed rather than computed again
    from `token_ids` here (the handover does not hash the prompt). Every other caller (the
    prefill worker about to write) leaves it False: the digest of `token_ids` must match."""
    if not res.token or not res.signature:
        raise ReservationRefused("the KV reservation carries no token or signature")
    if not prompt_compared and not hmac.compare_digest(prompt_digest(token_ids), res.prompt_digest):
        raise ReservationRefused(
            "KV reservation refused: it was made for another prompt (only what Decode.Reserve "
            "reserved, for the prompt it was given, is written)"
        )
    if not hmac.compare_digest(sign_reservation(key, res), res.signature):
        raise ReservationRefused(
            "KV reservation refused: its signature does not match its blocks and this prompt "
            "(only what Decode.Reserve reserved, for the prompt it was given, is written)"
        )
    if res.seq_id != seq_id:
        raise ReservationRefused(f"KV reservation is for sequence {res.seq_id!r}, not {seq_id!r}")
    n = len(token_ids)
    blocks = (n + block_size - 1) // block_size
    if res.num_tokens != n or res.first_block + len(res.block_ids) != blocks:
        raise ReservationRefused(
            f"KV reservation of {len(res.block_ids)} blocks from block {res.first_block} does "
            f"not cover a prompt of {n} tokens in blocks of {block_size}"
        )
    if now > res.expires_at - margin_s:
        raise ReservationRefused(
            f"KV reservation expired (or expires within {margin_s:g} s): "
            f"{now - res.expires_at:+.1f} s past its end"
        )


def push_proof(key: bytes, token: str, signature: bytes) -> bytes:
    """What a prefill worker answers once it wrote a reservation's blocks: only a holder of the
    key (a worker) can make it."""
    return hmac.new(
        key, b"tandem-push-written-v1\0" + token.encode() + b"\0" + signature, hashlib.sha256
    ).digest()


def check_push_proof(key: bytes, res, proof: bytes) -> None:
    """Raise `ReservationRefused` unless `proof` says the reservation `res` was written."""
    if not proof or not hmac.compare_digest(push_proof(key, res.token, res.signature), proof):
        raise ReservationRefused(
            "pushed KV refused: the admission carries no valid proof that a prefill worker "
            "wrote the reserved blocks"
        )
