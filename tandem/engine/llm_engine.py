"""The engine loop: schedule -> execute -> sample -> update, one step at a time."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tandem.config import EngineConfig
from tandem.engine.model_runner import ModelRunner
from tandem.engine.sampler import TokenLogprobs, make_generator, sample
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import Sequence
from tandem.kv.block_pool import BlockPool
from tandem.kv.block_table import BlockTable
from tandem.kv.cache import KVCache
from tandem.model.llama import LlamaModel
from tandem.model.loader import LoadedModel


@dataclass
class StepOutput:
    """What one step produced for one sequence."""

    seq: Sequence
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finished: bool


class LLMEngine:
    """Model, KV pool, scheduler and sampler of one worker."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.config = config
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        device = config.resolved_device()
        dtype = config.resolved_dtype()
        mc = loaded.config
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.model = LlamaModel(mc, loaded.weights, dtype, device, max_positions=self.max_model_len)
        num_blocks = config.num_blocks
        if num_blocks is None:
            per_block = KVCache.bytes_per_block(
                mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim, dtype
            )
            num_blocks = max(1, int(config.kv_cache_memory_gb * 2**30) // per_block)
        self.kv = KVCache.allocate(
            mc.num_layers,
            num_blocks,
            config.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            dtype,
            device,
        )
        self.pool = BlockPool(num_blocks)
        self.runner = ModelRunner(self.model, self.kv)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens)
        self.device = device
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.eos_token_ids = set(mc.eos_token_ids) | set(loaded.tokenizer.eos_token_ids)

    # ---- requests -------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise `ValueError` naming the field when a request cannot be served."""
        vocab = self.model_config.vocab_size
        if not prompt_token_ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        for t in prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        params.validate(vocab)
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens; the model's context is {self.max_model_len} tokens "
                f"(prompt + output), so the prompt must be shorter than {self.max_model_len}"
            )
        bs = self.config.block_size
        need = (n + 1 + bs - 1) // bs
        if need > self.pool.num_blocks:
            raise ValueError(
                f"prompt has {n} tokens, needing {need} KV blocks; the pool has only "
                f"{self.pool.num_blocks} (raise num_blocks or kv_cache_memory_gb)"
            )

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Sequence:
        """Validate and queue a request; nothing is allocated when it is refused."""
        self.validate_request(prompt_token_ids, params)
        rid = request_id if request_id is not None else f"seq-{next(self._ids)}"
        if rid in self.seqs:
            raise ValueError(f"request id {rid!r} is already running")
        seq = Sequence(
            seq_id=rid,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            block_table=BlockTable(self.config.block_size),
            generator=None if params.greedy else make_generator(params.seed, self.device),
        )
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks; False when it is unknown."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one batched forward for every scheduled sequence and return the new tokens."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        items = batch.items
        logits = self.runner.execute(items)
        # A sequence finishing its prompt (or a decode step) samples; all rows here do, because
        # prompts are computed whole.
        seqs = [s for s, _ in items]
        token_ids, logprobs = sample(
            logits,
            [s.params for s in seqs],
            [s.generator for s in seqs],
            [s.all_token_ids if s.params.repetition_penalty != 1.0 else () for s in seqs],
        )
        outs: list[StepOutput] = []
        for (seq, n), tok, lp in zip(items, token_ids, logprobs, strict=True):
            seq.num_computed += n
            seq.output_token_ids.append(tok)
            seq.output_logprobs.append(lp)
            reason = self._stop_reason(seq, tok)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self.seqs.pop(seq.seq_id, None)
            outs.append(StepOutput(seq, [tok], [lp], reason is not None))
        return outs

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
