"""What a step produced for each sequence, and how a sampled token is applied to its sequence:
its grammar advanced, the token recorded, the stop conditions checked."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tandem.api.logprobs import TokenLogprobs
from tandem.engine.grammar import too_slow
from tandem.engine.sequence import Sequence


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


class TokenRecorder:
    """Applies sampled tokens to their sequences: the grammar advanced, the token recorded, the
    stop conditions checked against the model's end-of-sequence ids and context length."""

    def __init__(
        self, eos_token_ids: set[int], max_model_len: int, grammar_token_budget_s: float
    ) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.grammar_token_budget_s = grammar_token_budget_s

    def append(self, seq: Sequence, tok: int, lp: TokenLogprobs | None) -> str | None:
        """Record a sampled token (and its logprobs) on its sequence; returns why the sequence
        ends with it ("stop", "length", "error": `Sequence.error` says why), or None."""
        self.accept(seq, tok)
        seq.output_token_ids.append(tok)
        seq.output_logprobs.append(lp)
        return self.stop_reason(seq, tok)

    @staticmethod
    def prompt_scores(seq: Sequence) -> list[TokenLogprobs | None] | None:
        """The prompt logprobs to report with the token this step samples for `seq`: the full
        list with its first token (called before that token is appended), else None."""
        if seq.params.prompt_logprobs is None or seq.output_token_ids:
            return None
        return list(seq.prompt_logprobs)

    def accept(self, seq: Sequence, tok: int) -> None:
        """Advance the sequence's grammar by its new token (sampled under the grammar's mask);
        past the token budget the sequence is marked to fail (`Sequence.error`)."""
        if seq.matcher is not None and not seq.matcher.is_terminated():
            t = time.thread_time()
            if not seq.matcher.accept_token(tok):
                raise RuntimeError(f"sampled token {tok} is outside the sequence's grammar")
            why = too_slow(time.thread_time() - t, self.grammar_token_budget_s, "accept a token")
            seq.error = seq.error or why

    def stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if seq.error is not None:
            return "error"
        if seq.matcher is not None and seq.matcher.is_terminated():
            return "stop"  # the grammar is complete: nothing may follow
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return "stop"
        known = len(seq.prompt_token_ids) + len(seq.output_token_ids)  # pending tokens aside
        if len(seq.output_token_ids) >= p.max_tokens or known >= self.max_model_len:
            return "length"
        return None
