"""The engine of one worker: schedule -> execute -> sample -> update, one step at a time.

`LLMEngine.step` is the loop body. The engine builds its parts and hands each what it uses
(constructor arguments, nothing of the engine itself):

- `scheduler` (`scheduler.py`, behind `SchedulerInterface`): who runs this step;
- `runner` (`model_runner.py`): a scheduled batch packed and run through the model;
- `admission` (`admission.py`): requests in: validation, queueing, sequences prefilled elsewhere;
- `sample_inputs` (`sample_inputs.py`): grammar masks and penalty histories for sampling;
- `recorder` (`step_output.py`): a sampled token applied to its sequence, stop checks;
- `async_step` (`async_step.py`): decode steps launched ahead;
- `spec_step` (`spec_step.py`): draft tokens verified;
- `reporting` (`reporting.py`): stats, tenants, step reads.

The parts share the engine's map of live sequences (`seqs`) and the KV pool, each given them
explicitly. The methods services call (`add_request`, `abort`, `stats`, ...) stay here and
hand over to the part that does the work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Ids
from typing import Any

import numpy as np
import torch

from tandem import progress
from tandem.api.sampling_params import SamplingParams
from tandem.config import EngineConfig, set_kernel_config
from tandem.device import resolved_device, resolved_dtype, resolved_kv_dtype
from tandem.engine.admission import Admission, PromptIds, Reservation
from tandem.engine.async_step import AsyncStep
from tandem.engine.model_runner import ModelRunner
from tandem.engine.prompt_logprobs import plan_prompt_scoring
from tandem.engine.reporting import Reporting, decode_kv_tokens
from tandem.engine.roofline import StepRead, kv_bytes_per_token, weight_bytes
from tandem.engine.sample_inputs import SampleInputs
from tandem.engine.sampler import sample
from tandem.engine.scheduler import ScheduledBatch, Scheduler
from tandem.engine.scheduler_interface import SchedulerInterface
from tandem.engine.sequence import Sequence
from tandem.engine.spec_step import SpeculativeStep
from tandem.engine.stats import EngineStats
from tandem.engine.step_output import StepOutput, TokenRecorder
from tandem.host_copy import device_tensor
from tandem.kv.block_pool import BlockPool
from tandem.kv.cache import KVCache
from tandem.kv.host_tier import HostTier
from tandem.kv.layout import DTYPE_NAMES, PoolLayout
from tandem.kv.lease import Lease, LeaseTable
from tandem.kv.prefix_cache import PrefixCache
from tandem.kv.sizing import (
    DEFAULT_KV_GB,
    DeviceMemory,
    ModelShape,
    activation_bytes,
    auto_sized,
    gpu_kv_bytes,
)
from tandem.model.info import context_length
from tandem.model.llama import LlamaModel
from tandem.model.loader import LoadedModel, prepare_weights
from tandem.tenants import quota_blocks

log = logging.getLogger("tandem.engine")


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
    """Model, KV pool, scheduler and sampler of one worker, and the parts that use them."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        kv: KVCache | None = None,
        lease_ttl_s: float = 30.0,
        kv_share: float = 1.0,
    ) -> None:
        """`kv_share`: of the memory a GPU pool sized by gpu_memory_utilization may take, the
        part this engine's pool takes (the rest: a draft model's pool of as many blocks)."""
        self.config = config
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        device = resolved_device(config)
        use_cuda_device(device)
        dtype = resolved_dtype(config)
        mc = loaded.config
        self.max_model_len = context_length(config.max_model_len, mc.max_position_embeddings)
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
            kv_bytes = None
            if auto_sized(config) and device.type == "cuda":
                kv_bytes = self._gpu_kv_bytes(config, device, dtype, kv_share)
            layout = self.pool_layout(loaded, config, kv_bytes)
            kv = KVCache.allocate(
                mc.num_layers,
                layout.num_blocks,
                config.block_size,
                mc.num_kv_heads,
                mc.head_dim,
                resolved_kv_dtype(config),
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
        # Host-memory tier behind the prefix cache: none unless kv_host_cache_gb is set.
        self.host_tier: HostTier | None = None
        if config.kv_host_cache_gb > 0 and self.prefix_cache is not None:
            self.host_tier = HostTier.sized(self.kv, self.pool, config.kv_host_cache_gb, fractions)
            self.prefix_cache.host = self.host_tier
            progress.report(
                f"KV host tier: {self.host_tier.num_slots} blocks "
                f"({self.host_tier.num_slots * self.host_tier.block_bytes / 2**20:.0f} MiB)"
            )
        self.leases = LeaseTable(self.pool, lease_ttl_s)
        t_graphs = time.perf_counter()
        self.runner = ModelRunner(
            self.model,
            self.kv,
            cuda_graphs=config.cuda_graphs,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        if self.runner.graphs is not None:
            graphs = self.runner.graphs
            progress.report(
                f"CUDA graphs captured: decode batches of 1 to {graphs.max_batch} sequences "
                f"({len(graphs.graphs)} sizes, {time.perf_counter() - t_graphs:.1f} s)"
            )
        if device.type == "cuda":
            # What the capture's warm-up runs and the autotuner freed goes back to the device
            # (another worker on it sized its pool from what was free).
            torch.cuda.empty_cache()
        self.scheduler: SchedulerInterface = Scheduler(
            self.pool,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            prefill_chunk=config.prefill_chunk,
            prefix_cache=self.prefix_cache,
            tpot_slo_s=config.tpot_slo_ms / 1e3 if config.tpot_slo_ms else None,
        )
        self.device = device
        # Every live sequence by id: admission adds them, the steps drop those that finish.
        self.seqs: dict[str, Sequence] = {}
        self.eos_token_ids = set(mc.eos_token_ids) | set(loaded.tokenizer.eos_token_ids)
        self.sample_inputs = SampleInputs(
            loaded.tokenizer,
            mc.vocab_size,
            self.eos_token_ids,
            self.max_model_len,
            grammar_cache_bytes=config.grammar_cache_mb << 20,
            grammar_compile_timeout_s=config.grammar_compile_timeout_s,
            pin_memory=device.type == "cuda",
            grammar_token_budget_s=config.grammar_token_budget_ms / 1e3,
        )
        self.recorder = TokenRecorder(
            self.eos_token_ids, self.max_model_len, config.grammar_token_budget_ms / 1e3
        )
        self.admission = Admission(
            config,
            mc.vocab_size,
            self.max_model_len,
            device,
            self.pool,
            self.prefix_cache,
            self.scheduler,
            self.seqs,
            self.tenant_refusals,
            self.sample_inputs,
        )
        # Memory traffic of decode steps (tandem.engine.roofline): fixed bytes per step and KV
        # bytes per token; the steps note what the latest one read in `reporting.read`.
        self.reporting = Reporting(
            config,
            self.pool,
            self.prefix_cache,
            self.scheduler,
            self.leases,
            self.tenant_refusals,
            weight_bytes(self.model),
            kv_bytes_per_token(self.kv),
        )
        self.spec_step = SpeculativeStep(
            self.runner,
            self.scheduler,
            self.seqs,
            self.max_model_len,
            self.sample_inputs,
            self.recorder,
        )
        self.async_step = AsyncStep(
            self.runner,
            self.scheduler,
            self.seqs,
            self.max_model_len,
            self.sample_inputs,
            self.recorder,
            self.reporting,
            config.max_num_seqs,
            device,
        )
        self._last_tokens = 0  # tokens computed by the step being timed
        self._last_round: float | None = None  # when the latest round of decode tokens came
        self._mixed = False
        self._step_started = 0.0  # perf_counter() when the latest step() began
        # The latest step had nothing to run: no sequence runs or fits, none was preempted, no
        # step is in flight. Until blocks are freed from outside (a lease released or expired,
        # an import started or aborted) the next step would find the same.
        self.blocked = False

    def _gpu_kv_bytes(
        self, config: EngineConfig, device: torch.device, dtype: torch.dtype, share: float
    ) -> int:
        """The KV pool's bytes on a GPU when no size is given (tandem/kv/sizing.py), the
        weights already on the device."""
        mc = self.model_config
        torch.cuda.empty_cache()  # what loading the weights left cached is free, not this pool's
        free, total = torch.cuda.mem_get_info(device)
        mem = DeviceMemory(total, free, torch.cuda.memory_reserved(device))
        shape = ModelShape(mc.hidden_size, mc.intermediate_size, mc.num_heads,
                           mc.num_kv_heads, mc.head_dim, mc.vocab_size)  # fmt: skip
        acts = activation_bytes(shape, config.max_num_batched_tokens, config.max_num_seqs,
                                torch.empty((), dtype=dtype).element_size())  # fmt: skip
        nbytes, why = gpu_kv_bytes(mem, config.gpu_memory_utilization, acts)
        if share < 1:
            nbytes, why = int(nbytes * share), f"{share:g} of ({why}; the rest: the draft's)"
        progress.report(f"KV pool sized from device memory: {nbytes / 2**30:.1f} GiB ({why})")
        return nbytes

    @staticmethod
    def pool_layout(loaded: LoadedModel, config: EngineConfig, kv_bytes: int | None = None):
        """The layout `__init__` would give this worker's KV pool (to allocate it elsewhere):
        config.num_blocks, else `kv_bytes` (a GPU pool sized from device memory), else
        config.kv_cache_memory_gb (unset: DEFAULT_KV_GB)."""
        mc = loaded.config
        dtype = resolved_kv_dtype(config)
        num_blocks = config.num_blocks
        if num_blocks is None:
            per_block = KVCache.bytes_per_block(
                mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim, dtype
            )
            if kv_bytes is None:
                gb = config.kv_cache_memory_gb
                kv_bytes = int((DEFAULT_KV_GB if gb is None else gb) * 2**30)
            num_blocks = max(1, kv_bytes // per_block)
        return PoolLayout(
            mc.num_layers,
            num_blocks,
            config.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            DTYPE_NAMES[dtype],
        )

    # ---- the loop -------------------------------------------------------------------------
    @property
    def async_scheduling(self) -> bool:
        """The config's setting, None resolved for this engine's device."""
        on = self.config.async_scheduling
        return self.device.type == "cuda" if on is None else on

    def step(self) -> list[StepOutput]:
        """Run one batched forward for every scheduled sequence and return the new tokens.

        Under `async_scheduling` a step that runs ahead (decodes, prompt chunks) returns the
        tokens of the step before it (launched by the previous call), so the GPU already has
        the next step when Python waits.
        """
        t0 = self._step_started = time.perf_counter()
        reporting = self.reporting
        reporting.read = None
        self._mixed = False  # whether the step whose tokens this call returns had prompt tokens
        self.blocked = False
        if self.async_scheduling or self.async_step.inflight is not None:
            outs = self._step_async()
        else:
            batch = self.scheduler.schedule()
            if not batch:
                self.blocked = self._blocked(batch)
                return self._outgrown()
            self._last_tokens = batch.num_tokens
            self._mixed = self.scheduler.mixed
            kv_tokens = decode_kv_tokens(batch.items)
            outs = self._run_batch(batch.items)
            if kv_tokens:
                reporting.read = (kv_tokens, time.perf_counter() - t0)
        now = time.perf_counter()
        self.scheduler.step_time.observe(self._last_tokens, now - t0)
        self._last_tokens = 0
        self._pace(outs, now)
        if self.scheduler.outgrown:
            outs = self._outgrown() + outs
        return outs

    def _step_async(self) -> list[StepOutput]:
        """Launch the next step, then read the step in flight; returns its tokens.

        A batch that cannot run ahead (draft tokens, prompt logprobs, a prompt for another
        worker) first waits for the step in flight; it is then scheduled again by the next
        call.
        """
        ahead = self.async_step
        prev, ahead.inflight = ahead.inflight, None
        batch = self.scheduler.schedule()
        # A sequence whose pending token is its last (length limit) needs no further step.
        ends = ahead.ends_by_length
        items = [(s, n) for s, n in batch.items if not (s.num_pending and ends(s))]
        if items and ahead.can_run_ahead(items):
            ahead.inflight, outs = ahead.launch(items, prev)
            ahead.inflight.tokens = sum(n for _, n in items)
            ahead.inflight.mixed = self.scheduler.mixed
            # This call's time is mostly the wait for `prev`: its tokens are the ones timed.
            if prev is not None:
                self._last_tokens, self._mixed = prev.tokens, prev.mixed
            return outs
        if prev is not None:
            return ahead.collect(prev)
        self._last_tokens = batch.num_tokens
        if not batch:
            self.blocked = self._blocked(batch)
            return []
        self._mixed = self.scheduler.mixed
        kv_tokens = decode_kv_tokens(batch.items)
        outs = self._run_batch(batch.items)
        if kv_tokens:
            self.reporting.read = (kv_tokens, time.perf_counter() - self._step_started)
        return outs

    def _pace(self, outs: list[StepOutput], now: float) -> None:
        """Tell the scheduler how long this round of decode tokens (tokens after a sequence's
        first) came after the previous one, and how many a sequence got in it (more than one
        with draft tokens). A call that returns none ends the run of rounds, unless a step is in
        flight (asynchronous scheduling refilling its pipeline after a step that could not run
        ahead): the next round's time then counts from the last."""
        if self.scheduler.tpot_slo_s is None:
            return
        counts = [
            len(o.new_token_ids)
            for o in outs
            if o.new_token_ids and len(o.seq.output_token_ids) > len(o.new_token_ids)
        ]
        decoded = bool(counts)
        if decoded and self._last_round is not None:
            tokens = sum(counts) / len(counts)
            self.scheduler.pace(now - self._last_round, self._mixed, tokens)
        if decoded:
            self._last_round = now
        elif self.async_step.inflight is None:
            self._last_round = None

    def _blocked(self, batch: ScheduledBatch) -> bool:
        """True when an empty schedule leaves the engine as it found it (see `blocked`)."""
        return not batch and not batch.preempted and not self.scheduler.outgrown

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
            return self.spec_step.step(items)
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
            logits = logits[device_tensor([i for i, _ in done], torch.long, logits.device)]
            items = [it for _, it in done]
            seqs = [s for s, _ in items]
        # The forward is queued on the device; the masks are filled on the host meanwhile.
        inputs = self.sample_inputs
        bitmask, mask_rows = inputs.masks(seqs)
        hist, gen = inputs.histories(seqs)
        token_ids, logprobs = sample(
            logits,
            [s.params for s in seqs],
            [s.generator for s in seqs],
            hist,
            gen,
            bitmask,
            mask_rows,
            inputs.bans(seqs),
        )
        outs: list[StepOutput] = []
        append, prompt_scores = self.recorder.append, self.recorder.prompt_scores
        for (seq, n), tok, lp in zip(items, token_ids, logprobs, strict=True):
            scored = prompt_scores(seq)
            seq.num_computed += n
            reason = append(seq, tok, lp)
            if seq.prefill_only and reason != "error":
                # The prompt's KV (not the sampled token's, which is not computed yet) is leased
                # to the decode worker, with the names its prefix cache gave the full blocks;
                # the rest of the sequence's life is there.
                self.scheduler.cache_blocks(seq)
                full = seq.num_computed // seq.block_table.block_size
                names = seq.block_table.hashes[:full]
                blocks = self.scheduler.finish_request(seq, reason or "prefilled", keep_blocks=True)
                seq.lease_id = self.leases.grant(
                    blocks,
                    seq.num_computed,
                    name=seq.seq_id,
                    token_ids=seq.all_token_ids[: seq.num_computed],
                    names=b"".join(names) if len(names) == full else b"",
                ).lease_id
                self.seqs.pop(seq.seq_id, None)
                reason = reason or "prefilled"
            elif reason is not None:
                self.scheduler.finish_request(seq, reason)
                self.seqs.pop(seq.seq_id, None)
            outs.append(StepOutput(seq, [tok], [lp], reason is not None, scored))
        return outs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- requests in (admission) -----------------------------------------------------------
    def validate_request(
        self, prompt_token_ids: PromptIds, params: SamplingParams, tenant: str | None = None
    ) -> None:
        """Raise when a request cannot be served (`Admission.validate_request`)."""
        self.admission.validate_request(prompt_token_ids, params, tenant)

    def add_request(
        self,
        prompt_token_ids: PromptIds,
        params: SamplingParams,
        request_id: str | None = None,
        prefill_only: bool = False,
        tenant: str | None = None,
        matcher: Any = None,
    ) -> Sequence:
        """Validate and queue a request (`Admission.add_request`)."""
        return self.admission.add_request(
            prompt_token_ids, params, request_id, prefill_only, tenant, matcher
        )

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
        """Join a sequence prefilled elsewhere, its KV copied in now
        (`Admission.admit_prefilled`)."""
        return self.admission.admit_prefilled(
            prompt_token_ids,
            first_token,
            params,
            request_id,
            copy_in,
            rng_state,
            tenant,
            block_names,
            matcher,
            queue_when_full,
        )

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
        """Blocks for a sequence prefilled elsewhere whose KV arrives later
        (`Admission.reserve_prefilled`)."""
        return self.admission.reserve_prefilled(
            prompt_token_ids,
            first_token,
            params,
            request_id,
            rng_state,
            peer_blocks,
            tenant,
            block_names,
            matcher,
            queue_when_full,
        )

    def start_prefilled(self, request_id: str) -> bool:
        """A reserved sequence's KV is in: it joins (`Admission.start_prefilled`)."""
        return self.admission.start_prefilled(request_id)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks; False when it is unknown."""
        return self.admission.abort(request_id)

    def reserve(
        self,
        prompt_token_ids: PromptIds,
        request_id: str,
        ttl_s: float,
        tenant: str | None = None,
        block_names: list[bytes] | None = None,
    ) -> Reservation | None:
        """Hold blocks for a prompt whose KV another worker pushes (`Admission.reserve`)."""
        return self.admission.reserve(
            prompt_token_ids, request_id, ttl_s, tenant, block_names=block_names
        )

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
        """Start a sequence whose KV was pushed into its reservation (`Admission.admit_reserved`)."""
        return self.admission.admit_reserved(
            request_id, token, prompt_token_ids, first_token, params, rng_state, matcher
        )

    def unreserve(self, token: str, write_may_be_in_flight: bool = False) -> bool:
        """Give a reservation back (`Admission.unreserve`)."""
        return self.admission.unreserve(token, write_may_be_in_flight)

    def expire_reservations(self) -> int:
        """Give back the blocks of reservations past their expiry; returns how many."""
        return self.admission.expire_reservations()

    def reservation_stats(self) -> tuple[int, int]:
        """(reservations outstanding, blocks they hold)."""
        return len(self.admission.reservations), self.admission.reserved_blocks

    async def prepare_matcher(
        self,
        prompt_token_ids: Ids[int] | np.ndarray,
        params: SamplingParams,
        replay: Ids[int] = (),
    ) -> Any:
        """The grammar matcher of a constrained request (None when unconstrained), compiled on
        the grammar pool's threads within its time and size budgets and replayed off the engine
        thread, for a server to hand to `add_request`, `admit_prefilled` or
        `reserve_prefilled` (`matcher=`): the running batch never waits for a grammar. Call it
        from an event loop, on any thread but the engine's. The request is checked first (the
        engine's own checks, but its pool's), so that nothing is compiled or replayed for one
        that would be refused."""
        return await self.sample_inputs.prepare_matcher(prompt_token_ids, params, replay)

    def set_proposals(self, proposals: dict[str, list[int]]) -> None:
        """Attach draft tokens to running sequences for the next step
        (`SpeculativeStep.set_proposals`)."""
        self.spec_step.set_proposals(proposals)

    # ---- what the engine reports (reporting) ----------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the engine's state (call it on the engine thread)."""
        return self.reporting.stats()

    def tenant_stats(self) -> list[dict[str, float | int | str]]:
        """Per-tenant figures (`Reporting.tenant_stats`); safe from another thread."""
        return self.reporting.tenant_stats()

    def grammar_stats(self) -> dict[str, Any] | None:
        """The grammar pool's figures; None before the first constrained request. Plain reads,
        safe from another thread for metrics."""
        return self.sample_inputs.grammar_stats()

    def last_step_read(self) -> StepRead | None:
        """Bytes and time of the latest decode step (`Reporting.last_step_read`)."""
        return self.reporting.last_step_read()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- what services ask of the engine ------------------------------------------------
    def add_kv_listener(self, listener: Callable[[str, str, list[bytes]], None]) -> None:
        """Call `listener(kind, tier, hashes)` on the engine thread each time prefix-cache blocks
        are stored or evicted (`BlockPool.listeners`); it must not block."""
        self.pool.listeners.append(listener)

    def cached_block_hashes(self) -> dict[str, list[bytes]]:
        """The prefix-cache hash of every block each tier holds, by tier ("device", and "host"
        with a host tier); call it on the engine thread."""
        held = {"device": self.pool.cached_hashes()}
        if self.host_tier is not None:
            held["host"] = self.host_tier.hashes()
        return held

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
        """Give back the lease a peer's token names, from any thread and without waiting for a
        step to end: the lease ends now, its blocks are free for the step after the one running
        (`EngineLoop` reclaims them between steps). False when it names no live lease."""
        return self.leases.revoke_token(token)

    def withhold(self, request_id: str) -> bool:
        """Forget a request without freeing its blocks: a transfer that could not be cancelled
        may still write into them, so they stay out of circulation. False when unknown."""
        return self.seqs.pop(request_id, None) is not None

    @property
    def kv_device(self) -> torch.device:
        """Where this engine's KV pool lives."""
        return self.kv.data.device
