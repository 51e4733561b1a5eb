"""`tandem up | gateway | prefill | decode | chat | quantize`: the command line."""

from __future__ import annotations

import argparse
import os
import sys

# This process forks children (fork + exec) while gRPC is in use: gRPC's fork handlers can
# hang fork() itself (seen in Popen under load); with no fork in the children before exec they
# are not needed. Set before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from tandem.chat import cmd_chat  # noqa: E402
from tandem.stage_args import DEFAULT_GATEWAY_PORT  # noqa: E402
from tandem.up import STAGES, add_up_args, cmd_up, exec_stage  # noqa: E402


# ---- entry ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in STAGES:
        exec_stage(argv[0], argv[1:])
    p = argparse.ArgumentParser(prog="tandem", description="Tandem: disaggregated LLM serving.")
    sub = p.add_subparsers(dest="cmd", required=True)
    for s in STAGES:
        sub.add_parser(s, help=f"run the {s} service (see `tandem {s} --help`)")
    up = sub.add_parser(
        "up",
        help="start every stage on this host, wait until it serves, print endpoints",
        description="Start the prefill, decode and gateway stages (and a draft worker with "
        "--draft) on this host, show their progress, and print the endpoints once a request "
        "can be served. Every setting below is checked before anything starts.",
    )
    add_up_args(up)
    chat = sub.add_parser("chat", help="stream a chat reply from a running gateway")
    chat.add_argument("message")
    chat.add_argument(
        "--address",
        default=f"127.0.0.1:{DEFAULT_GATEWAY_PORT}",
        help="gateway gRPC address (default %(default)s)",
    )
    chat.add_argument(
        "--port", type=int, default=None, help="gateway gRPC port on --address's host"
    )
    chat.add_argument(
        "--tls-ca", default=None, help="PEM file of the CA (or certificate) of a TLS gateway"
    )
    chat.add_argument(
        "--api-key-file",
        default=None,
        help="file whose first line is the gateway's API key (sent as `authorization: Bearer`)",
    )
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--system", default=None)
    chat.add_argument("--seed", type=int, default=None)
    from tandem.quant.cli import add_quantize_args, run_quantize

    quantize = sub.add_parser(
        "quantize", help="profile a model's weights, or write an INT4/INT8 checkpoint (AWQ/RTN)"
    )
    add_quantize_args(quantize)
    args = p.parse_args(argv)
    if args.cmd == "up":
        return cmd_up(args, up)
    if args.cmd == "quantize":
        return run_quantize(args)
    return cmd_chat(args)


if __name__ == "__main__":
    sys.exit(main())
