"""CORS for the HTTP API: browsers on the allowed origins (`--cors-allowed-origins`) may call it.

Without allowed origins no CORS header is ever sent, so a browser keeps every other site's page
from reading the answers. With them, a preflight (`OPTIONS` with `Access-Control-Request-Method`)
from an allowed origin is answered before authentication (browsers send no credentials in it),
and every response to an allowed origin names it in `Access-Control-Allow-Origin`.
"""

from __future__ import annotations

from aiohttp import web

ALLOW_METHODS = "GET, POST, OPTIONS"
# The request headers a page may send, unless its preflight asks for others.
ALLOW_HEADERS = "Authorization, Content-Type, X-Request-Id, X-Tenant, traceparent, tracestate"
EXPOSE_HEADERS = "x-request-id, x-trace-id, Retry-After"
MAX_AGE_S = 600


class Cors:
    """The middleware (preflights) and the response hook (allowed origins) of the HTTP app."""

    def __init__(self, origins: frozenset[str]) -> None:
        self.origins = origins

    def allowed(self, request: web.Request) -> str | None:
        """The request's `Origin` when it may read the answer, else None."""
        origin = request.headers.get("Origin")
        if origin is None or not self.origins:
            return None
        return origin if "*" in self.origins or origin in self.origins else None

    @web.middleware
    async def preflight(self, request: web.Request, handler):
        origin = self.allowed(request)
        if (
            request.method != "OPTIONS"
            or origin is None
            or "Access-Control-Request-Method" not in request.headers
        ):
            return await handler(request)
        asked = request.headers.get("Access-Control-Request-Headers")
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Methods": ALLOW_METHODS,
                "Access-Control-Allow-Headers": asked or ALLOW_HEADERS,
                "Access-Control-Max-Age": str(MAX_AGE_S),
            },
        )

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = self.allowed(request)
        if origin is None:
            return
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = EXPOSE_HEADERS
        response.headers["Vary"] = "Origin"
