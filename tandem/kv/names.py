"""Names of full KV blocks: a hash chained over a block's tokens and its parent's name.

Block i of a sequence is named by hash(name of block i-1, the block_size tokens of block i), so a
name stands for the whole prefix up to the end of its block: two sequences share a block only
when everything before it is equal too.

The names are 128-bit BLAKE2b digests, the same in every process: the workers' prefix caches
(`prefix_cache.py`) key blocks by them, and the gateway computes them to guess which worker holds
a prompt's prefix (`services/gateway/prefix_index.py`).
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections.abc import Iterator, Sequence

import numpy as np

_U32 = "I" if array("I").itemsize == 4 else "L"
_U32_NP = np.dtype(np.uint32)  # native byte order, as the array's
NAME_BYTES = 16
# Blocks hashed between two turns of the event loop in `block_hashes_in_slices`: about 70 us
# of one CPU core (a 2k-token prompt in blocks of 16 takes one slice).
SLICE_BLOCKS = 128


def split_names(blob: bytes) -> list[bytes]:
    """Block names sent concatenated (a `KvRef.block_names`), one per block."""
    if len(blob) % NAME_BYTES:
        raise ValueError(
            f"block names take {NAME_BYTES} bytes each; got {len(blob)} bytes, not a multiple"
        )
    return [blob[i : i + NAME_BYTES] for i in range(0, len(blob), NAME_BYTES)]


def chain_hashes(
    parent: bytes | None, token_ids: Sequence[int], block_size: int
) -> Iterator[bytes]:
    """Names of consecutive whole blocks holding `token_ids`, after the block named `parent`
    (None: from the first block); `len(token_ids)` is a multiple of `block_size`."""
    if isinstance(token_ids, np.ndarray):  # a worker's prompt: its bytes in one C copy
        data = memoryview(token_ids.astype(_U32_NP, copy=False).tobytes())
    else:
        data = memoryview(array(_U32, token_ids).tobytes())
    block_bytes = 4 * block_size
    for i in range(0, len(data), block_bytes):
        h = hashlib.blake2b(parent or b"", digest_size=NAME_BYTES)
        h.update(data[i : i + block_bytes])
        parent = h.digest()
        yield parent


def hash_block(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The name of a block holding `tokens` after the block named `parent` (None: the first)."""
    return next(chain_hashes(parent, tokens, len(tokens)))


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Names of every full block of `token_ids`, in order."""
    full = len(token_ids) // block_size * block_size
    return list(chain_hashes(None, token_ids[:full], block_size))


async def block_hashes_in_slices(
    token_ids: Sequence[int], block_size: int, slice_blocks: int = SLICE_BLOCKS
) -> list[bytes]:
    """`block_hashes`, computed on the running event loop in slices of `slice_blocks` blocks,
    giving its other tasks a turn between slices: a long prompt's names (8k tokens: about
    0.3 ms) hold no stream up for more than one slice. A prompt of one slice is hashed at once.

    Not a thread: hashlib holds the GIL for inputs this small (a block is 64 bytes), so a
    thread hashing them leaves the loop waiting just as long, plus the hop (measured)."""
    full = len(token_ids) // block_size * block_size
    step = slice_blocks * block_size
    names: list[bytes] = []
    for start in range(0, full, step):
        if start:
            await asyncio.sleep(0)
        parent = names[-1] if names else None
        names.extend(chain_hashes(parent, token_ids[start : min(start + step, full)], block_size))
    return names
