"""The engine loop: schedule -> execute -> sample -> update, one step at a time."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem import progress
from tandem.api.sampling_params import SamplingParams
from tandem.api.validation import validate_request
from tandem.config import EngineConfig, set_kernel_config
from tandem.engine.grammar import GrammarCompiler
from tandem.engine.model_runner import ModelRunner
from tandem.engine.prompt_logprobs import plan_prompt_scoring
from tandem.engine.roofline import StepRead, kv_bytes_per_token, weight_bytes
from tandem.engine.sampler import TokenLogprobs, make_generator, sample, sample_ids
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import Sequence, SequenceStatus
from tandem.engine.spec_decode import accept_draft_tokens
from tandem.engine.stats import EngineStats
from tandem.kv.block_pool import BlockPool
from tandem.kv.block_table import BlockTable
from tandem.kv.cache import KVCache
from tandem.kv.lease import Lease, LeaseTable
from tandem.kv.prefix_cache import PrefixCache
from tandem.model.llama import LlamaModel
from tandem.model.loader import LoadedModel
from tandem.quant.weights import prepare_weights
from tandem.tenants import DEFAULT_TENANT, TenantQuotaExceeded, quota_blocks

log = logging.getLogger("tandem.engine")


@dataclass
class StepOutput:
    """What one step produced for one sequence."""

    seq: Sequence
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finished: bool
    # On the step that emits a sequence's first token, when it asked for prompt logprobs: one
    # entry per prompt token, the first None (tandem/engine/prompt_logprobs.py).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class _InFlight:
    """A decode step launched on the device whose sampled tokens the host has not read yet."""

    items: list[tuple[Sequence, int]]
    ids: torch.Tensor  # [B] int64 on the device: the sampled tokens
    host: torch.Tensor  # [B] int64 (pinned on CUDA): their copy, valid once `event` completes
    event: torch.cuda.Event | None  # None on CPU, where the copy is already done
    rows: dict[str, int]  # seq_id -> row in `items`
    kv_tokens: int = 0  # tokens of KV the step reads: every sequence's, its new token's included
    # perf_counter() when the step before it was seen complete, if this step was queued on the
    # device by then (it then ran right after it): the start of its time on the device.
    queued_at: float | None = None


class QueueFull(RuntimeError):
    """The engine's waiting queue is at its bound; the request is refused, not queued."""


