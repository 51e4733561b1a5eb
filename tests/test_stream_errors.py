"""What an HTTP stream says when it fails after its 200 (chat and completions streams, and the
Responses API's): the same OpenAI error type and message for the same failure."""

from __future__ import annotations

import logging

import pytest

from services.gateway.openai_wire import stream_error
from services.gateway.router import Overloaded, StageUnavailable


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (Overloaded("at the request cap"), "rate_limit_exceeded"),
        (StageUnavailable("decode worker unreachable"), "service_unavailable"),
        (ValueError("max_tokens: too many"), "invalid_request_error"),
    ],
)
def test_known_failures_are_told_as_they_are(error, kind) -> None:
    assert stream_error(error) == (kind, str(error))


def test_an_unexpected_failure_is_logged_and_told_only_that_it_was_internal(caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="tandem.gateway.http"):
        kind, message = stream_error(RuntimeError("secret path /srv/x"))
    assert (kind, message) == ("server_error", "internal error")
    assert "secret path" not in message
    assert any("secret path" in (r.exc_text or "") for r in caplog.records)
