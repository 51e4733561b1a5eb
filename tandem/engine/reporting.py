"""What the engine reports: the state snapshot services export as metrics, per-tenant
accounting, and the bytes and time of the latest decode step (`tandem.engine.roofline`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.engine.roofline import StepRead
from tandem.engine.sequence import Sequence
from tandem.engine.stats import EngineStats

if TYPE_CHECKING:
    from tandem.config import EngineConfig
    from tandem.engine.scheduler_interface import SchedulerInterface
    from tandem.kv.block_pool import BlockPool
    from tandem.kv.lease import LeaseTable
    from tandem.kv.prefix_cache import PrefixCache


class Reporting:
    """The engine's stats snapshot, per-tenant accounting and the latest decode step's reads.

    Built with what it reads: the pool, prefix cache, scheduler (its queues), lease table, the
    per-tenant refusal counts admission keeps, the engine's settings, and the memory traffic of
    a decode step (fixed bytes per step, KV bytes per token). The step loop writes `read`.
    """

    def __init__(
        self,
        config: EngineConfig,
        pool: BlockPool,
        prefix_cache: PrefixCache | None,
        scheduler: SchedulerInterface,
        leases: LeaseTable,
        tenant_refusals: dict[str, int],
        weight_bytes: int,
        kv_token_bytes: int,
    ) -> None:
        self.config = config
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.scheduler = scheduler
        self.leases = leases
        self.tenant_refusals = tenant_refusals
        self.weight_bytes = weight_bytes
        self.kv_token_bytes = kv_token_bytes
        # What the latest step read: (KV tokens, seconds); None when it was no decode step, or
        # one whose start is unknown.
        self.read: tuple[int, float] | None = None

    def stats(self) -> EngineStats:
        """A snapshot of the engine's state (call it on the engine thread)."""
        pc, pool, cfg = self.prefix_cache, self.pool, self.config
        host = pc.host if pc else None
        return EngineStats(
            running=self.num_running,
            waiting=self.num_waiting,
            used_blocks=pool.num_used,
            total_blocks=pool.num_blocks,
            cached_free_blocks=pool.num_cached_free,
            leases=len(self.leases.leases),
            leased_blocks=self.leases.num_blocks,
            prefix_query_tokens=pc.query_tokens if pc else 0,
            prefix_hit_tokens=pc.hit_tokens if pc else 0,
            block_size=cfg.block_size,
            max_sequences=cfg.max_num_seqs + cfg.max_queued_seqs,
            max_seq_tokens=pool.num_blocks * cfg.block_size,
            prefix_host_hit_tokens=pc.host_hit_tokens if pc else 0,
            host_tier_blocks=host.num_used if host else 0,
            host_tier_capacity_blocks=host.num_slots if host else 0,
        )

    def tenant_stats(self) -> list[dict[str, float | int | str]]:
        """Per tenant (with tenant quotas; else empty): blocks charged and quota, prefix-cache
        hit ratio, evictions and refusals; with a host tier, its blocks there and quota there. Plain reads, safe from another thread for metrics."""
        pool, cache = self.pool, self.prefix_cache
        if not pool.has_quotas:
            return []
        host = cache.host if cache is not None else None
        out = []
        for i, t in enumerate(pool.tenants):
            queried, hit = cache.by_tenant.get(t, (0, 0)) if cache is not None else (0, 0)
            out.append(
                {
                    "tenant": t,
                    "blocks": pool.charged(t),
                    "held_blocks": pool.held(t),
                    "quota_blocks": pool.quota(t) or 0,
                    "prefix_query_tokens": queried,
                    "prefix_hit_tokens": hit,
                    "evictions": pool.evictions[i],
                    "refusals": self.tenant_refusals.get(t, 0),
                }
            )
            if host is not None:
                out[-1]["host_blocks"] = host.charged(i)
                out[-1]["host_quota_blocks"] = host.quota[i] or 0
        return out

    def last_step_read(self) -> StepRead | None:
        """Bytes the latest decode step read (weights and its sequences' KV) and its time:
        from its start on the device (the previous step's end, when the steps ran back to back)
        to its end as the host saw it, so host time that left the device idle counts. None
        when the latest `step()` ran no decode step, or none whose start is known."""
        if self.read is None:
            return None
        kv_tokens, seconds = self.read
        return StepRead(self.weight_bytes + kv_tokens * self.kv_token_bytes, seconds)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)


def decode_kv_tokens(items: list[tuple[Sequence, int]]) -> int:
    """Tokens of KV a batch's step reads when every sequence computes one token (a decode
    step: each reads its whole KV, the new token's included); 0 for a batch with a prompt."""
    total = 0
    for seq, n in items:
        if n != 1:
            return 0
        total += seq.num_computed + 1
    return total