def use_cuda_device(device: torch.device) -> None:
    """Make `device` this thread's current CUDA device (Triton launches and CUDA graphs go to the
    current device, not the tensors'); a clear error when it does not exist."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for, but CUDA is not available here")
    n = torch.cuda.device_count()
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if not 0 <= idx < n:
        raise ValueError(f"device {device} does not exist: {n} CUDA device(s) are visible")
    torch.cuda.set_device(idx)


class LLMEngine:
    """Model, KV pool, scheduler and sampler of one worker."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        kv: KVCache | None = None,
        lease_ttl_s: float = 30.0,
    ) -> None:
        self.config = config
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        device = config.resolved_device()
        use_cuda_device(device)
        dtype = config.resolved_dtype()
        mc = loaded.config
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        progress.report(
            f"building the model ({dtype}, quantization {config.quantization}) on {device}"
        )
        weights = prepare_weights(loaded, config.quantization, dtype, device)
        # Kernel settings hold for the process: the kernels read them at each launch.
        kernels = config.kernel_config()
        set_kernel_config(kernels)
        self.model = LlamaModel(
            mc, weights, dtype, device, max_positions=self.max_model_len, kernels=kernels
        )
        if kv is None:
            layout = self.pool_layout(loaded, config)
            kv = KVCache.allocate(
                mc.num_layers,
                layout.num_blocks,
                config.block_size,
                mc.num_kv_heads,
                mc.head_dim,
                config.resolved_kv_dtype(),
                device,
            )
        self.kv = kv
        progress.report(
            f"KV pool: {kv.num_blocks} blocks of {config.block_size} tokens "
            f"({kv.data.numel() * kv.data.element_size() / 2**20:.0f} MiB on {device})"
        )
        # Tenant quotas: blocks each tenant may hold (None: no tenants, one pool-wide account).
        fractions = config.tenant_quotas()
        self.pool = BlockPool(
            kv.num_blocks, quota_blocks(fractions, kv.num_blocks) if fractions else None
        )
        # Requests refused because their tenant's quota could never hold them, per tenant.
        self.tenant_refusals: dict[str, int] = {t: 0 for t in fractions}
        self.prefix_cache = (
            PrefixCache(self.pool, config.block_size) if config.enable_prefix_cache else None
        )
        self.leases = LeaseTable(self.pool, lease_ttl_s)
        self.runner = ModelRunner(
            self.model,
            self.kv,
            cuda_graphs=config.cuda_graphs,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        if self.runner.graphs is not None:
            progress.report("CUDA graphs captured")
        self.scheduler = Scheduler(
            self.pool,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            prefill_chunk=config.prefill_chunk,
            prefix_cache=self.prefix_cache,
            tpot_slo_s=config.tpot_slo_ms / 1e3 if config.tpot_slo_ms else None,
        )
        self.device = device
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.eos_token_ids = set(mc.eos_token_ids) | set(loaded.tokenizer.eos_token_ids)
        # Asynchronous scheduling: the step in flight, and a pinned ring of sampled-id buffers
        # (two: the step being read and the one just launched).
        self._inflight: _InFlight | None = None
        self._ring = [
            torch.zeros(config.max_num_seqs, dtype=torch.long, pin_memory=device.type == "cuda")
            for _ in range(2)
        ]
        self._ring_next = 0
        # The ids go to the host on a stream of their own, so the next step's input copy and
        # graph do not queue behind that copy.
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._last_tokens = 0  # tokens computed by the step being timed
        # Memory traffic of decode steps (tandem.engine.roofline): fixed bytes per step, KV bytes
        # per token, and what the latest step read (None: it was no decode step, or untimed).
        self._weight_bytes = weight_bytes(self.model)
        self._kv_token_bytes = kv_bytes_per_token(self.kv)
        self._read: tuple[int, float] | None = None  # (KV tokens, seconds)
        self._step_started = self._collected_at = 0.0  # perf_counter() readings
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request

    @staticmethod
    def pool_layout(loaded: LoadedModel, config: EngineConfig):
        """The layout `__init__` would give this worker's KV pool (to allocate it elsewhere)."""
        from tandem.kv.layout import DTYPE_NAMES, PoolLayout

        mc = loaded.config
        dtype = config.resolved_kv_dtype()
        num_blocks = config.num_blocks
        if num_blocks is None:
            per_block = KVCache.bytes_per_block(
                mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim, dtype
            )
            num_blocks = max(1, int(config.kv_cache_memory_gb * 2**30) // per_block)
        return PoolLayout(
            mc.num_layers,
            num_blocks,
            config.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            DTYPE_NAMES[dtype],
        )

    # ---- requests -------------------------------------------------------------------------
    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, tenant: str | None = None
    ) -> None:
        """Raise `ValueError` naming the field when a request cannot be served, and
        `TenantQuotaExceeded` when its tenant's KV quota could never hold its prompt."""
        validate_request(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)
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
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prefill_only: bool = False,
        tenant: str | None = None,
    ) -> Sequence:
        """Validate and queue a request; nothing is allocated when it is refused.

        `prefill_only`: stop after the first token and keep the KV under a lease (prefill worker).
        `tenant`: whose KV quota its blocks count against (see `tandem.tenants`).
        """
        self.validate_request(prompt_token_ids, params, tenant)
        self._check_queue()
        rid = request_id if request_id is not None else f"seq-{next(self._ids)}"
        if rid in self.seqs:
            raise ValueError(f"request id {rid!r} is already running")
        seq = Sequence(
            seq_id=rid,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            block_table=BlockTable(self.config.block_size, self.tenant_of(tenant)),
            generator=None if params.greedy else make_generator(params.seed, self.device),
            prefill_only=prefill_only,
            matcher=self._matcher(params),
        )
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return seq

    def _prefilled_seq(
        self,
        prompt_token_ids: list[int],
        first_token: int,
        params: SamplingParams,
        request_id: str,
        rng_state: torch.Tensor | None,
        tenant: str | None = None,
    ) -> tuple[Sequence, int | None]:
        """The sequence of a prompt prefilled elsewhere, registered, with blocks for its prompt:
        the longest prefix cached in this pool shared (the first `first` blocks), fresh blocks
        after it. `first` is None when the pool (or its tenant's quota) has no room: the
        sequence then waits in the queue and will be recomputed here."""
        self.validate_request(prompt_token_ids, params, tenant)
        if params.prompt_logprobs is not None:
            raise ValueError(
                "prompt_logprobs cannot be computed for a sequence prefilled elsewhere: the worker "
                "that prefills the prompt returns them (send this sequence without them)"
            )
        self._check_queue()
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        gen = None
        if not params.greedy:
            gen = make_generator(params.seed, self.device)
            if rng_state is not None:
                gen.set_state(rng_state)
        seq = Sequence(
            seq_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            block_table=BlockTable(self.config.block_size, self.tenant_of(tenant)),
            generator=gen,
            output_token_ids=[first_token],
            output_logprobs=[None],
            # The prefill worker sampled the first token under the grammar: replay it.
            matcher=self._matcher(params, [first_token]),
        )
        n = len(prompt_token_ids)
        table = seq.block_table
        hit: list[int] = []
        names: list[bytes] = []
        if self.prefix_cache is not None:
            hit, names = self.prefix_cache.match(prompt_token_ids, n)
        revived = sum(1 for b in hit if self.pool.refcount(b) == 0)
        self.seqs[request_id] = seq
        fresh = table.blocks_needed(n + 1) - len(hit)
        if not self.pool.can_allocate(fresh + revived) or not self.scheduler.fits_quota(
            seq, hit, fresh
        ):
            self.scheduler.add(seq)
            return seq, None
        if hit:
            table.adopt_cached(self.pool, hit, names)
        table.ensure(self.pool, n)
        return seq, len(hit)

    def admit_prefilled(
        self,
        prompt_token_ids: list[int],
        first_token: int,
        params: SamplingParams,
        request_id: str,
        copy_in: Callable[[list[int], int], None],
        rng_state: torch.Tensor | None = None,
        tenant: str | None = None,
    ) -> tuple[Sequence, bool]:
        """Join a sequence prefilled elsewhere: allocate blocks, let `copy_in` fill them, run it.

        With a prefix cache, the prompt's longest cached prefix is shared from this pool and
        `copy_in(dst_blocks, first)` fills only the rest: `dst_blocks[j]` receives the prompt's
        block `first + j`. Returns (sequence, imported). When this pool has no room for the
        prompt's blocks, the KV is not imported: the sequence waits and is recomputed here
        (`imported` is False). With room for the KV but not (yet) in the running batch (the
        sequence limit or the TPOT target), it waits holding its KV.
        """
        seq, first = self._prefilled_seq(
            prompt_token_ids, first_token, params, request_id, rng_state, tenant
        )
        if first is None:
            return seq, False
        n = len(prompt_token_ids)
        table = seq.block_table
        try:
            if len(table.blocks) > first:  # a prompt of whole cached blocks copies nothing
                copy_in(list(table.blocks[first:]), first)
        except BaseException:
            self.seqs.pop(request_id, None)
            table.release(self.pool)
            raise
        seq.num_computed = n
        seq.num_cached_tokens = first * table.block_size
        if self.prefix_cache is not None:
            self.prefix_cache.count(n, seq.num_cached_tokens, table.tenant)
            self.scheduler.cache_blocks(seq)
        if self.scheduler.has_room():
            self.scheduler.admit_running(seq)
        else:
            self.scheduler.add(seq)  # joins when the batch has room; its KV stays here
        return seq, True

    def _matcher(self, params: SamplingParams, replay: list[int] | tuple = ()):
        """A grammar matcher for a constrained request (None when unconstrained)."""
        if params.structured is None:
            return None
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.tokenizer.hf,
                self.model_config.vocab_size,
                self.eos_token_ids,
                pin_memory=self.device.type == "cuda",
            )
        return self._grammars.matcher(params.structured, replay)

    def _masks(
        self, seqs: list[Sequence], batch: list[Sequence] | None = None
    ) -> tuple[torch.Tensor | None, list[int]]:
        """The structured-output bitmask (host side, one row per sequence of `batch`, default
        `seqs` itself) of the constrained sequences among `seqs`, and their rows."""
        constrained = [s for s in seqs if s.matcher is not None]
        if not constrained:
            return None, []
        assert self._grammars is not None
        batch = batch if batch is not None else seqs
        row_of = {id(s): i for i, s in enumerate(batch)}
        rows = [row_of[id(s)] for s in constrained]
        return self._grammars.bitmask([s.matcher for s in constrained], rows, len(batch)), rows

    @staticmethod
    def _sample_inputs(seqs: list[Sequence]) -> tuple[list, list | None]:
        """Histories for the repetition penalty and generated tokens for OpenAI's penalties."""
        hist = [s.all_token_ids if s.params.repetition_penalty != 1.0 else () for s in seqs]
        outs = None
        if any(s.params.frequency_penalty or s.params.presence_penalty for s in seqs):
            outs = [s.output_token_ids for s in seqs]
        return hist, outs

    def _check_queue(self) -> None:
        if len(self.scheduler.waiting) >= self.config.max_queued_seqs:
            raise QueueFull(
                f"{len(self.scheduler.waiting)} requests are already waiting "
                f"(max_queued_seqs={self.config.max_queued_seqs}); retry later"
            )

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks; False when it is unknown."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- KV imports that complete outside the engine thread (a network read) ----------------
    def reserve_prefilled(
        self,
        prompt_token_ids: list[int],
        first_token: int,
        params: SamplingParams,
        request_id: str,
        rng_state: torch.Tensor | None = None,
        peer_blocks: list[int] | None = None,
        tenant: str | None = None,
    ) -> tuple[int, list[int]] | None:
        """First half of `admit_prefilled` for KV that arrives later: the sequence and blocks
        for its prompt, not yet scheduled. Returns (first, blocks): the prompt's longest prefix
        cached in this pool is shared (blocks before `first`), and `blocks[j]` is to receive the
        prompt's block `first + j`. None when this pool has no room: the sequence then waits and
        is recomputed here. Follow with `start_prefilled` once the blocks hold the KV, or `abort`
        (which frees them).

        `peer_blocks` (the prompt's blocks in the pool the KV comes from) orders the new blocks
        like those: runs of adjacent blocks there land in adjacent blocks here when this pool
        has them, so a network read moves them in long pieces rather than block by block.
        """
        seq, first = self._prefilled_seq(
            prompt_token_ids, first_token, params, request_id, rng_state, tenant
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
        seq.num_cached_tokens = first * table.block_size
        return first, list(table.blocks[first:])

    def start_prefilled(self, request_id: str) -> bool:
        """Second half: the reserved sequence's blocks hold its prompt's KV; it joins the batch
        (or waits for room, holding its KV). False when it was aborted meanwhile."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.num_computed or seq.status is not SequenceStatus.WAITING:
            return False
        seq.num_computed = len(seq.prompt_token_ids)
        if self.prefix_cache is not None:
            # Name the full blocks read for later hits (the shared prefix already has names).
            self.prefix_cache.count(seq.num_computed, seq.num_cached_tokens, seq.block_table.tenant)
            self.scheduler.cache_blocks(seq)
        if self.scheduler.has_room():
            self.scheduler.admit_running(seq)
        else:
            self.scheduler.add(seq)
        return True

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one batched forward for every scheduled sequence and return the new tokens.

        Under `async_scheduling` a plain decode step returns the tokens of the step before it
        (launched by the previous call), so the GPU already has the next step when Python waits.
        """
        t0 = self._step_started = time.perf_counter()
        self._read = None
        if self.config.async_scheduling or self._inflight is not None:
            outs = self._step_async()
        else:
            batch = self.scheduler.schedule()
            if not batch:
                return self._outgrown()
            self._last_tokens = batch.num_tokens
            kv_tokens = _decode_kv_tokens(batch.items)
            outs = self._run_batch(batch.items)
            if kv_tokens:
                self._read = (kv_tokens, time.perf_counter() - t0)
        self.scheduler.step_time.observe(self._last_tokens, time.perf_counter() - t0)
        self._last_tokens = 0
        if self.scheduler.outgrown:
            outs = self._outgrown() + outs
        return outs

    def last_step_read(self) -> StepRead | None:
        """Bytes the latest decode step read (weights and its sequences' KV) and its time:
        from its start on the device (the previous step's end, when the steps ran back to back)
        to its end as the host saw it, so host time that left the device idle counts. None
        when the latest `step()` ran no decode step, or none whose start is known."""
        if self._read is None:
            return None
        kv_tokens, seconds = self._read
        return StepRead(self._weight_bytes + kv_tokens * self._kv_token_bytes, seconds)

    def _outgrown(self) -> list[StepOutput]:
        """Sequences the scheduler ended because even the whole pool cannot hold them."""
        ended, self.scheduler.outgrown = self.scheduler.outgrown, []
        for seq in ended:
            self.seqs.pop(seq.seq_id, None)
            log.warning(
                "sequence %s stopped at %d tokens (finish reason length): one sequence cannot "
                "hold more than the KV pool's %d blocks of %d tokens",
                seq.seq_id,
                seq.num_tokens,
                self.pool.num_blocks,
                self.config.block_size,
            )
        return [StepOutput(seq, [], [], True) for seq in ended]

    def _run_batch(self, items: list[tuple[Sequence, int]]) -> list[StepOutput]:
        """Execute, sample and update one scheduled batch, step by step (no overlap)."""
        seqs = [s for s, _ in items]
        if any(s.spec_tokens for s in seqs):
            return self._step_speculative(items)
        scoring = plan_prompt_scoring(items)
        logits = self.runner.execute(items, scoring=scoring)
        if scoring is not None:
            scoring.record()
        # A sequence finishing its prompt (or a decode step) samples; one that computed only a
        # chunk of its prompt does not (nor does it draw from its generator).
        done = [(i, (s, n)) for i, (s, n) in enumerate(items) if s.num_computed + n >= s.num_tokens]
        if len(done) < len(items):
            for seq, n in items:
                if seq.num_computed + n < seq.num_tokens:
                    seq.num_computed += n
            if not done:
                return []
            logits = logits[
                torch.tensor([i for i, _ in done], dtype=torch.long, device=logits.device)
            ]
            items = [it for _, it in done]
            seqs = [s for s, _ in items]
        # The forward is queued on the device; the masks are filled on the host meanwhile.
        bitmask, mask_rows = self._masks(seqs)
        hist, gen = self._sample_inputs(seqs)
        token_ids, logprobs = sample(
            logits,
            [s.params for s in seqs],
            [s.generator for s in seqs],
            hist,
            gen,
            bitmask,
            mask_rows,
        )
        outs: list[StepOutput] = []
        for (seq, n), tok, lp in zip(items, token_ids, logprobs, strict=True):
            scored = self._prompt_scores(seq)
            seq.num_computed += n
            self._accept(seq, tok)
            seq.output_token_ids.append(tok)
            seq.output_logprobs.append(lp)
            reason = self._stop_reason(seq, tok)
            if seq.prefill_only:
                # The prompt's KV (not the sampled token's, which is not computed yet) is leased
                # to the decode worker; the rest of the sequence's life is there.
                blocks = self.scheduler.finish(seq, reason or "prefilled", keep_blocks=True)
                seq.lease_id = self.leases.grant(
                    blocks,
                    seq.num_computed,
                    name=seq.seq_id,
                    token_ids=seq.all_token_ids[: seq.num_computed],
                ).lease_id
                self.seqs.pop(seq.seq_id, None)
                reason = reason or "prefilled"
            elif reason is not None:
                self.scheduler.finish(seq, reason)
                self.seqs.pop(seq.seq_id, None)
            outs.append(StepOutput(seq, [tok], [lp], reason is not None, scored))
        return outs

    # ---- asynchronous scheduling ---------------------------------------------------------
    def _step_async(self) -> list[StepOutput]:
        """Launch the next decode step, then read the step in flight; returns its tokens.

        A batch that cannot run ahead (a prompt, draft tokens, logprobs, a repetition penalty)
        first waits for the step in flight; it is then scheduled again by the next call.
        """
        prev, self._inflight = self._inflight, None
        batch = self.scheduler.schedule()
        # A sequence whose pending token is its last (length limit) needs no further step.
        items = [(s, n) for s, n in batch.items if not (s.num_pending and self._ends_by_length(s))]
        if items and self._can_run_ahead(items):
            self._inflight, outs = self._launch(items, prev)
            self._last_tokens = len(items)
            return outs
        if prev is not None:
            return self._collect(prev)
        self._last_tokens = batch.num_tokens
        if not batch:
            return []
        kv_tokens = _decode_kv_tokens(batch.items)
        outs = self._run_batch(batch.items)
        if kv_tokens:
            self._read = (kv_tokens, time.perf_counter() - self._step_started)
        return outs

    def _ends_by_length(self, seq: Sequence) -> bool:
        """True when the sequence is at its length limit once its pending tokens are read."""
        return (
            len(seq.output_token_ids) + seq.num_pending >= seq.params.max_tokens
            or seq.num_tokens >= self.max_model_len
        )

    @staticmethod
    def _can_run_ahead(items: list[tuple[Sequence, int]]) -> bool:
        return all(
            n == 1
            and not s.spec_tokens
            and not s.prefill_only
            and s.params.logprobs is None
            and not s.params.penalized
            for s, n in items
        )

    def _launch(
        self, items: list[tuple[Sequence, int]], prev: _InFlight | None
    ) -> tuple[_InFlight, list[StepOutput]]:
        """Enqueue forward + sampling of a decode batch and an asynchronous copy of its ids;
        returns it with the outputs of the step `prev` (read once this one is enqueued).

        A batch with constrained sequences needs their grammars advanced by the tokens of
        `prev` before its masks exist: the forward is enqueued first, `prev` is read while the
        device runs it, the masks are filled, and only the sampling waits for them.
        """
        started, collects = time.perf_counter(), prev is not None
        rows: list[int] = []
        prev_rows: list[int] = []
        for j, (seq, _) in enumerate(items):
            if seq.num_pending:  # its input token is the one `prev` sampled
                assert prev is not None, "a pending token without a step in flight"
                rows.append(j)
                prev_rows.append(prev.rows[seq.seq_id])
        pending = (rows, prev_rows, prev.ids) if rows else None
        logits = self.runner.execute(items, pending=pending)
        seqs = [s for s, _ in items]
        params = [s.params for s in seqs]
        outs: list[StepOutput] = []
        bitmask, mask_rows = None, []
        if any(s.matcher is not None for s in seqs):
            outs = self._collect(prev) if prev is not None else []
            prev = None
            # A sequence that finished with `prev` (its grammar complete) still has its row in
            # this step; its token is dropped on collection, so it needs no mask.
            bitmask, mask_rows = self._masks([s for s in seqs if not s.is_finished], seqs)
        ids = sample_ids(
            logits,
            params,
            [s.generator for s in seqs],
            [()] * len(seqs),
            bitmask=bitmask,
            mask_rows=mask_rows,
        )
        kv_tokens = 0
        for seq in seqs:
            seq.num_computed += 1
            seq.num_pending += 1
            kv_tokens += seq.num_computed
        host = self._ring[self._ring_next][: len(items)]
        self._ring_next ^= 1
        event = None
        if ids.is_cuda and self._copy_stream is not None:
            self._copy_stream.wait_stream(torch.cuda.current_stream(ids.device))
            with torch.cuda.stream(self._copy_stream):
                host.copy_(ids, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            ids.record_stream(self._copy_stream)  # not reused before the copy has read it
        elif ids.is_cuda:
            host.copy_(ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host.copy_(ids)
        step = _InFlight(
            items, ids, host, event, {s.seq_id: j for j, s in enumerate(seqs)}, kv_tokens
        )
        if prev is not None:
            outs = self._collect(prev)
        if event is None:  # a CPU step ran within this call: its time is the call's
            self._read = (kv_tokens, time.perf_counter() - started)
        elif collects:  # `prev` was seen to end while this step was queued behind it
            step.queued_at = self._collected_at
        return step, outs

    def _collect(self, step: _InFlight) -> list[StepOutput]:
        """Wait for a launched step's tokens and apply them (stop checks, finishing)."""
        if step.event is not None:
            step.event.synchronize()
        self._collected_at = time.perf_counter()
        if step.queued_at is not None:
            self._read = (step.kv_tokens, self._collected_at - step.queued_at)
        outs: list[StepOutput] = []
        for (seq, _), tok in zip(step.items, step.host.tolist(), strict=True):
            if seq.is_finished or seq.num_pending == 0:
                continue  # finished (stop token, abort) while this step was in flight
            seq.num_pending -= 1
            self._accept(seq, tok)
            seq.output_token_ids.append(tok)
            seq.output_logprobs.append(None)
            reason = self._stop_reason(seq, tok)
            if reason is not None:
                seq.num_pending = 0  # a later step's token for it is dropped
                self.scheduler.finish(seq, reason)
                self.seqs.pop(seq.seq_id, None)
            outs.append(StepOutput(seq, [tok], [None], reason is not None))
        return outs

    def _step_speculative(self, items: list[tuple[Sequence, int]]) -> list[StepOutput]:
        """One target forward that also scores every sequence's draft tokens (k + 1 positions)."""
        counts = [1 + len(s.spec_tokens) for s, _ in items]
        scoring = plan_prompt_scoring(items)
        logits = self.runner.execute(items, counts, scoring=scoring)
        if scoring is not None:
            scoring.record()
        outs: list[StepOutput] = []
        row = 0
        # Rows sampled plainly: decodes without drafts and prompts completed by this step (a prompt
        # chunk that leaves more of its prompt for later steps samples nothing).
        partial = {i for i, (s, n) in enumerate(items) if s.num_computed + n < s.num_tokens}
        plain = [(i, s) for i, (s, _) in enumerate(items) if not s.spec_tokens and i not in partial]
        plain_rows = []
        for i, ((seq, _), c) in enumerate(zip(items, counts, strict=True)):
            if not seq.spec_tokens and i not in partial:
                plain_rows.append(row)
            row += c
        sampled: dict[int, tuple[int, TokenLogprobs | None]] = {}
        if plain:
            plain_seqs = [s for _, s in plain]
            bitmask, mask_rows = self._masks(plain_seqs)
            hist, gen = self._sample_inputs(plain_seqs)
            toks, lps = sample(
                logits[torch.tensor(plain_rows, device=logits.device)],
                [s.params for s in plain_seqs],
                [s.generator for s in plain_seqs],
                hist,
                gen,
                bitmask,
                mask_rows,
            )
            sampled = {i: (t, lp) for (i, _), t, lp in zip(plain, toks, lps, strict=True)}
        row = 0
        for i, ((seq, n), c) in enumerate(zip(items, counts, strict=True)):
            draft = seq.spec_tokens
            if i in partial:
                seq.num_computed += n
                row += c
                continue
            if draft:
                masks = None
                if seq.matcher is not None:
                    assert self._grammars is not None
                    masks = self._grammars.draft_masks(seq.matcher, draft)
                new, new_lps = accept_draft_tokens(
                    logits[row : row + c],
                    draft,
                    seq.params,
                    seq.generator,
                    seq.all_token_ids,
                    seq.output_token_ids,
                    masks,
                )
                seq.spec_proposed += len(draft)
                seq.spec_accepted += len(new) - 1
                # KV is valid for the sequence's pending token and the accepted drafts.
                seq.num_computed += n - len(draft) + (len(new) - 1)
            else:
                tok, lp = sampled[i]
                new, new_lps = [tok], [lp]
                seq.num_computed += n
            row += c
            seq.spec_tokens = []
            scored = self._prompt_scores(seq)
            reason = None
            emitted: list[int] = []
            emitted_lps: list[TokenLogprobs | None] = []
            for tok, lp in zip(new, new_lps, strict=True):
                self._accept(seq, tok)
                seq.output_token_ids.append(tok)
                seq.output_logprobs.append(lp)
                emitted.append(tok)
                emitted_lps.append(lp)
                reason = self._stop_reason(seq, tok)
                if reason is not None:
                    break  # a stop inside the accepted run ends the sequence right there
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self.seqs.pop(seq.seq_id, None)
            outs.append(StepOutput(seq, emitted, emitted_lps, reason is not None, scored))
        return outs

    def set_proposals(self, proposals: dict[str, list[int]]) -> None:
        """Attach draft tokens to running sequences for the next step (capped by their limits)."""
        for sid, toks in proposals.items():
            seq = self.seqs.get(sid)
            if seq is None or seq.status is not SequenceStatus.RUNNING or not toks:
                continue
            room = min(
                seq.params.max_tokens - len(seq.output_token_ids) - 1,
                self.max_model_len - seq.num_tokens - 1,
            )
            toks = [int(t) for t in toks[: max(0, room)]]
            if seq.matcher is not None:
                if seq.num_pending:
                    continue  # its grammar has not read the token in flight yet
                assert self._grammars is not None
                toks = self._grammars.draft_prefix(seq.matcher, toks)
            seq.spec_tokens = toks

    @staticmethod
    def _prompt_scores(seq: Sequence) -> list[TokenLogprobs | None] | None:
        """The prompt logprobs to report with the token this step samples for `seq`: the full
        list with its first token (called before that token is appended), else None."""
        if seq.params.prompt_logprobs is None or seq.output_token_ids:
            return None
        return list(seq.prompt_logprobs)

    @staticmethod
    def _accept(seq: Sequence, tok: int) -> None:
        """Advance the sequence's grammar by its new token (sampled under the grammar's mask)."""
        if seq.matcher is not None and not seq.matcher.is_terminated():
            if not seq.matcher.accept_token(tok):
                raise RuntimeError(f"sampled token {tok} is outside the sequence's grammar")

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if seq.matcher is not None and seq.matcher.is_terminated():
            return "stop"  # the grammar is complete: nothing may follow
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return "stop"
        known = len(seq.prompt_token_ids) + len(seq.output_token_ids)  # pending tokens aside
        if len(seq.output_token_ids) >= p.max_tokens or known >= self.max_model_len:
            return "length"
        return None

    def tenant_stats(self) -> list[dict[str, float | int | str]]:
        """Per tenant (with tenant quotas; else empty): blocks charged and quota, prefix-cache
        hit ratio, evictions and refusals. Plain reads, safe from another thread for metrics."""
        pool, cache = self.pool, self.prefix_cache
        if not pool.has_quotas:
            return []
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
        return out

    # ---- what services ask of the engine ------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the engine's state (call it on the engine thread)."""
        pc, pool, cfg = self.prefix_cache, self.pool, self.config
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
        )

    def lease(self, lease_id: str | None) -> Lease | None:
        """The live lease of a prefilled request (by its id inside this process), or None."""
        return self.leases.leases.get(lease_id) if lease_id else None

    def lease_by_token(self, token: str) -> Lease | None:
        """The live lease a peer's token names; None when unknown, released or expired."""
        return self.leases.get(token)

    def leases_owned_by(self, owner: str) -> int:
        """Live leases counted against `owner` (a per-peer limit)."""
        return self.leases.owned_by(owner)

    def release_lease(self, lease_id: str) -> bool:
        """Give a lease's blocks back (by its id inside this process); False when unknown."""
        return self.leases.release(lease_id)

    def release_lease_token(self, token: str) -> bool:
        """Give back the lease a peer's token names; False when it names no live lease."""
        return self.leases.release_token(token)

    def withhold(self, request_id: str) -> bool:
        """Forget a request without freeing its blocks: a transfer that could not be cancelled
        may still write into them, so they stay out of circulation. False when unknown."""
        return self.seqs.pop(request_id, None) is not None

    @property
    def kv_device(self) -> torch.device:
        """Where this engine's KV pool lives."""
        return self.kv.data.device

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)


def _decode_kv_tokens(items: list[tuple[Sequence, int]]) -> int:
    """Tokens of KV a batch's step reads when every sequence computes one token (a decode
    step: each reads its whole KV, the new token's included); 0 for a batch with a prompt."""
    total = 0
    for seq, n in items:
        if n != 1:
            return 0
        total += seq.num_computed + 1
    return total
