"""`tandem chat MESSAGE`: stream one reply from a running gateway (gRPC)."""

from __future__ import annotations

import argparse
import sys
import time


def cmd_chat(args: argparse.Namespace) -> int:
    """Send `args.message` (with `args.system`) and print the reply as it streams."""
    import grpc

    from tandem.rpc import api_pb2, api_pb2_grpc

    address = args.address
    if args.port is not None:
        address = f"{address.rsplit(':', 1)[0]}:{args.port}"
    msgs = []
    if args.system:
        msgs.append(api_pb2.ChatMessage(role="system", content=args.system))
    msgs.append(api_pb2.ChatMessage(role="user", content=args.message))
    sampling = api_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.seed is not None:
        sampling.seed = args.seed
    req = api_pb2.GenerateRequest(messages=api_pb2.ChatMessages(messages=msgs), sampling=sampling)
    metadata: list[tuple[str, str]] = []
    api_key = getattr(args, "api_key", None)
    if getattr(args, "api_key_file", None):
        from tandem.credentials import read_secret

        try:
            api_key = read_secret(args.api_key_file, "--api-key-file")
        except ValueError as e:
            print(f"tandem chat: {e}", file=sys.stderr)
            return 2
    if api_key:
        metadata.append(("authorization", f"Bearer {api_key}"))
    t0 = time.monotonic()
    if args.tls_ca:
        try:
            with open(args.tls_ca, "rb") as f:
                ca = f.read()
        except OSError as e:
            print(f"tandem chat: --tls-ca {args.tls_ca}: {e.strerror}", file=sys.stderr)
            return 2
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(ca))
    else:
        channel = grpc.insecure_channel(address)
    with channel as ch:
        stub = api_pb2_grpc.GatewayStub(ch)
        try:
            for resp in stub.Generate(req, metadata=metadata):
                if resp.HasField("chunk"):
                    sys.stdout.write(resp.chunk.text)
                    sys.stdout.flush()
                else:
                    f = resp.finish
                    secs = time.monotonic() - t0
                    tps = f.usage.completion_tokens / secs if secs > 0 else 0.0
                    trace = f", trace {f.trace_id}" if f.trace_id else ""
                    print(
                        f"\n[{f.usage.completion_tokens} tokens, finish={f.finish_reason}, "
                        f"TTFT {f.timings.ttft_ms:.0f} ms, {tps:.1f} tokens/s, KV via {f.kv_transport}"
                        f"{trace}]",
                        flush=True,
                    )
        except grpc.RpcError as e:
            hint = ""
            details = e.details() or ""
            if e.code() == grpc.StatusCode.UNAVAILABLE and "Socket closed" in details:
                # Something accepted the connection and closed it at once: most often a gateway
                # serving TLS, which a plaintext HTTP/2 preface does not get through.
                if not args.tls_ca:
                    hint = (
                        f"\nSomething listens at {address} but closed the connection: a gateway "
                        "serving TLS needs --tls-ca FILE (the PEM of its CA or certificate)."
                    )
            elif e.code() == grpc.StatusCode.UNAVAILABLE and "connect" in details:
                hint = (
                    f"\nNothing answers at {address}: start Tandem with `tandem up` (or "
                    "`make serve`), or point --address / --port at a running gateway."
                )
            print(f"\ntandem chat: {e.code().name}: {e.details()}{hint}", file=sys.stderr)
            return 1
    return 0
