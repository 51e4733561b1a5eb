"""Structured output: xgrammar matchers per sequence, and their token bitmasks for the sampler.

A constrained sequence owns one `xgrammar.GrammarMatcher` (`Sequence.matcher`). Each step, after
the forward is launched, the host fills one bitmask row per constrained sequence (32 tokens per
int32, bit set = allowed) while the device runs the forward; the sampler
(`apply_token_bitmask` in `sampler.py`) unpacks the rows on the logits' device and sets the
disallowed logits to -inf; the sampled token is then accepted into the matcher. Under
asynchronous scheduling a constrained decode step runs ahead like any other: its forward is
enqueued, the previous step's tokens are read and accepted while the device runs it, and only
its sampling waits for the masks.

The matcher's state is a function of the tokens it accepted, so a worker that takes a sequence
over (the decode worker after the prefill worker's first token, or after a failover) replays
them into a fresh matcher; a preempted sequence keeps its matcher (its tokens stay).

Speculative decoding works under a grammar: `LLMEngine.set_proposals` keeps the longest prefix
of a draft that the grammar allows (the matcher accepts it and rolls back), and verification
masks each of the k + 1 positions with the grammar's state after the drafts before it, so the
accepted tokens are the ones plain constrained decoding would give (greedy: the same tokens).
JSON repeats its keys and punctuation, so prompt lookup drafts well there: on the default
model, four 200-token JSON-schema replies took 103 target steps instead of 200 with
`speculative="ngram"` (bench/structured.py --spec).

The grammar's end: once the matcher accepts a stop token it is terminated and the sequence
finishes with "stop" (whatever `ignore_eos` says: nothing may follow a complete grammar).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import torch

from tandem.api.sampling_params import StructuredOutput
from tandem.api.structured import (
    check_structured,
    choice_grammar,
    load_xgrammar,
    parse_choices,
    xgrammar_error,
)
from tandem.engine.grammar_pool import GrammarPool


def too_slow(seconds: float, budget_s: float, what: str, tokens: int = 1) -> str | None:
    """Why a sequence fails whose grammar took `seconds` to `what` for `tokens` tokens, or None
    within `budget_s` a token (grammar_token_budget_ms). A grammar's work for one token takes
    microseconds to a few milliseconds; an ambiguous grammar's (`s ::= s s | "a" | ""`) grows
    with every token it accepts, to a second a token within a hundred, and the sequence's whole
    batch waits for it. Timed in the engine thread's CPU time (`time.thread_time`): a thread
    that waited for a core or the GIL meanwhile is not counted against the request."""
    if seconds <= budget_s * max(tokens, 1):
        return None
    return (
        f"structured output: the grammar took {seconds * 1e3:.2f} ms to {what}; at most "
        f"{budget_s * 1e3:g} ms a token are allowed (grammar_token_budget_ms)"
    )


class GrammarCompiler:
    """Compiles `StructuredOutput`s for one tokenizer (off the engine thread, into a cache of
    `cache_bytes`, each compile within `timeout_s`: `tandem/engine/grammar_pool.py`) and makes
    their matchers and token bitmasks."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_bytes: int,
        timeout_s: float,
        pin_memory: bool = False,
        token_budget_s: float = float("inf"),
    ) -> None:
        xgr = load_xgrammar()
        self.vocab_size = vocab_size
        self.token_budget_s = token_budget_s
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(set(stop_token_ids))
        )
        # The pool caches compiled grammars itself, within its byte limit.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.pool = GrammarPool(self._compile, cache_bytes, timeout_s)
        self._xgr = xgr
        # Two bitmask buffers, used in turn (pinned for a GPU engine): allocating pinned memory
        # every step cost milliseconds on an H200 host, more than the filling. A buffer is
        # written again two steps later, by when the copy that read it has run (each step
        # waits for the one before it).
        self._pin = pin_memory
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._turn = 0

    def _buffer(self, batch: int) -> torch.Tensor:
        buf = self._buffers[self._turn]
        if buf is None or buf.shape[0] < batch:
            rows = 1 << (batch - 1).bit_length()  # room to grow: power-of-two rows
            words = (self.vocab_size + 31) // 32
            buf = torch.empty((rows, words), dtype=torch.int32, pin_memory=self._pin)
            self._buffers[self._turn] = buf
        self._turn ^= 1
        return buf[:batch]

    def _compile(self, so: StructuredOutput) -> Any:
        """`so` compiled against the vocabulary (ValueError when it is malformed)."""
        check_structured(so)
        c = self._compiler
        try:
            if so.kind == "json_schema":
                return c.compile_json_schema(so.spec, any_whitespace=False, strict_mode=True)
            if so.kind == "json_object":  # OpenAI's JSON mode: an object, not any JSON value
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if so.kind == "regex":
                return c.compile_regex(so.spec)
            if so.kind == "choice":
                return c.compile_grammar(choice_grammar(parse_choices(so.spec)))
            return c.compile_grammar(so.spec)
        except RuntimeError as e:  # a grammar that parses but does not compile: still its fault
            raise ValueError(
                f"structured output (response_format) {so.kind} cannot be compiled: {xgrammar_error(e)}"
            ) from None

    def matcher(self, so: StructuredOutput, replay: Sequence[int] = ()):
        """A fresh matcher for `so` that has accepted `so.accepted` and then `replay`, compiled
        on the calling thread (the in-process engine)."""
        return self._replayed(self.pool.compile(so), so, replay)

    async def prepared_matcher(self, so: StructuredOutput, replay: Sequence[int] = ()):
        """`matcher`, compiled on the pool's threads within its budgets and replayed on another
        thread, for a caller on an event loop (whose other requests go on meanwhile)."""
        compiled = await self.pool.compiled(so)
        return await asyncio.to_thread(self._replayed, compiled, so, replay)

    def _replayed(self, compiled: Any, so: StructuredOutput, replay: Sequence[int]):
        """A fresh matcher of `compiled` that has accepted `so.accepted` and then `replay`."""
        m = self._xgr.GrammarMatcher(compiled)
        for t in [*so.accepted, *replay]:
            if not m.accept_token(int(t)):
                raise ValueError(
                    f"token {t} does not continue the structured output grammar "
                    "(the sequence's tokens do not match its response_format)"
                )
        return m

    def draft_prefix(self, matcher: Any, draft: list[int]) -> list[int]:
        """The longest prefix of `draft` the grammar allows from the matcher's state (up to and
        including a token that completes it); the matcher is left as it was."""
        n = 0
        for t in draft:
            if matcher.is_terminated() or not matcher.accept_token(t):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return draft[:n]

    def draft_masks(self, matcher: Any, draft: Sequence[int]) -> torch.Tensor:
        """[len(draft) + 1, W] int32 on the host: row j holds the tokens allowed after the
        first j draft tokens (which `draft_prefix` checked), for verifying them; a row after a
        draft token that completes the grammar allows everything (a stop ends the sequence
        there). The matcher is left as it was."""
        words = (self.vocab_size + 31) // 32
        mask = torch.full((len(draft) + 1, words), -1, dtype=torch.int32)
        matcher.fill_next_token_bitmask(mask, 0)
        for j, t in enumerate(draft):
            if not matcher.accept_token(int(t)):
                matcher.rollback(j)
                raise RuntimeError(f"draft token {t} is outside the sequence's grammar")
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(mask, j + 1)
        matcher.rollback(len(draft))
        return mask

    def bitmask(
        self, matchers: Sequence[Any], rows: Sequence[int], batch: int
    ) -> tuple[torch.Tensor, dict[int, str]]:
        """[batch, ceil(V / 32)] int32 on the host (pinned for a GPU engine, so that its copy
        needs no synchronization): row `rows[j]` holds the tokens `matchers[j]` allows; the
        other rows are never applied. Valid until the next call but one. With it, {j: why} for
        each matcher past the token budget (`too_slow`).

        One matcher after another: on an H200 host, replaying 32 JSON-schema outputs, the 32
        fills took 0.11 ms in a loop and 0.39 ms through xgrammar's threaded batch matcher."""
        mask = self._buffer(batch)
        slow: dict[int, str] = {}
        t = time.thread_time()
        for j, (m, row) in enumerate(zip(matchers, rows, strict=True)):
            m.fill_next_token_bitmask(mask, row)
            now = time.thread_time()
            why = too_slow(now - t, self.token_budget_s, "find the allowed tokens")
            if why is not None:
                slow[j] = why
            t = now
        return mask, slow
