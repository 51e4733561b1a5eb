"""Incremental detokenization: UTF-8 safe text deltas and exact stop-string cuts."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.model.tokenizer import Tokenizer

# Prompt tokens decoded ahead of the output, so tokenizers that drop a leading space on the
# first decoded token (SentencePiece) still produce the right first delta.
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas; holds back what may still change."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.skip_special_tokens = skip_special_tokens
        self._context_text = self._decode(self.context)
        self.stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.output_ids: list[int] = []
        self.text = ""  # the text decided so far (what has been emitted)
        self.stopped_by: str | None = None  # the stop string that ended generation

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _full_text(self) -> str:
        full = self._decode(self.context + self.output_ids)
        if full.startswith(self._context_text):
            return full[len(self._context_text) :]
        return self._decode(self.output_ids)

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Append ids and return the new text; once a stop string is seen, `stopped_by` is set."""
        if self.stopped_by is not None:
            return ""
        self.output_ids.extend(token_ids)
        full = self._full_text()
        # An incomplete UTF-8 sequence decodes to U+FFFD; wait for the bytes that complete it.
        if not final:
            while full.endswith("\ufffd"):
                full = full[:-1]
        if self.stop:
            start = max(0, len(self.text) - self._holdback)
            best = -1
            for s in self.stop:
                i = full.find(s, start)
                if i != -1 and (best == -1 or i < best):
                    best, self.stopped_by = i, s
            if best != -1:
                full = full[:best]
                delta = full[len(self.text) :]
                self.text = full
                return delta
            if not final and self._holdback:
                full = full[: max(len(self.text), len(full) - self._holdback)]
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = self.text + delta
        return delta

    def add_until_stop(self, token_ids: Sequence[int]) -> tuple[str, int]:
        """`add` for several ids at once (an accepted speculative run, a batched message) that
        stops at the id completing a stop string, as one-id steps would: returns the new text
        and how many of `token_ids` belong to the output (all unless a stop string ended it)."""
        n0, text0 = len(self.output_ids), self.text
        delta = self.add(token_ids)
        if self.stopped_by is None or len(token_ids) <= 1:
            return delta, len(token_ids)
        # Replay one id at a time to find the one that completed the stop string; this happens
        # once per sequence, so the extra decoding costs nothing that matters.
        del self.output_ids[n0:]
        self.text, self.stopped_by = text0, None
        delta = ""
        for i, t in enumerate(token_ids):
            delta += self.add([t])
            if self.stopped_by is not None:
                return delta, i + 1
        return delta, len(token_ids)

    def finish(self) -> str:
        """Release the held-back text at the end of generation."""
        return self.add([], final=True)
