"""Continuous batching: decides which sequences run this step and with how many tokens.

Every step, in this order, within a token budget:
1. each running sequence in decode gets its next token (plus draft tokens to verify); when the
   pool cannot hold them, the newest running sequence is preempted: its blocks are freed and it
   waits at the head of the queue to be recomputed. Its full computed blocks stay cached (with a
   host tier, those the pool then evicts go there), so the recompute takes them back as a
   prefix hit and computes little more than its last block. A sequence that would need more
   blocks than the whole pool has can never continue: it is finished (`length`, in `outgrown`)
   instead of preempted, so it never waits for room that cannot come while everyone queues
   behind it;
2. running sequences still in their prompt get their next chunk (chunked prefill: a long prompt
   is computed over several steps, mixed with the decodes, never all at once);
3. waiting sequences join in arrival order while the budget, the sequence limit and the pool
   allow. With a prefix cache, a joining sequence first takes the cached blocks of its longest
   cached prefix and computes only the rest (unless it asked for prompt logprobs, which need
   every prompt position computed).

With tenant quotas (`tandem.kv.tenants`), a tenant's sequences and leases together with its cached
blocks never hold more than its quota: in 1, a sequence whose growth would pass it preempts its
tenant's newest running sequence (itself last), never another tenant's; one that would need more
than the whole quota alone ends (`length`, in `outgrown`). In 3, a waiting sequence whose tenant
has no room is passed over, staying in its place, so other tenants still join in arrival order.

With a time-per-output-token target (`tpot_slo_s`), the number of running sequences follows from
the measured step time (`StepTimeModel`), so new sequences do not push a decode step past the
target, and prompt work beside decodes is paced: the engine reports how long each round of
decode tokens took (`pace`). Time rounds leave under the target is banked; a step beside decodes
carries prompt tokens (one `prefill_chunk` in all, which bounds the pause) only once the bank
holds what such steps lately overran the target by, which the step then spends. This aims the
decoding sequences' time per output token at the target while prompts move a whole chunk at a
time (a step with prompt tokens costs far more than their share: it runs eagerly, beside
graph-replayed decode steps). Prompts still get at least `PROMPT_SHARE` of the time: a chunk
also goes once the decode-only rounds while prompts waited make its overrun that share, so they
progress when decodes alone miss the target (which the time per output token then exceeds by up
to that share).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tandem.engine.prompt_logprobs import wants_prompt_logprobs
from tandem.engine.sequence import Sequence, SequenceStatus
from tandem.kv.block_pool import BlockPool
from tandem.kv.prefix_cache import PrefixCache
from tandem.step_time import StepTimeModel


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
    """Owns the waiting queue and the running set; allocates and frees their KV blocks.

    Implements `SchedulerInterface` (scheduler_interface.py), what the engine's parts call."""

    # Under a time-per-output-token target, the least share of time prompts get beside decodes
    # (see `pace`).
    PROMPT_SHARE = 0.05

    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_chunk: int | None = None,
        prefix_cache: PrefixCache | None = None,
        tpot_slo_s: float | None = None,
    ) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk or max_num_batched_tokens
        self.prefix_cache = prefix_cache
        self.tpot_slo_s = tpot_slo_s
        self.step_time = StepTimeModel()
        # Seconds decode rounds came in under the target, less what steps with prompt chunks
        # overran it; within plus or minus the larger of the target and that overrun.
        self.tpot_bank_s = 0.0
        self.mixed = False  # whether the latest schedule gave prompt tokens beside decodes
        self.prompts_wait = False  # whether prompt tokens waited beside its decodes (`pace`)
        self._overrun_s: float | None = None  # EWMA of how far rounds with prompts overran
        self._share_s = 0.0  # PROMPT_SHARE of the decode-only rounds since the last prompt chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Sequences finished because they outgrew the whole pool, until the engine reports them.
        self.outgrown: list[Sequence] = []

    def add_request(self, seq: Sequence) -> None:
        """Queue a sequence; it joins in arrival order when a step has room for it."""
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while a sequence waits or runs."""
        return bool(self.waiting or self.running)

    @staticmethod
    def in_prompt(seq: Sequence) -> bool:
        """True while more than one token lacks KV (the sequence is still prefilling)."""
        return seq.num_tokens - seq.num_computed > 1 and not seq.spec_tokens

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        for seq in self.running:
            self.cache_blocks(seq)  # name the blocks the previous step completed
        # 1. One decode token (plus drafts) for every running sequence, oldest first; preempt
        # the newest on OOM.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if self.in_prompt(seq):
                i += 1
                continue
            if seq.spec_tokens:
                spec_need = seq.block_table.blocks_needed(seq.num_tokens + len(seq.spec_tokens))
                if not self.pool.can_allocate(spec_need) or not self._quota_allows(seq, spec_need):
                    seq.spec_tokens = []  # no room to verify drafts: decode one token instead
            need = seq.block_table.blocks_needed(seq.num_tokens + len(seq.spec_tokens))
            if not self._quota_allows(seq, need):
                # Over its tenant's quota: the tenant's newer sequences give way, then itself.
                if self._tenant_quota_growth(seq, need, i, batch):
                    continue  # it was preempted or ended: the next one is now at index i
            while not self.pool.can_allocate(need) and self.running[-1] is not seq:
                batch.preempted.append(self._preempt(self.running.pop()))
            if not self.pool.can_allocate(need):
                if self._outgrows_pool(seq, seq.num_tokens):
                    if seq.num_pending:
                        i += 1  # its last tokens are still on the device: end it next step
                        continue
                    # Even an empty pool could not hold it: it ends here, at its length limit.
                    self.finish_request(seq, "length")
                    self.outgrown.append(seq)
                    break
                # Even alone it cannot grow: preempt it too (it recomputes when blocks free up).
                self.running.pop()
                batch.preempted.append(self._preempt(seq))
                break
            seq.block_table.ensure(self.pool, seq.num_tokens + len(seq.spec_tokens))
            batch.items.append((seq, seq.num_tokens - seq.num_computed + len(seq.spec_tokens)))
            i += 1
        if batch.preempted:
            return batch
        self.mixed = self.prompts_wait = False
        budget = self.max_num_batched_tokens - batch.num_tokens
        if batch.items and self.tpot_slo_s is not None:
            self.prompts_wait = bool(self.waiting) or any(map(self.in_prompt, self.running))
            if not self._prompt_room():
                return batch  # decodes only, until rounds under the target have paid for prompts
            budget = min(budget, self.prefill_chunk)  # one chunk of prompt tokens a step
        decode_tokens = batch.num_tokens
        # 2. The next chunk of every running sequence still in its prompt (blocks are held).
        for seq in self.running:
            if budget <= 0:
                break
            if self.in_prompt(seq):
                n = min(seq.num_tokens - seq.num_computed, budget, self.prefill_chunk)
                batch.items.append((seq, n))
                budget -= n
        # 3. Admit waiting sequences in arrival order.
        at = 0  # sequences before it wait for their tenant's quota
        while at < len(self.waiting) and budget > 0 and len(self.running) < self._seq_limit():
            seq = self.waiting[at]
            if self._outgrows_pool(seq, seq.num_tokens + 1) and seq.output_token_ids:
                # Preempted after it grew too long to ever be scheduled again: it ends here.
                self.finish_request(seq, "length")
                self.outgrown.append(seq)
                continue
            fit = self._allocate_for(seq)
            if fit == "quota":
                at += 1  # its tenant is at its quota: it waits, the others go on
                continue
            if fit == "pool":
                if not self.running and self._drop_waiting_kv():
                    continue  # blocks held by queued sequences were freed: try again
                break
            del self.waiting[at]
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed, budget, self.prefill_chunk)
            batch.items.append((seq, n))
            budget -= n
        self.mixed = decode_tokens > 0 and batch.num_tokens > decode_tokens
        return batch

    def pace(self, seconds: float, mixed: bool, tokens: float = 1.0) -> None:
        """Account one round of decode tokens that came `seconds` after the previous round, from
        a step that carried prompt tokens too (`mixed`) or not, `tokens` to a sequence on average
        (under a time-per-output-token target; see the module docstring)."""
        if self.tpot_slo_s is None:
            return
        allowed = self.tpot_slo_s * tokens  # what the round may take
        if mixed:
            # Up at once, down slowly: the next chunk is priced at no less than this one cost.
            over = seconds - allowed
            if self._overrun_s is None or over > self._overrun_s:
                self._overrun_s = over
            else:
                self._overrun_s = _ewma(self._overrun_s, over)
            self._share_s = 0.0
        elif self.prompts_wait:
            self._share_s += self.PROMPT_SHARE * seconds
        else:
            self._share_s = 0.0  # no prompt waited: none is owed time
        cap = max(self.tpot_slo_s, self._overrun_s or 0.0)
        self.tpot_bank_s = max(min(self.tpot_bank_s + allowed - seconds, cap), -cap)

    def _prompt_room(self) -> bool:
        """Whether a step beside decodes may carry prompt tokens under the TPOT target: the bank
        holds what such a step overran the target by lately, or the decode-only rounds while
        prompts waited since then have run long enough for it to be PROMPT_SHARE of the time
        (so that prompts progress even when decodes alone miss the target)."""
        need = max(self._overrun_s or 0.0, 0.0)
        return self.tpot_bank_s >= need or self._share_s >= need

    def _outgrows_pool(self, seq: Sequence, num_tokens: int) -> bool:
        """True when `num_tokens` of the sequence need more blocks than the whole pool has (or
        than its tenant's whole quota)."""
        bs = seq.block_table.block_size
        cap = self.pool.num_blocks
        quota = self.pool.quota(seq.block_table.tenant)
        if quota is not None:
            cap = min(cap, quota)
        return (num_tokens + bs - 1) // bs > cap

    def _quota_allows(self, seq: Sequence, new_blocks: int) -> bool:
        """True when the sequence's tenant may hold `new_blocks` more blocks (no quota: True)."""
        tenant = seq.block_table.tenant
        quota = self.pool.quota(tenant)
        return quota is None or self.pool.held(tenant) + new_blocks <= quota

    def fits_quota(self, seq: Sequence, hit: list[int], need: int) -> bool:
        """True when the tenant of a joining sequence may take `need` new blocks after the
        cached blocks `hit`: those it finds among its own cached blocks nobody holds count
        against its room too (they become held)."""
        tenant = seq.block_table.tenant
        if self.pool.quota(tenant) is None:
            return True
        own = sum(1 for b in hit if self.pool.refcount(b) == 0 and self.pool.owner(b) == tenant)
        return self._quota_allows(seq, need + own)

    def _tenant_quota_growth(self, seq: Sequence, need: int, i: int, batch: ScheduledBatch) -> bool:
        """Make room within its tenant's quota for running sequence `seq` (at index i) to grow
        by `need` blocks: preempt the tenant's newest running sequences after it. False when
        that made room; True when `seq` itself left the running set (preempted, or ended when
        even the whole quota cannot hold it)."""
        tenant = seq.block_table.tenant
        j = len(self.running) - 1
        while j > i and not self._quota_allows(seq, need):
            other = self.running[j]
            if other.block_table.tenant == tenant:
                del self.running[j]
                batch.preempted.append(self._preempt(other))
            j -= 1
        if self._quota_allows(seq, need):
            return False
        if self._outgrows_pool(seq, seq.num_tokens + len(seq.spec_tokens)) and not seq.num_pending:
            self.finish_request(seq, "length")  # takes it out of the running set
            self.outgrown.append(seq)
        else:
            del self.running[i]
            batch.preempted.append(self._preempt(seq))
        return True

    def _allocate_for(self, seq: Sequence) -> str:
        """Give a joining sequence its blocks (cached prefix first): "ok", or why they do not
        fit: "quota" (its tenant's) or "pool".

        Room is checked for the whole sequence plus its first decode token, so admission never
        thrashes; a prompt's blocks are all taken now, its chunks then only compute.
        """
        table = seq.block_table
        hit: list[int] = []
        names: list[bytes] = []
        restore: list[bytes] = []  # names of the blocks after `hit` that the host tier holds
        # A sequence queued with its KV (imported while the batch was full) has its blocks. One
        # that still needs prompt logprobs computes its whole prompt: a cached prefix would skip
        # the forward of positions it must score (tandem/engine/prompt_logprobs.py).
        cache = self.prefix_cache if not table.blocks and not wants_prompt_logprobs(seq) else None
        if cache is not None:
            # At least the last token is computed (its logits give the next token), so a fully
            # cached sequence still leaves its last block to be written privately.
            hit, names = cache.match(seq.all_token_ids, seq.num_tokens - 1)
            if cache.host is not None:  # the prefix may go on in the host tier
                restore = cache.host_match(seq.all_token_ids, seq.num_tokens - 1, names)
        fresh = table.blocks_needed(seq.num_tokens + 1) - len(hit)
        if not table.blocks and not self.fits_quota(seq, hit, fresh):
            return "quota"
        revived = sum(1 for b in hit if self.pool.refcount(b) == 0)
        if not self.pool.can_allocate(fresh + revived):
            return "pool"
        if restore:
            prefix = cache.adopt(table, hit, names, restore, seq.num_tokens)
            seq.num_computed = prefix * table.block_size
        elif hit:
            table.adopt_cached(self.pool, hit, names)
            seq.num_computed = len(hit) * table.block_size
        if cache is not None and seq.first_scheduled_time is None:
            found = (len(hit) + len(restore)) * table.block_size
            cache.count(seq.num_tokens, found, table.tenant, len(restore) * table.block_size)
            seq.num_cached_tokens = found
        table.ensure(self.pool, seq.num_tokens)
        return "ok"

    def _drop_waiting_kv(self) -> bool:
        """Free the KV of queued sequences that hold some (admitted with imported KV), newest
        first, so the head of the queue can run when nothing else would ever free blocks."""
        dropped = False
        for seq in reversed(self.waiting):
            if seq.block_table.blocks:
                self.cache_blocks(seq)
                seq.block_table.release(self.pool)
                seq.num_computed = 0
                dropped = True
        return dropped

    def _seq_limit(self) -> int:
        limit = self.max_num_seqs
        if self.tpot_slo_s is not None:
            fit = self.step_time.max_tokens(self.tpot_slo_s)
            if fit is not None:
                limit = min(limit, max(1, fit))
        return limit

    def cache_blocks(self, seq: Sequence) -> None:
        """Name (prefix cache) the sequence's full blocks whose KV is computed and final."""
        if self.prefix_cache is None:
            return
        table = seq.block_table
        # Tokens sampled on the device but not read yet (async scheduling) are not final here.
        prompt = seq.prompt_token_ids
        done = min(seq.num_computed, len(prompt) + len(seq.output_token_ids))
        if done // table.block_size > len(table.hashes):
            # Within the prompt (an admission), the prompt's list itself: no copy of it joined
            # to the output.
            toks = prompt if done <= len(prompt) else seq.all_token_ids
            self.prefix_cache.register(table, toks, done)

    def _preempt(self, seq: Sequence) -> Sequence:
        seq.spec_tokens = []
        self.cache_blocks(seq)  # its computed blocks stay cached: recomputing may find them
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

    def has_room(self) -> bool:
        """Another sequence may join the running set now (sequence limit, TPOT target)."""
        return len(self.running) < self._seq_limit()

    def finish_request(self, seq: Sequence, reason: str, keep_blocks: bool = False) -> list[int]:
        """Take a sequence out of the queues; free its blocks unless `keep_blocks` (returned).

        Its computed full blocks stay in the prefix cache either way.
        """
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.cache_blocks(seq)
        blocks = seq.block_table.blocks
        if keep_blocks:
            seq.block_table.blocks = []
            seq.block_table.hashes = []
        else:
            seq.block_table.release(self.pool)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        return blocks


def _ewma(mean: float, x: float, alpha: float = 0.2) -> float:
    return mean + alpha * (x - mean)
