"""Continuous batching: decides which sequences run this step and with how many tokens.

Every step, running sequences each get one decode token; waiting sequences join (their whole
uncomputed prompt) while the token budget, the sequence limit and the KV pool allow. When the
pool cannot hold the next token of a running sequence, the newest running sequence is preempted:
its blocks are freed and it waits at the head of the queue to be recomputed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tandem.engine.sequence import Sequence, SequenceStatus
from tandem.kv.block_pool import BlockPool


@dataclass
class ScheduledBatch:
    """The work of one step: (sequence, number of new tokens to compute) in batch order."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    """Owns the waiting queue and the running set; allocates and frees their KV blocks."""

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        # 1. One decode token for every running sequence, oldest first; preempt the newest on OOM.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.spec_tokens and not self.pool.can_allocate(
                seq.block_table.blocks_needed(seq.num_tokens + len(seq.spec_tokens))
            ):
                seq.spec_tokens = []  # no room to verify drafts: decode one token instead
            need = seq.block_table.blocks_needed(seq.num_tokens + len(seq.spec_tokens))
            while not self.pool.can_allocate(need) and self.running[-1] is not seq:
                batch.preempted.append(self._preempt(self.running.pop()))
            if not self.pool.can_allocate(need):
                # Even alone it cannot grow: preempt it too (it recomputes when blocks free up).
                self.running.pop()
                batch.preempted.append(self._preempt(seq))
                break
            seq.block_table.ensure(self.pool, seq.num_tokens + len(seq.spec_tokens))
            batch.items.append((seq, seq.num_tokens - seq.num_computed + len(seq.spec_tokens)))
            i += 1
        if batch.preempted:
            return batch
        # 2. Admit waiting sequences in arrival order.
        budget = self.max_num_batched_tokens - batch.num_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_tokens - seq.num_computed
            if n > budget and batch.items:
                break
            # Room for the prompt plus the first decode token, so admission never thrashes.
            need = seq.block_table.blocks_needed(seq.num_tokens + 1)
            if not self.pool.can_allocate(need):
                break
            self.waiting.popleft()
            seq.block_table.ensure(self.pool, seq.num_tokens)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.items.append((seq, n))
            budget -= n
        return batch

    def _preempt(self, seq: Sequence) -> Sequence:
        seq.spec_tokens = []
        seq.block_table.release(self.pool)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        return seq

    def admit_running(self, seq: Sequence) -> None:
        """Put a sequence whose KV is already in its blocks straight into the running set."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str, keep_blocks: bool = False) -> list[int]:
        """Take a sequence out of the queues; free its blocks unless `keep_blocks` (returned)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        blocks = seq.block_table.blocks
        if keep_blocks:
            seq.block_table.blocks = []
        else:
            seq.block_table.release(self.pool)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        return blocks
