"""What sampling takes besides the logits: the structured-output bitmask of constrained
sequences (their grammar matchers built on the first constrained request) and the token
histories the penalties read."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tandem.api.sampling_params import SamplingParams
from tandem.engine.grammar import GrammarCompiler
from tandem.engine.sequence import Sequence

if TYPE_CHECKING:
    from tandem.model.config import ModelConfig
    from tandem.model.tokenizer import Tokenizer


class SampleInputsMixin:
    """Grammar matchers, bitmasks and penalty histories, for `LLMEngine`."""

    tokenizer: Tokenizer
    model_config: ModelConfig
    eos_token_ids: set[int]
    device: torch.device
    _grammars: GrammarCompiler | None  # built on the first constrained request

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
