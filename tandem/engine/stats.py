"""A snapshot of an engine's state: what services report without reading engine internals."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """`LLMEngine.stats()`: counts read on the engine thread, at one instant."""

    running: int  # sequences in the running batch
    waiting: int  # sequences queued for room
    used_blocks: int  # KV blocks held (by sequences, leases or the prefix cache's live entries)
    total_blocks: int
    cached_free_blocks: int  # free blocks that still hold a cached prefix
    leases: int  # live KV leases (a prefill worker's blocks waiting for their reader)
    leased_blocks: int
    prefix_query_tokens: int  # prompt tokens looked up in the prefix cache (0: cache off)
    prefix_hit_tokens: int  # of those, tokens found
    block_size: int
    max_sequences: int  # running plus queued sequences the engine takes
    max_seq_tokens: int  # tokens of KV the whole pool holds
    # The prefix cache's host tier (0 without one): hit tokens copied back, blocks, capacity.
    prefix_host_hit_tokens: int = 0
    host_tier_blocks: int = 0
    host_tier_capacity_blocks: int = 0
