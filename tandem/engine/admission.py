"""Requests into the engine: validation (sampling parameters, pool size, tenant quota), the
bounded waiting queue, and sequences prefilled elsewhere, which join with their KV copied in
(now, or by a read that completes later) after the prefix this pool already caches."""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tandem.api.sampling_params import SamplingParams
from tandem.api.validation import validate_params, validate_request
from tandem.engine.sampler import make_generator
from tandem.engine.sequence import Sequence, SequenceStatus
from tandem.errors import ResourceExhausted
from tandem.kv.block_table import BlockTable
from tandem.tenants import DEFAULT_TENANT, TenantQuotaExceeded

# A prompt: a list of ids, or a numpy integer array of them (how a worker reads a message's ids:
# checked in C, not id by id).
PromptIds = list[int] | np.ndarray
_U32 = np.dtype("<u4")

if TYPE_CHECKING:
    from tandem.config import EngineConfig
    from tandem.engine.sample_inputs import SampleInputs
    from tandem.engine.scheduler_interface import SchedulerInterface
    from tandem.kv.block_pool import BlockPool
    from tandem.kv.prefix_cache import PrefixCache


class QueueFull(ResourceExhausted):
    """The engine's waiting queue is at its bound; the request is refused, not queued."""


@dataclass
class Reservation:
    """Blocks held for a prompt whose KV another worker writes into them (a push): the table
    holds the prompt's blocks, the first `first` shared from this pool's prefix cache."""

    seq_id: str
    token: str  # the capability naming it outside this process
    prompt: list[int]  # the sequence's list, made here rather than at the handover
    table: BlockTable
    first: int
    expires_at: float  # monotonic
    withdrawn: bool = False  # given back while a write may still come: freed at expiry
    # Of the first `first` blocks' tokens, those copied back from the host tier.
    host_tokens: int = 0
    # The prompt as reserved, as little-endian uint32s, when given as such an array (how a
    # worker reads a message's ids).
    id_bytes: bytes | None = None
    # Names of its blocks to be written, held back in the pool until the admission reveals
    # them (None: named at the admission, as a pulled sequence's are).
    hidden_names: list[bytes] | None = None

    def holds(self, prompt_token_ids: PromptIds) -> bool:
        """Whether `prompt_token_ids` is exactly the prompt reserved (a uint32 array against the
        reserved one by their bytes, one memcmp: no list is made for the comparison)."""
        if self.id_bytes is not None and _is_u32(prompt_token_ids):
            return prompt_token_ids.tobytes() == self.id_bytes
        return _as_list(prompt_token_ids) == self.prompt


