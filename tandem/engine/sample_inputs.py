"""What sampling takes besides the logits: the structured-output bitmask of constrained
sequences (their grammar matchers: compiled off the engine thread for a server, which prepares
them before the sequence joins) and the token histories the penalties read."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence as Ids
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tandem.api.sampling_params import SamplingParams
from tandem.api.validation import validate_request
from tandem.engine.grammar import GrammarCompiler
from tandem.engine.sequence import Sequence

if TYPE_CHECKING:
    from tandem.config import EngineConfig
    from tandem.model.config import ModelConfig
    from tandem.model.tokenizer import Tokenizer


class SampleInputsMixin:
    """Grammar matchers, bitmasks and penalty histories, for `LLMEngine`."""

    config: EngineConfig
    tokenizer: Tokenizer
    model_config: ModelConfig
    max_model_len: int
    eos_token_ids: set[int]
    device: torch.device
    _grammars: GrammarCompiler | None  # built on the first constrained request
    _grammars_lock: threading.Lock

    def _grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler, built on the first constrained request (whichever
        thread it comes from)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(
                    self.tokenizer.hf,
                    self.model_config.vocab_size,
                    self.eos_token_ids,
                    cache_bytes=self.config.grammar_cache_mb << 20,
                    timeout_s=self.config.grammar_compile_timeout_s,
                    pin_memory=self.device.type == "cuda",
                )
            return self._grammars

    def _matcher(self, params: SamplingParams, replay: Ids[int] = (), prepared: Any = None):
        """A grammar matcher for a constrained request (None when unconstrained): `prepared`
        when the caller made it (`prepare_matcher`), else compiled here."""
        if params.structured is None:
            return None
        if prepared is not None:
            return prepared
        return self._grammar_compiler().matcher(params.structured, replay)

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
        if params.structured is None:
            return None
        validate_request(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)
        grammars = self._grammars or await asyncio.to_thread(self._grammar_compiler)
        return await grammars.prepared_matcher(params.structured, replay)

    def grammar_stats(self) -> dict[str, Any] | None:
        """The grammar pool's figures (`GrammarPool.stats`); None before the first constrained
        request. Plain reads, safe from another thread for metrics."""
        grammars = self._grammars
        return grammars.pool.stats() if grammars is not None else None

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
