"""Who a request is: the tenant its API key names, or (API keys off) the one the client names.

With keys (`api_key`, tenant `default`; `api_keys`, a file of `TENANT KEY` lines), the key in
`authorization: Bearer <key>` names the tenant and `X-Tenant` is ignored. Without keys the
client may name its tenant in the `X-Tenant` header (gRPC metadata `x-tenant`); none: `default`.
The tenant travels to the workers with the request (`PrefillRequest.tenant`, `Admit.tenant`),
whose KV quotas it counts against.
"""

from __future__ import annotations

import hashlib
import hmac

from tandem.tenants import DEFAULT_TENANT, check_tenant_name

TENANT_HEADER = "x-tenant"
# Tenant label values kept in the gateway's metrics; later names share "other" (a client
# naming tenants freely must not grow the metrics without bound).
MAX_TENANT_LABELS = 64


class TenantAuth:
    """Maps a request's credentials or header to its tenant."""

    def __init__(self, api_key: str | None = None, api_keys: dict[str, str] | None = None) -> None:
        self._by_digest: dict[bytes, str] = {}
        if api_key:
            self._by_digest[self._digest(f"Bearer {api_key}".encode())] = DEFAULT_TENANT
        for key, tenant in (api_keys or {}).items():
            self._by_digest[self._digest(f"Bearer {key}".encode())] = tenant
        self._labels: set[str] = set()

    @property
    def keys_on(self) -> bool:
        return bool(self._by_digest)

    @staticmethod
    def _digest(value: bytes) -> bytes:
        return hashlib.sha256(value).digest()

    def tenant_of_key(self, authorization: str | bytes | None) -> str | None:
        """The tenant of the key in an `authorization` value; None when it names none."""
        got = authorization or b""
        got = got.encode() if isinstance(got, str) else got
        digest = self._digest(got)
        tenant = self._by_digest.get(digest)
        # Compare the digests in constant time too (the dict found a candidate by its hash).
        if tenant is None or not hmac.compare_digest(digest, self._digest(got)):
            return None
        return tenant

    def tenant_of_header(self, value: str | bytes | None) -> str:
        """The tenant a client names (keys off); `default` when it names none. ValueError
        (HTTP 400, INVALID_ARGUMENT) for a malformed name."""
        if value is None or value == "" or value == b"":
            return DEFAULT_TENANT
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        return check_tenant_name(value.strip(), "X-Tenant: tenant")

    def resolve(self, authorization: str | bytes | None, header: str | bytes | None) -> str:
        """The request's tenant: its key's (keys on; the key was checked already), else the
        header's."""
        if self.keys_on:
            tenant = self.tenant_of_key(authorization)
            if tenant is None:
                raise PermissionError("missing or wrong API key")
            return tenant
        return self.tenant_of_header(header)

    def label(self, tenant: str) -> str:
        """The metrics label of a tenant (bounded: see MAX_TENANT_LABELS)."""
        if tenant in self._labels:
            return tenant
        if len(self._labels) < MAX_TENANT_LABELS:
            self._labels.add(tenant)
            return tenant
        return "other"
