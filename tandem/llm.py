"""In-process API: `tandem.LLM(model).generate(prompts, sampling)` and `.stream(...)`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.api.detokenizer import IncrementalDetokenizer
from tandem.api.logprobs import TokenLogprobs
from tandem.api.sampling_params import SamplingParams
from tandem.config import EngineConfig
from tandem.device import resolved_dtype
from tandem.engine.llm_engine import LLMEngine
from tandem.model.loader import load_model

Prompt = str | Sequence[int]


@dataclass
class Completion:
    """A finished generation."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprobs | None] | None = None
    stop_string: str | None = None
    # With `SamplingParams.prompt_logprobs`: one entry per prompt token, the first None.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # finish_reason "error": why the request failed (its structured output's grammar took
    # longer than grammar_token_budget_ms for a token).
    error: str | None = None


@dataclass
class CompletionChunk:
    """One streamed piece: new ids, their text, and the finish reason on the last chunk."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # The first chunk, with `SamplingParams.prompt_logprobs`: one entry per prompt token.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None  # the last chunk, finish_reason "error": why


class LLM:
    """Loads a model once and generates for batches of prompts with continuous batching."""

    def __init__(
        self,
        model: str | None = None,
        speculative: str | None = None,
        spec_k: int | None = None,
        **engine_options: Any,
    ) -> None:
        """`speculative`: None, or an in-process draft: "ngram" (prompt lookup), "self:N" (the
        first N layers), "self-int4" (the whole model quantized to INT4 g128), "self-int4:DIR" (a
        `tandem quantize` checkpoint of it) or the path of a smaller model with the same tokenizer.
        A draft model's KV pool gets as many blocks as the target's: on a GPU with no pool size
        given, the target's pool takes half the memory it would alone, the draft's the rest."""
        self.config = EngineConfig.from_options(model=model, **engine_options)
        loaded = load_model(self.config.model, resolved_dtype(self.config))
        draft_pool = speculative is not None and speculative != "ngram"
        self.engine = LLMEngine(loaded, self.config, kv_share=0.5 if draft_pool else 1.0)
        self.tokenizer = loaded.tokenizer
        self.speculator = None
        if speculative is not None:
            from tandem.engine.proposers import build_proposer
            from tandem.engine.speculator import Speculator, local_backend

            proposer = build_proposer(
                speculative, self.config, target=loaded, num_blocks=self.engine.kv.num_blocks
            )
            self.speculator = Speculator(local_backend(proposer), fixed_k=spec_k)

    def _step(self):
        if self.speculator is None:
            return self.engine.step()
        self.speculator.before_step(self.engine)
        outs = self.engine.step()
        self.speculator.after_step(outs)
        return outs

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Strings are tokenized (with BOS where the tokenizer adds one); id lists pass through."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: it must hold at least one token")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence):
            return list(prompt)
        raise ValueError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        )

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Generate for every prompt (batched continuously); results in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if isinstance(sampling, list):
            if len(sampling) != len(prompts):
                raise ValueError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts")
            params = sampling
        else:
            params = [sampling or SamplingParams()] * len(prompts)
        encoded = [self.encode_prompt(p) for p in prompts]
        # Validate all before queueing any, so a bad prompt leaves nothing half-allocated.
        for ids, sp in zip(encoded, params, strict=True):
            self.engine.validate_request(ids, sp)
        seqs: list = [None] * len(encoded)
        detoks = [
            IncrementalDetokenizer(self.tokenizer, ids, sp.stop, min_tokens=sp.min_tokens)
            for ids, sp in zip(encoded, params, strict=True)
        ]
        by_id: dict[str, int] = {}
        todo = iter(range(len(encoded)))
        nxt = next(todo, None)
        limit = self.config.max_queued_seqs
        try:
            while True:
                # Feed the queue as it drains, so any number of prompts fits its bound.
                while nxt is not None and self.engine.num_waiting < limit:
                    seq = self.engine.add_request(encoded[nxt], params[nxt])
                    seqs[nxt] = seq
                    by_id[seq.seq_id] = nxt
                    nxt = next(todo, None)
                if not self.engine.has_unfinished():
                    break
                for out in self._step():
                    d = detoks[by_id[out.seq.seq_id]]
                    # Only a stop string needs the text while generating; the others are decoded
                    # once at the end: decoding each sequence's whole output at every step held
                    # the engine ~70 us per sequence per step, most of a batch-64 decode step.
                    if not d.stop:
                        continue
                    d.add_until_stop(out.new_token_ids)
                    if d.stopped_by is not None and not out.finished:
                        self.engine.abort(out.seq.seq_id)
                        out.seq.finish_reason = "stop"
        except BaseException:
            for s in seqs:
                if s is not None:
                    self.engine.abort(s.seq_id)
            raise
        results = []
        for seq, d in zip(seqs, detoks, strict=True):
            if not d.stop:
                d.add(seq.output_token_ids)
            d.finish()
            ids = seq.output_token_ids
            lps = seq.output_logprobs if seq.params.logprobs is not None else None
            if d.stopped_by is not None:
                seq.finish_reason = "stop"
                # A step that emits several ids (an accepted draft run) may run past the stop
                # string: keep the ids up to the one that completed it, as one-id steps would.
                ids = ids[: len(d.output_ids)]
                lps = None if lps is None else lps[: len(d.output_ids)]
            results.append(
                Completion(
                    prompt_token_ids=seq.prompt_token_ids,
                    token_ids=list(ids),
                    text=d.text,
                    finish_reason=seq.finish_reason or "stop",
                    logprobs=lps,
                    stop_string=d.stopped_by,
                    prompt_logprobs=(
                        list(seq.prompt_logprobs)
                        if seq.params.prompt_logprobs is not None
                        else None
                    ),
                    error=seq.error,
                )
            )
        return results

    def stream(
        self, prompt: Prompt, sampling: SamplingParams | None = None
    ) -> Iterator[CompletionChunk]:
        """Yield text deltas as tokens are generated; the last chunk carries the finish reason."""
        sp = sampling or SamplingParams()
        ids = self.encode_prompt(prompt)
        seq = self.engine.add_request(ids, sp)
        d = IncrementalDetokenizer(self.tokenizer, ids, sp.stop, min_tokens=sp.min_tokens)
        try:
            while True:
                outs = [o for o in self._step() if o.seq is seq]
                if not outs:
                    if seq.is_finished:
                        return
                    continue
                out = outs[0]
                text, n = d.add_until_stop(out.new_token_ids)
                new_ids, new_lps = out.new_token_ids[:n], out.new_logprobs[:n]
                finished = out.finished
                if d.stopped_by is not None and not finished:
                    self.engine.abort(seq.seq_id)
                    finished = True
                if finished:
                    text += d.finish()
                    reason = "stop" if d.stopped_by is not None else (seq.finish_reason or "stop")
                    yield CompletionChunk(
                        new_ids, text, reason, new_lps, out.prompt_logprobs, seq.error
                    )
                    return
                yield CompletionChunk(new_ids, text, None, new_lps, out.prompt_logprobs)
        finally:
            if not seq.is_finished:
                self.engine.abort(seq.seq_id)
