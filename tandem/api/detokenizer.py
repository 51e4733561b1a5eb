"""Incremental detokenization: UTF-8 safe text deltas and exact stop-string cuts."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.model.tokenizer import Tokenizer

# Prompt tokens decoded ahead of the output, so tokenizers that drop a leading space on the
# first decoded token (SentencePiece) still produce the right first delta.
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas; holds back what may still change.

    Each `add` decodes a short window of ids, not the whole output (which made a sequence's
    detokenization quadratic in its length): the ids from `_prefix` on, whose text up to
    `_read` was already counted. The text of the ids past `_read` is what the window adds;
    the window then moves up to the end, unless its text ends in an incomplete UTF-8 sequence
    (U+FFFD) or adds nothing yet, when it waits for the ids that complete it. Decoding from a
    few ids back, not from `_read`, keeps what depends on the neighbours (a SentencePiece
    word's leading space, bytes split over ids) as a decode of the whole would give it."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The last prompt ids open the window, so the first delta has the text a decode of
        # prompt and output together gives it.
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix, self._read = 0, len(self._ids)
        self._decoded = ""  # the text of the output ids up to `_read`
        self.stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.output_ids: list[int] = []
        self.text = ""  # the text decided so far (what has been emitted)
        self.stopped_by: str | None = None  # the stop string that ended generation
        # A stop string ends the output only where it ends past the text of the first
        # `min_tokens - 1` ids (vLLM's rule: none is looked for before `min_tokens` ids).
        self.min_tokens = min_tokens
        self._stop_floor = 0  # characters of `_decoded` no stop string may end within

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, final: bool) -> None:
        """Extend `_decoded` with the text of the ids past `_read`, once it is complete (or
        as it is, when `final`)."""
        if len(self._ids) == self._read:
            return
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if final or (len(after) > len(before) and not after.endswith("\ufffd")):
            self._decoded += after[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Append ids and return the new text; once a stop string is seen, `stopped_by` is set."""
        if self.stopped_by is not None:
            return ""
        below = self.min_tokens - 1 - len(self.output_ids)  # ids still below the stop floor
        if self.stop and 0 < below < len(token_ids):
            # The ids cross `min_tokens`: the floor is the text of those before it.
            head = self.add(token_ids[:below])
            return head + self.add(token_ids[below:], final)
        self.output_ids.extend(token_ids)
        self._ids.extend(token_ids)
        self._advance(final)
        full = self._decoded
        if self.stop:
            if len(self.output_ids) < self.min_tokens:
                self._stop_floor = len(full)
            start = max(0, len(self.text) - self._holdback)
            best = -1
            for s in self.stop:
                if len(self.output_ids) < self.min_tokens:
                    break
                i = full.find(s, max(start, self._stop_floor - len(s) + 1))
                if i != -1 and (best == -1 or i < best):
                    best, self.stopped_by = i, s
            if best != -1:
                full = full[:best]
                delta = full[len(self.text) :]
                self.text = full
                return delta
            if not final and self._holdback:
                full = full[: max(len(self.text), len(full) - self._holdback)]
        # `_decoded` only grows and `text` is a prefix of it: the delta is what lies past it.
        delta = full[len(self.text) :]
        self.text += delta
        return delta

    def add_until_stop(self, token_ids: Sequence[int]) -> tuple[str, int]:
        """`add` for several ids at once (an accepted speculative run, a batched message) that
        stops at the id completing a stop string, as one-id steps would: returns the new text
        and how many of `token_ids` belong to the output (all unless a stop string ended it)."""
        saved = self._state()
        delta = self.add(token_ids)
        if self.stopped_by is None or len(token_ids) <= 1:
            return delta, len(token_ids)
        # Replay one id at a time to find the one that completed the stop string; this happens
        # once per sequence, so the extra decoding costs nothing that matters.
        self._restore(saved)
        delta = ""
        for i, t in enumerate(token_ids):
            delta += self.add([t])
            if self.stopped_by is not None:
                return delta, i + 1
        return delta, len(token_ids)

    def _state(self) -> tuple[int, int, int, int, str, str, int]:
        return (len(self.output_ids), len(self._ids), self._prefix, self._read, self._decoded,
                self.text, self._stop_floor)  # fmt: skip

    def _restore(self, state: tuple[int, int, int, int, str, str, int]) -> None:
        n_out, n_ids, self._prefix, self._read, self._decoded, self.text, self._stop_floor = state
        del self.output_ids[n_out:], self._ids[n_ids:]
        self.stopped_by = None

    def finish(self) -> str:
        """Release the held-back text at the end of generation."""
        return self.add([], final=True)
