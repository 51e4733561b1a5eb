"""Each stage's command line: the flags of `tandem <stage>` (and those `tandem up` passes on),
and the settings of `tandem.config` read from parsed flags, then TANDEM_* variables."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields
from typing import Any

from tandem.config import (
    EngineConfig,
    GatewayConfig,
    MetricsAuthConfig,
    StageAuthConfig,
    StageTlsConfig,
)
from tandem.config_options import add_dataclass_args, dataclass_from_args
from tandem.credentials import metrics_token, read_secret, stage_secret
from tandem.tenants import load_api_keys

DEFAULT_GATEWAY_PORT = 50051
DEFAULT_HTTP_PORT = 8000
METRICS_PORT_OFFSET = 1000  # a stage's /metrics port defaults to its gRPC port + this


def metrics_port_of(args: Any) -> int | None:
    """The /metrics port a stage's parsed flags ask for; None when disabled."""
    port = args.metrics_port
    if port is None:
        port = args.port + METRICS_PORT_OFFSET
        if args.port <= 0 or port > 65535:
            return None
    return None if port < 0 else port


# How KV moves from prefill to decode (tandem/kv/transports: accept_kinds says what auto picks).
KV_TRANSPORTS = ("auto", "cuda_ipc", "shm", "nixl", "inline")


