"""Per-request sampling parameters, validated with messages that name the field."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

MAX_TOP_K = 2**31 - 1  # the wire format's int32
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows
# Entries a request may carry, as vLLM's GPU sampler takes them: every step of every sequence
# in the batch applies them, and their conversions run on the gateway's event loop.
MAX_ENTRIES = {"logit_bias": 1024, "stop_token_ids": 128}

# The range of the 32-bit floats that carry sampling fields between processes.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.401298464324817e-45  # the smallest positive one (subnormal)

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutput:
    """A grammar every generated token must keep the output inside (xgrammar compiles it).

    kind: json_schema (spec: the schema as JSON text), json_object (any JSON object; spec
    unused), regex (spec: the pattern), choice (spec: a JSON list of the allowed strings) or
    grammar (spec: EBNF in xgrammar's GBNF dialect, with a `root` rule).
    """

    kind: str
    spec: str = ""
    # Tokens already generated under this grammar by a worker the sequence moved from: they are
    # replayed into the new matcher, and the prompt ends with them (so they are bounded by the
    # context: a request whose prompt does not end with them is refused).
    accepted: list[int] = field(default_factory=list)


def check_structured_fields(so: StructuredOutput, vocab_size: int | None = None) -> None:
    """Raise `ValueError` when the kind is unknown or an accepted token is no token id; the
    grammar itself is not parsed (see `tandem.api.structured.check_structured`)."""
    if so.kind not in STRUCTURED_KINDS:
        raise ValueError(
            f"structured output (response_format) kind must be one of "
            f"{', '.join(STRUCTURED_KINDS)}, got {so.kind!r}"
        )
    for t in so.accepted:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"structured output accepted tokens must be token ids, got {t!r}")
        if vocab_size is not None and t >= vocab_size:
            raise ValueError(
                f"structured output accepted holds {t}, outside the vocabulary [0, {vocab_size})"
            )


def check_entries(name: str, n: int) -> None:
    """ValueError when field `name` (logit_bias, stop_token_ids) holds more than its limit."""
    limit = MAX_ENTRIES[name]
    if n > limit:
        raise ValueError(f"{name} holds {n} entries; at most {limit} are allowed")


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop. `temperature == 0` means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings, cut from the text
    ignore_eos: bool = False
    # vLLM's: the end-of-sequence and stop tokens are never sampled, and stop strings never end
    # the output, before this many tokens were generated.
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives to report per token (0 = sampled only)
    # Score the prompt too: each prompt token after the first gets its logprob given the tokens
    # before it, with this many top alternatives (vLLM's prompt_logprobs; None: not computed).
    prompt_logprobs: int | None = None
    # OpenAI's penalties over the tokens generated so far (the prompt is not counted):
    # logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]  # one stop string, as vLLM and OpenAI take it

    @property
    def penalized(self) -> bool:
        """True when a token's logit depends on the tokens generated so far (a host history)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `ValueError` naming the first field outside its allowed range."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int):
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}"
            )
        if self.min_tokens and self.structured is not None:
            # A complete grammar allows only the end of sequence, which min_tokens would forbid.
            raise ValueError(
                "min_tokens cannot be combined with structured output: the grammar decides where "
                "the output ends"
            )
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_wire_float("temperature", self.temperature)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.top_k > MAX_TOP_K:
            raise ValueError(
                f"top_k must be at most {MAX_TOP_K} (any value from the vocabulary size up keeps "
                f"every token), got {self.top_k}"
            )
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_wire_float("top_p", self.top_p, positive=True)
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}"
            )
        _check_wire_float("repetition_penalty", self.repetition_penalty, positive=True)
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0
        ):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.seed is not None and self.seed >= 2**64:
            raise ValueError(f"seed must be below 2**64, got {self.seed}")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool)
            or not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                f"{self.prompt_logprobs!r}"
            )
        if isinstance(self.stop_token_ids, str | bytes | int):
            raise ValueError(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
            )
        check_entries("stop_token_ids", len(self.stop_token_ids))
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {t!r}")
            if vocab_size is not None and t >= vocab_size:
                raise ValueError(
                    f"stop_token_ids holds {t}, outside the vocabulary [0, {vocab_size})"
                )
        if isinstance(self.stop, bytes):  # its items would be ints
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _finite(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must map token ids to numbers")
        check_entries("logit_bias", len(self.logit_bias))
        for t, b in self.logit_bias.items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {t!r}")
            if vocab_size is not None and t >= vocab_size:
                raise ValueError(f"logit_bias holds {t}, outside the vocabulary [0, {vocab_size})")
            if not _finite(b) or not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b!r} for {t}")
        if self.structured is not None:
            # Its fields only: the grammar is parsed where the request arrives (the gateway)
            # and compiled off the engine thread (the engine's grammar pool), not here, on it.
            check_structured_fields(self.structured, vocab_size)


def _check_wire_float(name: str, x: float, positive: bool = False) -> None:
    """Refuse a value that changes meaning as a 32-bit float: one beyond its range (infinite
    there) or, for a field that must be > 0, one that rounds to 0. The gateway forwards every
    sampling field as float32, so a worker would otherwise refuse what the gateway accepted."""
    try:
        (x32,) = struct.unpack("<f", struct.pack("<f", x))
    except OverflowError:  # it would arrive as infinity
        raise ValueError(
            f"{name} must be at most {FLOAT32_MAX:.7g} (a 32-bit float), got {x!r}"
        ) from None
    if positive and x32 <= 0:
        raise ValueError(
            f"{name} must be > 0 and at least {FLOAT32_TINY:.7g} (a 32-bit float), got {x!r}"
        )


def _finite(x: object) -> bool:
    return (
        isinstance(x, int | float) and not isinstance(x, bool) and x == x and abs(x) != float("inf")
    )
