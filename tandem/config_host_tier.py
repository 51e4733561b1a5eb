"""The host-memory tier's setting, a part of `EngineConfig` (see `tandem.kv.host_tier`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HostTierSettings:
    """Fields `EngineConfig` takes from here (one flag and one TANDEM_* variable each)."""

    # Host-memory tier of the prefix cache, in GiB of (pinned, on CUDA) host memory: cached
    # blocks evicted from the KV pool are copied there instead of dropped, and a prompt whose
    # prefix is there gets it copied back instead of recomputed. Tenant quotas give each tenant
    # the same fraction of it as of the pool. 0: off (nothing changes on the step path).
    kv_host_cache_gb: float = 0.0

    def validate_host_tier(self) -> None:
        """Raise `ValueError` naming the setting when it cannot be used."""
        v = self.kv_host_cache_gb
        if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
            raise ValueError(
                f"kv_host_cache_gb (--kv-host-cache-gb, TANDEM_KV_HOST_CACHE_GB) must be a "
                f"number >= 0 (GiB of host memory; 0 turns the host tier off), got {v!r}"
            )
        if v > 0 and not getattr(self, "enable_prefix_cache", True):
            raise ValueError(
                "kv_host_cache_gb (--kv-host-cache-gb) needs the prefix cache: it holds the "
                "cache's evicted blocks (unset enable_prefix_cache=false, or set it to 0)"
            )