def env_default(name: str, default: Any, typ: type = str, choices: tuple | None = None) -> Any:
    """A flag's default from the variable `name` when it is set, checked as the flag's own value
    would be (argparse checks neither the type nor the choices of a default)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = typ(raw.strip())
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not a valid {typ.__name__}") from None
    if choices is not None and value not in choices:
        raise SystemExit(f"{name}={raw!r}: choose one of {', '.join(choices)}")
    return value


def _addresses(value: str) -> list[str]:
    return [a.strip() for a in value.split(",") if a.strip()]


def stage_parser(stage: str) -> Any:
    """The argument parser of one stage (`gateway`, `prefill`, `decode`, `draft`): every flag."""

    p = argparse.ArgumentParser(
        prog=f"tandem {stage}", description=f"Run the Tandem {stage} service."
    )
    p.add_argument(
        "--host",
        default=os.environ.get("TANDEM_HOST", "127.0.0.1"),
        help="address to bind (default 127.0.0.1: never public unless asked)",
    )
    default_port = {
        "gateway": DEFAULT_GATEWAY_PORT,
        "prefill": DEFAULT_GATEWAY_PORT + 1,
        "decode": DEFAULT_GATEWAY_PORT + 2,
        "draft": DEFAULT_GATEWAY_PORT + 4,
    }[stage]
    p.add_argument(
        "--port", type=int, default=default_port, help=f"gRPC port (default {default_port})"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help=f"Prometheus /metrics HTTP port (default: gRPC port + {METRICS_PORT_OFFSET}; "
        "-1 disables)",
    )
    p.add_argument("--log-level", default=os.environ.get("TANDEM_LOG_LEVEL", "INFO"))
    add_engine_args(p)
    add_stage_auth_args(p)
    add_stage_tls_args(p)
    add_metrics_auth_args(p)
    if stage == "prefill":
        p.add_argument(
            "--lease-ttl",
            type=float,
            default=30.0,
            help="seconds a leased KV block waits for its decode worker (default 30)",
        )
        p.add_argument(
            "--max-leases-per-peer",
            type=int,
            default=env_default("TANDEM_MAX_LEASES_PER_PEER", 1024, int),
            help="KV leases (prefilled prompts not yet taken by a decode worker) one client "
            "host may hold; more Prefill.Run calls are refused with RESOURCE_EXHAUSTED "
            "(default 1024)",
        )
    if stage == "decode":
        p.add_argument(
            "--prefill",
            type=_addresses,
            default=[],
            help="prefill addresses to register with at start (comma separated)",
        )
        p.add_argument(
            "--kv-transport",
            choices=list(KV_TRANSPORTS),
            default=env_default("TANDEM_KV_TRANSPORT", "auto", choices=KV_TRANSPORTS),
            help="how KV reaches this worker: auto (CUDA IPC or shared memory when prefill is on "
            "this host, NIXL when it is not, inline gRPC bytes when NIXL is not installed), or "
            "exactly one of cuda_ipc, shm, nixl, inline",
        )
        p.add_argument(
            "--prefill-wait",
            type=float,
            default=300.0,
            help="seconds to wait at start for the --prefill workers to answer before giving up "
            "(default 300)",
        )
        p.add_argument(
            "--kv-transfer-timeout",
            type=float,
            default=10.0,
            help="seconds one NIXL read of a request's KV may take before the request fails "
            "(default 10)",
        )
        p.add_argument(
            "--kv-reservation-ttl",
            type=float,
            default=10.0,
            help="seconds blocks reserved for a prompt's pushed KV wait for its admission before "
            "they return to the pool; 0: take no pushes, pull every prompt's KV (default 10)",
        )
    if stage == "decode":
        p.add_argument(
            "--draft",
            type=_addresses,
            default=[],
            help="draft worker address: speculate with its proposals (default: no speculation)",
        )
        p.add_argument(
            "--spec-k", type=int, default=None, help="fixed speculation length (default: adaptive)"
        )
        p.add_argument("--spec-k-min", type=int, default=1, help="adaptive k lower bound (1)")
        p.add_argument("--spec-k-max", type=int, default=8, help="adaptive k upper bound (8)")
        p.add_argument(
            "--draft-timeout-ms",
            type=float,
            default=200.0,
            help="wait this long for proposals, then decode without them for that step",
        )
    if stage == "draft":
        p.add_argument(
            "--draft",
            default="ngram",
            help="proposer: ngram (prompt lookup), self:N (the target's first N layers), "
            "self-int4 (the whole target quantized to INT4 g128 at start-up), self-int4:DIR (a "
            "`tandem quantize` checkpoint of the target) or a path to a smaller model with the "
            "target's tokenizer",
        )
        p.add_argument(
            "--draft-blocks",
            type=int,
            default=None,
            help="KV blocks of a draft model's pool (default: --num-blocks, else what "
            "--kv-cache-memory-gb holds, 1 GiB when that is unset)",
        )
    if stage == "gateway":
        p.add_argument(
            "--draft",
            type=_addresses,
            default=[],
            help="draft workers to admit sequences to, concurrently with prefill (optional)",
        )
        p.add_argument(
            "--http-port",
            type=int,
            default=DEFAULT_HTTP_PORT,
            help=f"OpenAI-compatible HTTP port (default {DEFAULT_HTTP_PORT}; -1 disables)",
        )
        add_dataclass_args(p, GatewayConfig, "gateway")
        p.add_argument(
            "--prefill",
            type=_addresses,
            required=True,
            help="prefill addresses, comma separated (empty: none, the decode workers prefill "
            "every prompt)",
        )
        p.add_argument(
            "--decode", type=_addresses, required=True, help="decode addresses, comma separated"
        )
    return p


def gateway_config_from_args(args: Any) -> GatewayConfig:
    """GatewayConfig from parsed flags, then TANDEM_* variables, then defaults."""
    cfg = dataclass_from_args(GatewayConfig, args)
    if cfg.api_key_file is not None:
        if cfg.api_key is not None:
            raise ValueError("give the API key once: api_key or api_key_file, not both")
        cfg.api_key = read_secret(cfg.api_key_file, "api_key_file")
    cfg.validate()
    if cfg.api_keys is not None:
        load_api_keys(cfg.api_keys)  # its mistakes are start-up errors
    return cfg


def add_engine_args(parser: Any, skip: tuple[str, ...] = ()) -> None:
    """Add a `--flag` for every `EngineConfig` field (but `skip`) to an argparse parser or
    group (default: unset)."""
    add_dataclass_args(parser, EngineConfig, "engine", skip)


def add_stage_auth_args(parser: Any) -> None:
    """Add the stage credentials' flags (`--stage-secret-file`, `--gateway-secret-file`) to a
    parser or group."""
    add_dataclass_args(parser, StageAuthConfig, "stage credential:")


def add_stage_tls_args(parser: Any) -> None:
    """Add the stage TLS flags (`--stage-tls-cert`, `--stage-tls-key`, `--stage-tls-ca`, the
    client certificate's and `--stage-mtls`)."""
    add_dataclass_args(parser, StageTlsConfig, "stage TLS:")


def add_gateway_args(parser: Any) -> None:
    """Add a `--flag` for every `GatewayConfig` field to an argparse parser (default: unset)."""
    add_dataclass_args(parser, GatewayConfig, "gateway")


def engine_config_from_args(args: Any) -> EngineConfig:
    """EngineConfig from parsed flags; unset flags fall back to TANDEM_* variables, then defaults."""
    opts = {
        f.name: getattr(args, f.name)
        for f in fields(EngineConfig)
        if getattr(args, f.name, None) is not None
    }
    return EngineConfig.from_options(**opts)


def metrics_token_from_args(args: Any) -> bytes | None:
    """The metrics token from parsed flags, then TANDEM_* variables; None when none is set."""
    return metrics_token(dataclass_from_args(MetricsAuthConfig, args))


def add_metrics_auth_args(parser: Any) -> None:
    """Add the metrics credential's flag (`--metrics-token-file`) to a parser or group."""
    add_dataclass_args(parser, MetricsAuthConfig, "metrics credential:")


def stage_secret_from_args(args: Any) -> bytes | None:
    """The stage secret from parsed flags, then TANDEM_* variables; None when none is set."""
    return stage_secret(dataclass_from_args(StageAuthConfig, args))
