"""Errors raised in more than one layer and answered alike by the services.

The layers that raise them (kv, engine, tenants) sit below the one that maps them to gRPC status
codes (`tandem.rpc.convert.status_for`), so they live below all of them.
"""

from __future__ import annotations


class ResourceExhausted(RuntimeError):
    """A request refused for want of room (KV blocks, a place in the waiting queue, its
    tenant's quota): answered RESOURCE_EXHAUSTED / HTTP 429."""
