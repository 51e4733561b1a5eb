"""Credentials read from the files and TANDEM_* variables that `config.py` declares: a secret
file's first line, the stage and gateway secrets (checked against the role of the process that
holds them) and the metrics token. Each is an error a user can act on when it is wrong."""

from __future__ import annotations

import hmac
import re

from tandem.config import MetricsAuthConfig, StageAuthConfig


def read_secret(path: str, what: str) -> str:
    """The first line of a secret file, stripped; a missing or empty file is an error."""
    try:
        with open(path) as f:
            value = f.readline().strip()
    except OSError as e:
        raise ValueError(f"{what} {path!r} cannot be read: {e.strerror}") from e
    if not value:
        raise ValueError(f"{what} {path!r} is empty")
    return value


def _one_secret(path: str | None, value: str | None, name: str) -> bytes | None:
    """A secret given by file (`<name>_file`) or by TANDEM_<NAME>, once; None when neither."""
    if path is not None:
        if value is not None:
            raise ValueError(
                f"give the {name.replace('_', ' ')} once: TANDEM_{name.upper()} or "
                f"{name}_file, not both"
            )
        return read_secret(path, f"{name}_file").encode()
    if value is not None:
        if not value.strip():
            raise ValueError(f"TANDEM_{name.upper()} is set but empty")
        return value.strip().encode()
    return None


def stage_secret(cfg: StageAuthConfig) -> bytes | None:
    """The stage secret; None when none is configured."""
    return _one_secret(cfg.stage_secret_file, cfg.stage_secret, "stage_secret")


def gateway_secret(cfg: StageAuthConfig) -> bytes | None:
    """The gateway secret; None when none is configured."""
    return _one_secret(cfg.gateway_secret_file, cfg.gateway_secret, "gateway_secret")


def role_secrets(cfg: StageAuthConfig, stage: str) -> tuple[bytes | None, bytes | None]:
    """(stage secret, gateway secret) of the `stage` process; ValueError when they do not
    fit its role."""
    secret, gateway = stage_secret(cfg), gateway_secret(cfg)
    if stage == "gateway":
        if secret is not None:
            raise ValueError(
                "the gateway takes no stage secret (it would let the process facing the "
                "internet sign KV leases and register as a worker): give it the gateway "
                "secret instead, TANDEM_GATEWAY_SECRET or --gateway-secret-file, and the "
                "workers both"
            )
        return None, gateway
    if gateway is not None and secret is None:
        raise ValueError(
            "a gateway secret is checked only by a worker that has a stage secret: set "
            "TANDEM_STAGE_SECRET or --stage-secret-file too (without it the port is open)"
        )
    if gateway is not None and hmac.compare_digest(gateway, secret):
        raise ValueError(
            "the gateway secret must differ from the stage secret: the gateway's "
            "credential would otherwise allow everything a worker's does"
        )
    return secret, gateway


def metrics_token(cfg: MetricsAuthConfig) -> bytes | None:
    """The metrics token; None when none is configured. ValueError when it could never be
    sent in an HTTP header (a bearer token is printable ASCII without spaces)."""
    token = _one_secret(cfg.metrics_token_file, cfg.metrics_token, "metrics_token")
    if token is not None and not re.fullmatch(rb"[\x21-\x7e]+", token):
        where = (
            f"--metrics-token-file {cfg.metrics_token_file!r}"
            if cfg.metrics_token_file is not None
            else "TANDEM_METRICS_TOKEN"
        )
        raise ValueError(
            f"the metrics token ({where}) must be printable ASCII without spaces: a scraper "
            "sends it in an HTTP header"
        )
    return token
