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
    from tandem.model.tokenizer import Tokenizer


class SampleInputs:
    """Grammar matchers, bitmasks and penalty histories: what sampling reads besides logits.

    Built with what a grammar compiler needs (the tokenizer, vocabulary size, end-of-sequence
    ids, its cache and time budgets, whether its masks go to pinned memory) and what a request
    check needs (the context length). The compiler is built on the first constrained request.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: set[int],
        max_model_len: int,
        grammar_cache_bytes: int,
        grammar_compile_timeout_s: float,
        pin_memory: bool,
        grammar_token_budget_s: float = float("inf"),
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.grammar_cache_bytes = grammar_cache_bytes
        self.grammar_compile_timeout_s = grammar_compile_timeout_s
        self.pin_memory = pin_memory
        self.grammar_token_budget_s = grammar_token_budget_s
        self.grammars: GrammarCompiler | None = None  # built on the first constrained request
        self._lock = threading.Lock()  # that request may come from another thread

    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler, built on the first constrained request (whichever
        thread it comes from)."""
        with self._lock:
            if self.grammars is None:
                self.grammars = GrammarCompiler(
                    self.tokenizer.hf,
                    self.vocab_size,
                    self.eos_token_ids,
                    cache_bytes=self.grammar_cache_bytes,
                    timeout_s=self.grammar_compile_timeout_s,
                    pin_memory=self.pin_memory,
                    token_budget_s=self.grammar_token_budget_s,
                )
            return self.grammars

    def matcher(self, params: SamplingParams, replay: Ids[int] = (), prepared: Any = None):
        """A grammar matcher for a constrained request (None when unconstrained): `prepared`
        when the caller made it (`prepare_matcher`), else compiled here."""
        if params.structured is None:
            return None
        if prepared is not None:
            return prepared
        return self.grammar_compiler().matcher(params.structured, replay)

    async def prepare_matcher(
        self,
        prompt_token_ids: Ids[int] | np.ndarray,
        params: SamplingParams,
        replay: Ids[int] = (),
    ) -> Any:
        """The grammar matcher of a constrained request (None when unconstrained), compiled on
        the grammar pool's threads within its time and size budgets and replayed off the engine
        thread (see `LLMEngine.prepare_matcher`)."""
        if params.structured is None:
            return None
        validate_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        grammars = self.grammars or await asyncio.to_thread(self.grammar_compiler)
        return await grammars.prepared_matcher(params.structured, replay)

    def grammar_stats(self) -> dict[str, Any] | None:
        """The grammar pool's figures (`GrammarPool.stats`); None before the first constrained
        request. Plain reads, safe from another thread for metrics."""
        grammars = self.grammars
        return grammars.pool.stats() if grammars is not None else None

    def masks(
        self, seqs: list[Sequence], batch: list[Sequence] | None = None
    ) -> tuple[torch.Tensor | None, list[int]]:
        """The structured-output bitmask (host side, one row per sequence of `batch`, default
        `seqs` itself) of the constrained sequences among `seqs`, and their rows. A sequence
        whose grammar took past its token budget is marked to fail (`Sequence.error`): it ends
        with the token sampled under this mask."""
        constrained = [s for s in seqs if s.matcher is not None]
        if not constrained:
            return None, []
        assert self.grammars is not None
        batch = batch if batch is not None else seqs
        row_of = {id(s): i for i, s in enumerate(batch)}
        rows = [row_of[id(s)] for s in constrained]
        mask, slow = self.grammars.bitmask([s.matcher for s in constrained], rows, len(batch))
        for j, why in slow.items():
            constrained[j].error = constrained[j].error or why
        return mask, rows

    def stop_ids(self, params: SamplingParams) -> list[int]:
        """The ids that end a sequence of `params`: its stop tokens, and end of sequence unless
        it ignores it. What `min_tokens` holds back."""
        ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            ids += self.eos_token_ids
        return ids

    def bans(self, seqs: list[Sequence]) -> list[tuple[int, list[int]]]:
        """(row, ids) for each sequence short of its `min_tokens` at the token about to be
        sampled (tokens sampled and not yet collected, `num_pending`, count as generated): the
        ids that would end it (`stop_ids`) are not sampled."""
        return [
            (i, self.stop_ids(s.params))
            for i, s in enumerate(seqs)
            if s.params.min_tokens and len(s.output_token_ids) + s.num_pending < s.params.min_tokens
        ]

    @staticmethod
    def histories(seqs: list[Sequence]) -> tuple[list, list | None]:
        """Histories for the repetition penalty and generated tokens for OpenAI's penalties."""
        hist = [s.penalty_history() if s.params.repetition_penalty != 1.0 else () for s in seqs]
        outs = None
        if any(s.params.frequency_penalty or s.params.presence_penalty for s in seqs):
            outs = [s.output_token_ids for s in seqs]
        return hist, outs
