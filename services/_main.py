"""Shared entry point of the stage processes (`python -m services.<stage>`)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

from tandem import telemetry
from tandem.rpc.auth import stage_credentials_from_args
from tandem.stage_args import (
    engine_config_from_args,
    gateway_config_from_args,
    metrics_port_of,
    metrics_token_from_args,
    stage_parser,
)


def run_stage(
    stage: str, serve: Callable[..., Awaitable[None]], argv: list[str] | None = None
) -> None:
    args = stage_parser(stage).parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {stage} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config = engine_config_from_args(args)
    except (TypeError, ValueError) as e:
        sys.exit(f"tandem {stage}: {e}")
    kwargs = {}
    if stage == "prefill":
        kwargs = {"lease_ttl_s": args.lease_ttl}
    elif stage == "decode":
        kwargs = {
            "kv_transport": args.kv_transport,
            "kv_transfer_timeout_s": args.kv_transfer_timeout,
            "reservation_ttl_s": args.kv_reservation_ttl,
            "prefill_wait_s": args.prefill_wait,
            "prefill": args.prefill,
            "draft": args.draft,
            "spec": {
                "fixed_k": args.spec_k,
                "k_min": args.spec_k_min,
                "k_max": args.spec_k_max,
                "timeout_s": args.draft_timeout_ms / 1e3,
            },
        }
    elif stage == "draft":
        kwargs = {"draft": args.draft, "num_blocks": args.draft_blocks}
    elif stage == "gateway":
        try:
            gateway_config = gateway_config_from_args(args)
        except (TypeError, ValueError) as e:
            sys.exit(f"tandem {stage}: {e}")
        kwargs = {
            "gateway_config": gateway_config,
            "http_port": None if args.http_port < 0 else args.http_port,
            "prefill": args.prefill,
            "decode": args.decode,
            "draft": args.draft,
        }
    if stage == "prefill":
        kwargs["max_leases_per_peer"] = args.max_leases_per_peer
    try:
        kwargs["stage_credentials"] = stage_credentials_from_args(args, stage)
        kwargs["metrics_token"] = metrics_token_from_args(args)
    except ValueError as e:
        sys.exit(f"tandem {stage}: {e}")
    kwargs["metrics_port"] = metrics_port_of(args)
    # OTLP export when OTEL_EXPORTER_OTLP_ENDPOINT is set; otherwise tracing stays off (free).
    telemetry.init_tracing(stage)

    async def main() -> None:
        task = asyncio.ensure_future(serve(config, args.host, args.port, **kwargs))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(main())
    except (FileNotFoundError, ValueError, OSError) as e:
        sys.exit(f"tandem {stage}: {e}")
    finally:
        telemetry.shutdown()  # flush the spans still queued
