"""Tenants: who a request's KV blocks are charged to, and how many blocks each may hold.

A tenant is named by the API key that authenticated the request (or, with API keys off, by the
client: `X-Tenant` / gRPC metadata `x-tenant`); a request naming none belongs to `default`.
With quotas configured (`--tenant-quota NAME=FRACTION`, repeatable), a tenant may hold at most
its fraction of the pool's blocks, counting the blocks of its running sequences and leases and
the blocks it left in the prefix cache. A tenant named without a fraction (`--tenant-quota
NAME`) gets an equal share of what the fractions given leave. A tenant without a quota is
refused while quotas are on. No quotas: every request is charged to one pool-wide account and
the pool behaves as it does without tenants.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tandem.errors import ResourceExhausted

DEFAULT_TENANT = "default"
MAX_TENANT_NAME = 64
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class TenantQuotaExceeded(ResourceExhausted):
    """A request that its tenant's KV quota could never hold (answered RESOURCE_EXHAUSTED /
    HTTP 429): the message names the tenant, its quota and what the request needs."""


def check_tenant_name(name: str, what: str = "tenant") -> str:
    """`name` when it is a valid tenant name; else a ValueError saying what is allowed."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} name is empty")
    if len(name) > MAX_TENANT_NAME:
        raise ValueError(f"{what} name is {len(name)} characters long; at most {MAX_TENANT_NAME}")
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"{what} name {name!r} is not valid: use letters, digits, '_', '.' and '-', "
            "starting with a letter or digit"
        )
    return name


def parse_tenant_quotas(specs: Iterable[str]) -> dict[str, float]:
    """{tenant: fraction of the pool} from `NAME=FRACTION` / `NAME` items (commas also split).

    Fractions are in (0, 1] and add up to at most 1; names without one share the rest equally.
    """
    given: dict[str, float | None] = {}
    for spec in specs:
        for item in str(spec).split(","):
            item = item.strip()
            if not item:
                continue
            name, sep, frac = item.partition("=")
            name = check_tenant_name(name.strip(), "tenant_quota: tenant")
            if name in given:
                raise ValueError(f"tenant_quota: tenant {name!r} is given twice")
            if not sep:
                given[name] = None
                continue
            try:
                value = float(frac)
            except ValueError:
                raise ValueError(
                    f"tenant_quota: {item!r} is not NAME=FRACTION (FRACTION a number in (0, 1])"
                ) from None
            if not 0 < value <= 1:
                raise ValueError(
                    f"tenant_quota: {name}'s fraction must be in (0, 1], got {frac.strip()!r}"
                )
            given[name] = value
    fixed = sum(v for v in given.values() if v is not None)
    if fixed > 1 + 1e-9:
        raise ValueError(f"tenant_quota: the fractions add up to {fixed:g}, more than 1")
    rest = [n for n, v in given.items() if v is None]
    if rest and fixed >= 1 - 1e-9:
        raise ValueError(
            f"tenant_quota: no share is left for {', '.join(rest)}: the fractions given add up to 1"
        )
    share = (1 - fixed) / len(rest) if rest else 0.0
    return {n: (share if v is None else v) for n, v in given.items()}


def quota_blocks(fractions: dict[str, float], num_blocks: int) -> dict[str, int]:
    """Blocks each tenant may hold in a pool of `num_blocks` (rounded down; together at most
    the pool)."""
    return {n: int(f * num_blocks + 1e-9) for n, f in fractions.items()}


def load_api_keys(path: str) -> dict[str, str]:
    """{API key: tenant} from a file of `TENANT KEY` lines (blank lines and `#` comments
    skipped); every mistake is an error naming its line."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"api_keys {path!r} cannot be read: {e.strerror}") from e
    keys: dict[str, str] = {}
    for no, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"api_keys {path!r} line {no}: expected 'TENANT KEY'")
        tenant, key = parts
        check_tenant_name(tenant, f"api_keys {path!r} line {no}: tenant")
        if key in keys:
            raise ValueError(f"api_keys {path!r} line {no}: this key is already given")
        keys[key] = tenant
    if not keys:
        raise ValueError(f"api_keys {path!r} holds no keys")
    return keys