class Admission:
    """Adding, admitting and aborting requests: the engine's way in.

    Built with what it touches: the engine's settings (block size, queue bounds), the model's
    vocabulary size and context length, the device sequences' generators live on, the pool, the
    prefix cache and the scheduler it hands sequences to, the engine's map of live sequences
    (`seqs`, which it adds to and removes from), the per-tenant refusal counts, and the sample
    inputs that make grammar matchers.
    """

    def __init__(
        self,
        config: EngineConfig,
        vocab_size: int,
        max_model_len: int,
        device: torch.device,
        pool: BlockPool,
        prefix_cache: PrefixCache | None,
        scheduler: SchedulerInterface,
        seqs: dict[str, Sequence],
        tenant_refusals: dict[str, int],
        sample_inputs: SampleInputs,
    ) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.device = device
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.scheduler = scheduler
        self.seqs = seqs
        self.tenant_refusals = tenant_refusals
        self.sample_inputs = sample_inputs
        self._ids = itertools.count()
        self.reservations: dict[str, Reservation] = {}  # by sequence id

    def validate_request(
        self, prompt_token_ids: PromptIds, params: SamplingParams, tenant: str | None = None
    ) -> None:
        """Raise `ValueError` naming the field when a request cannot be served, and
        `TenantQuotaExceeded` when its tenant's KV quota could never hold its prompt."""
        validate_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        n = len(prompt_token_ids)
        bs = self.config.block_size
        need = (n + 1 + bs - 1) // bs
        if need > self.pool.num_blocks:
            raise ValueError(
                f"prompt has {n} tokens, needing {need} KV blocks; the pool has only "
                f"{self.pool.num_blocks} (raise num_blocks or kv_cache_memory_gb)"
            )
        quota = self.pool.quota(self.tenant_of(tenant))  # ValueError: a tenant without a quota
        if quota is not None and need > quota:
            t = self.tenant_of(tenant)
            self.tenant_refusals[t] += 1
            raise TenantQuotaExceeded(
                f"tenant {t!r} is over its KV quota: the prompt has {n} tokens, needing {need} "
                f"KV blocks, and tenant_quota gives {t!r} {quota} of the pool's "
                f"{self.pool.num_blocks} blocks"
            )

    def tenant_of(self, tenant: str | None) -> str:
        """The tenant a request is charged to: the one it names, else `default`."""
        return tenant or DEFAULT_TENANT

    def add_request(
        self,
        prompt_token_ids: PromptIds,
        params: SamplingParams,
        request_id: str | None = None,
        prefill_only: bool = False,
        tenant: str | None = None,
        matcher: Any = None,
    ) -> Sequence:
        """Validate and queue a request; nothing is allocated when it is refused.

        `prefill_only`: stop after the first token and keep the KV under a lease (prefill worker).
        `tenant`: whose KV quota its blocks count against (see `tandem.tenants`).
        `matcher`: its grammar's matcher from `prepare_matcher` (a constrained request without
        one has its grammar compiled here, on the calling thread).
        """
        self.validate_request(prompt_token_ids, params, tenant)
        self._check_queue()
        prompt = _as_list(prompt_token_ids)
        rid = request_id if request_id is not None else f"seq-{next(self._ids)}"
        if rid in self.seqs:
            raise ValueError(f"request id {rid!r} is already running")
        seq = Sequence(
            seq_id=rid,
            prompt_token_ids=prompt,
            params=params,
            block_table=BlockTable(self.config.block_size, self.tenant_of(tenant)),
            generator=None if params.greedy else make_generator(params.seed, self.device),
            prefill_only=prefill_only,
            matcher=self.sample_inputs.matcher(params, prepared=matcher),
        )
        self.seqs[rid] = seq
        self.scheduler.add_request(seq)
        return seq

    def _continued_seq(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        table: BlockTable,
        first_token: int,
        rng_state: torch.Tensor | None,
        matcher: Any,
    ) -> Sequence:
        """The sequence of a prompt prefilled elsewhere, continuing from its first token: its
        sampler's generator from the prefill's `rng_state`, its grammar's matcher (from
        `prepare_matcher`, else made here) having replayed `first_token`."""
        gen = None
        if not params.greedy:
            gen = make_generator(params.seed, self.device)
            if rng_state is not None:
                gen.set_state(rng_state)
        return Sequence(
            seq_id=request_id,
            prompt_token_ids=prompt,
            params=params,
            block_table=table,
            generator=gen,
            output_token_ids=[first_token],
            output_logprobs=[None],
            # The prefill worker sampled the first token under the grammar: replay it.
            matcher=self.sample_inputs.matcher(params, [first_token], prepared=matcher),
        )

    @staticmethod
    def _check_prefilled(params: SamplingParams) -> None:
        if params.prompt_logprobs is not None:
            raise ValueError(
                "prompt_logprobs cannot be computed for a sequence prefilled elsewhere: the worker "
                "that prefills the prompt returns them (send this sequence without them)"
            )

    def _prefilled_seq(
        self,
        prompt_token_ids: PromptIds,
        first_token: int,
        params: SamplingParams,
        request_id: str,
        rng_state: torch.Tensor | None,
        tenant: str | None = None,
        block_names: list[bytes] | None = None,
        matcher: Any = None,
        queue_when_full: bool = True,
    ) -> tuple[Sequence, int | None]:
        """The sequence of a prompt prefilled elsewhere, registered, with blocks for its prompt:
        the longest prefix cached in this pool shared (the first `first` blocks), fresh blocks
        after it. `first` is None when the pool (or its tenant's quota) has no room: the
        sequence then waits in the queue and will be recomputed here, or, unless
        `queue_when_full`, is forgotten (the caller may try again later). `block_names`: the names
        of the prompt's full blocks, when the worker that prefilled it sent them (verified with
        its lease), so that this pool's prefix cache need not hash the prompt again. `matcher`:
        its grammar's matcher from `prepare_matcher`, having replayed `first_token`."""
        self.validate_request(prompt_token_ids, params, tenant)
        self._check_prefilled(params)
        self._check_queue()
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        prompt = _as_list(prompt_token_ids)
        table = BlockTable(self.config.block_size, self.tenant_of(tenant))
        seq = self._continued_seq(
            request_id, prompt, params, table, first_token, rng_state, matcher
        )
        _name_blocks(table, len(prompt), block_names)
        self.seqs[request_id] = seq
        taken = self._take_blocks(seq, len(prompt) + 1)
        if taken is None:
            if queue_when_full:
                self.scheduler.add_request(seq)
            else:
                del self.seqs[request_id]
            return seq, None
        return seq, taken

    def _take_blocks(self, seq: Sequence, room_for: int) -> int | None:
        """Blocks for the prompt of `seq` (its table empty, its blocks' names known or not):
        the longest prefix this pool's cache holds shared, then what the host tier holds after
        it copied back, then fresh blocks, with room checked for `room_for` tokens. Returns the
        blocks that hold the prompt's KV already (`seq.num_cached_tokens` set from them, and
        `seq.num_host_cached_tokens` from those the host tier gave); None when the pool or the
        tenant's quota has no room."""
        table, prompt = seq.block_table, seq.prompt_token_ids
        n = len(prompt)
        hit: list[int] = []
        names: list[bytes] = []
        restore: list[bytes] = []  # names of the blocks after `hit` that the host tier holds
        cache = self.prefix_cache
        if cache is not None:
            hit, names = cache.match(prompt, n, table.known_names)
            restore = cache.host_match(prompt, n, names, table.known_names)
        revived = sum(1 for b in hit if self.pool.refcount(b) == 0)
        fresh = table.blocks_needed(room_for) - len(hit)
        if not self.pool.can_allocate(fresh + revived) or not self.scheduler.fits_quota(
            seq, hit, fresh
        ):
            return None
        if cache is None:
            table.ensure(self.pool, n)
            first = 0
        else:
            first = cache.adopt(table, hit, names, restore, n)
        seq.num_cached_tokens = first * table.block_size
        seq.num_host_cached_tokens = len(restore) * table.block_size
        return first

    def _join(self, seq: Sequence) -> None:
        """A sequence whose prompt's KV sits in its blocks joins the batch, or waits for room
        holding its KV. Its prompt counts as a prefix-cache lookup and its full blocks are
        named for later hits."""
        seq.num_computed = len(seq.prompt_token_ids)
        if self.prefix_cache is not None:
            self.prefix_cache.count(
                seq.num_computed,
                seq.num_cached_tokens,
                seq.block_table.tenant,
                seq.num_host_cached_tokens,
            )
            self.scheduler.cache_blocks(seq)
        if self.scheduler.has_room():
            self.scheduler.admit_running(seq)
        else:
            self.scheduler.add_request(seq)

    def admit_prefilled(
        self,
        prompt_token_ids: PromptIds,
        first_token: int,
        params: SamplingParams,
        request_id: str,
        copy_in: Callable[[list[int], int], None],
        rng_state: torch.Tensor | None = None,
        tenant: str | None = None,
        block_names: list[bytes] | None = None,
        matcher: Any = None,
        queue_when_full: bool = True,
    ) -> tuple[Sequence, bool]:
        """Join a sequence prefilled elsewhere: allocate blocks, let `copy_in` fill them, run it.

        With a prefix cache, the prompt's longest cached prefix is shared from this pool and
        `copy_in(dst_blocks, first)` fills only the rest: `dst_blocks[j]` receives the prompt's
        block `first + j`. Returns (sequence, imported). When this pool has no room for the
        prompt's blocks, the KV is not imported: the sequence waits and is recomputed here
        (`imported` is False), or, unless `queue_when_full`, is forgotten (the caller may try
        again when blocks free up). With room for the KV but not (yet) in the running batch (the
        sequence limit or the TPOT target), it waits holding its KV.
        """
        seq, first = self._prefilled_seq(
            prompt_token_ids,
            first_token,
            params,
            request_id,
            rng_state,
            tenant,
            block_names,
            matcher,
            queue_when_full,
        )
        if first is None:
            return seq, False
        table = seq.block_table
        try:
            if len(table.blocks) > first:  # a prompt of whole cached blocks copies nothing
                copy_in(list(table.blocks[first:]), first)
        except BaseException:
            self.seqs.pop(request_id, None)
            table.release(self.pool)
            raise
        self._join(seq)
        return seq, True

    def _check_queue(self) -> None:
        # A new sequence queues until the next step; those that step will run (the batch has
        # room) do not count against the queue, so the engine takes max_num_seqs +
        # max_queued_seqs sequences however they arrive (`stats().max_sequences`).
        room = max(0, self.config.max_num_seqs - len(self.scheduler.running))
        waiting = len(self.scheduler.waiting) - room
        if waiting >= self.config.max_queued_seqs:
            raise QueueFull(
                f"{waiting} requests are already waiting "
                f"(max_queued_seqs={self.config.max_queued_seqs}); retry later"
            )

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks; False when it is unknown."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish_request(seq, "abort")
        return True

    # ---- KV imports that complete outside the engine thread (a network read) ----------------
    def reserve_prefilled(
        self,
        prompt_token_ids: PromptIds,
        first_token: int,
        params: SamplingParams,
        request_id: str,
        rng_state: torch.Tensor | None = None,
        peer_blocks: list[int] | None = None,
        tenant: str | None = None,
        block_names: list[bytes] | None = None,
        matcher: Any = None,
        queue_when_full: bool = True,
    ) -> tuple[int, list[int]] | None:
        """First half of `admit_prefilled` for KV that arrives later: the sequence and blocks
        for its prompt, not yet scheduled. Returns (first, blocks): the prompt's longest prefix
        cached in this pool is shared (blocks before `first`), and `blocks[j]` is to receive the
        prompt's block `first + j`. None when this pool has no room: the sequence then waits and
        is recomputed here (unless `queue_when_full` is False: then it is forgotten, and the
        caller, whose KV is still where it was computed, may try again when blocks free up).
        Follow with `start_prefilled` once the blocks hold the KV, or `abort` (which frees
        them).

        `peer_blocks` (the prompt's blocks in the pool the KV comes from) orders the new blocks
        like those: runs of adjacent blocks there land in adjacent blocks here when this pool
        has them, so a network read moves them in long pieces rather than block by block.
        """
        seq, first = self._prefilled_seq(
            prompt_token_ids,
            first_token,
            params,
            request_id,
            rng_state,
            tenant,
            block_names,
            matcher,
            queue_when_full,
        )
        if first is None:
            return None
        # Neither queued nor running (status WAITING, in no queue) until `start_prefilled`;
        # `abort` meanwhile frees the blocks, and no step sees the sequence.
        table = seq.block_table
        fresh = table.blocks[first:]
        if peer_blocks is not None and len(peer_blocks) >= len(table.blocks) and fresh:
            # The new blocks, ascending, handed out in the order of the peer's blocks.
            order = sorted(range(len(fresh)), key=lambda j: peer_blocks[first + j])
            arranged = [0] * len(fresh)
            for b, j in zip(sorted(fresh), order, strict=True):
                arranged[j] = b
            table.blocks[first:] = arranged
        return first, list(table.blocks[first:])

    def start_prefilled(self, request_id: str) -> bool:
        """Second half: the reserved sequence's blocks hold its prompt's KV; it joins the batch
        (or waits for room, holding its KV). False when it was aborted meanwhile."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.num_computed or seq.status is not SequenceStatus.WAITING:
            return False
        self._join(seq)
        return True

    # ---- KV pushed by another worker into blocks reserved here ------------------------------
    def reserve(
        self,
        prompt_token_ids: PromptIds,
        request_id: str,
        ttl_s: float,
        tenant: str | None = None,
        now: float | None = None,
        block_names: list[bytes] | None = None,
    ) -> Reservation | None:
        """Hold blocks for a prompt whose KV another worker will write (`admit_reserved` starts
        the sequence, `unreserve` or the expiry gives them back). The prompt is checked as a
        request's is. Its longest prefix cached here (this pool, then the host tier) is shared:
        only the blocks from `first` on are to be written. `block_names`: the names of the
        prompt's full blocks (`tandem.kv.names.block_hashes`), hashed off the engine thread, so
        that neither this call nor the admission hashes the prompt. None when the pool (or the
        tenant's quota) has no room now."""
        # The ids, the length; the room (quota included) is the allocation's to judge.
        validate_request(prompt_token_ids, SamplingParams(), self.vocab_size, self.max_model_len)
        if request_id in self.seqs or request_id in self.reservations:
            raise ValueError(f"request id {request_id!r} is already running or reserved")
        prompt = _as_list(prompt_token_ids)
        bs = self.config.block_size
        table = BlockTable(bs, self.tenant_of(tenant))
        _name_blocks(table, len(prompt), block_names)
        probe = Sequence(
            seq_id=request_id, prompt_token_ids=prompt, params=SamplingParams(), block_table=table
        )
        first = self._take_blocks(probe, len(prompt))
        if first is None:
            return None
        now = time.monotonic() if now is None else now
        res = Reservation(
            request_id, secrets.token_urlsafe(24), prompt, table, first, now + ttl_s,
            host_tokens=probe.num_host_cached_tokens,
            id_bytes=prompt_token_ids.tobytes() if _is_u32(prompt_token_ids) else None,
        )  # fmt: skip
        if self.prefix_cache is not None and len(table.known_names) == len(prompt) // bs:
            # Named now, held back until the KV is written: the admission (the handover) then
            # makes them findable in one pass instead of naming hundreds of blocks.
            res.hidden_names = self.prefix_cache.register(table, prompt, len(prompt), True)
        self.reservations[request_id] = res
        return res

    def admit_reserved(
        self,
        request_id: str,
        token: str,
        prompt_token_ids: PromptIds,
        first_token: int,
        params: SamplingParams,
        rng_state: torch.Tensor | None = None,
        matcher: Any = None,
    ) -> Sequence:
        """Start the sequence whose reserved blocks now hold its prompt's KV (written by another
        worker): no copy, it joins the batch (or waits for room, holding its KV). The
        reservation ends either way; a request refused here gives its blocks back."""
        res = self.reservations.get(request_id)
        if res is None or res.withdrawn or not secrets.compare_digest(res.token, token):
            raise ValueError(
                f"no live KV reservation {request_id!r} here (expired, given back, or never "
                "made by this worker)"
            )
        # Compared, not copied: the sequence takes the list made at `reserve` (an 8k-token
        # prompt's `tolist` alone would cost more than the rest of the handover).
        if not res.holds(prompt_token_ids):
            raise ValueError("the admitted prompt is not the one whose blocks were reserved")
        prompt = res.prompt
        del self.reservations[request_id]
        table = res.table
        try:
            # The prompt was checked at `reserve`: its ids need no second look.
            validate_params(prompt, params, self.vocab_size)
            self._check_prefilled(params)
            self._check_queue()
            seq = self._continued_seq(
                request_id, prompt, params, table, first_token, rng_state, matcher
            )
        except BaseException:
            table.release(self.pool)
            raise
        self.seqs[request_id] = seq
        seq.num_cached_tokens = res.first * table.block_size
        seq.num_host_cached_tokens = res.host_tokens
        if res.hidden_names is not None:
            self.pool.reveal(res.hidden_names)  # the KV is written now
        self._join(seq)
        return seq

    def unreserve(self, token: str, write_may_be_in_flight: bool = False) -> bool:
        """Give back the reservation `token` names: its blocks return now, or, when a write may
        still come into them, at its expiry. False when it names no live reservation."""
        for res in self.reservations.values():
            if not res.withdrawn and secrets.compare_digest(res.token, token):
                break
        else:
            return False
        if write_may_be_in_flight:
            res.withdrawn = True
        else:
            del self.reservations[res.seq_id]
            res.table.release(self.pool)
        return True

    def expire_reservations(self, now: float | None = None) -> int:
        """Give back the blocks of every reservation past its expiry; returns how many."""
        if not self.reservations:
            return 0
        now = time.monotonic() if now is None else now
        dead = [r for r in self.reservations.values() if r.expires_at <= now]
        for res in dead:
            del self.reservations[res.seq_id]
            res.table.release(self.pool)
        return len(dead)

    @property
    def reserved_blocks(self) -> int:
        return sum(len(r.table.blocks) for r in self.reservations.values())


def _name_blocks(table: BlockTable, n: int, names: list[bytes] | None) -> None:
    """Give an empty table the names of its prompt's full blocks (of `n` tokens), when they
    are known: its prefix-cache lookup and naming then hash nothing."""
    if not names:
        return
    if len(names) != n // table.block_size:
        raise ValueError(
            f"{len(names)} block names for a prompt of {n} tokens in blocks of "
            f"{table.block_size} (expected {n // table.block_size})"
        )
    table.known_names = list(names)


def _is_u32(ids: PromptIds) -> bool:
    """A one-dimensional array of little-endian uint32s (its bytes say its ids exactly)."""
    return isinstance(ids, np.ndarray) and ids.dtype == _U32 and ids.ndim == 1


def _as_list(ids: PromptIds) -> list[int]:
    """A sequence's own list of a prompt's ids."""
    return ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
