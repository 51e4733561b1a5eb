"""Checks of a structured-output request (JSON schema, regex, choice, EBNF grammar), made
where the request arrives: the gateway refuses a malformed grammar before any worker sees it.

The grammars are parsed without a tokenizer, which is cheap; the engine compiles them against
the vocabulary (`tandem/engine/grammar.py`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tandem.api.sampling_params import StructuredOutput, check_structured_fields


def load_xgrammar() -> Any:
    """The xgrammar module, or a ValueError a caller can show when it is not installed."""
    try:
        import xgrammar
    except ImportError as e:  # no wheel for this platform
        raise ValueError(
            "structured output (response_format) needs the xgrammar package, which is not "
            f"installed here: {e}"
        ) from None
    return xgrammar


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF accepting exactly one of `choices` (JSON string escapes are xgrammar's too)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def parse_choices(spec: str) -> list[str]:
    """The strings of a `choice` spec (a JSON list of non-empty strings)."""
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"structured output (response_format) choice spec is not JSON: {e}"
        ) from None
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise ValueError(
            "structured output (response_format) choice must be a non-empty list of "
            "non-empty strings"
        )
    return choices


def check_structured(so: StructuredOutput) -> None:
    """Raise `ValueError` when the grammar is malformed: `check_structured_fields`, then the
    grammar parsed without a tokenizer (milliseconds for a grammar of a few kilobytes: 54 ms
    for a 377 KB JSON schema, so engines leave it to their compile threads)."""
    check_structured_fields(so)
    xgr = load_xgrammar()
    try:
        if so.kind == "json_schema":
            try:
                json.loads(so.spec)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"structured output (response_format) json_schema is not JSON: {e}"
                ) from None
            xgr.Grammar.from_json_schema(so.spec, strict_mode=True)
        elif so.kind == "regex":
            xgr.Grammar.from_regex(so.spec)
        elif so.kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(parse_choices(so.spec)))
        elif so.kind == "grammar":
            xgr.Grammar.from_ebnf(so.spec)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar reports parse errors as RuntimeError
        raise ValueError(
            f"structured output (response_format) {so.kind} is invalid: {xgrammar_error(e)}"
        ) from None


def xgrammar_error(e: Exception) -> str:
    """The first line of an xgrammar error, without its source location."""
    # xgrammar's messages start with "[time] /path/file.cc:line: Check failed: ..."
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return msg.split(": ", 1)[1] if msg.startswith("[") and ": " in msg else msg
