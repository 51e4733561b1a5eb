"""`tandem up | gateway | prefill | decode | chat | quantize`: the command line."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# This process forks children (fork + exec) while gRPC is in use: gRPC's fork handlers can
# hang fork() itself (seen in Popen under load); with no fork in the children before exec they
# are not needed. Set before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from tandem.config import DEFAULT_GATEWAY_PORT, DEFAULT_HTTP_PORT  # noqa: E402

STAGES = ("prefill", "decode", "gateway", "draft")


def _exec_stage(stage: str, argv: list[str]) -> None:
    # Stages live in services/; tandem/ never imports them, it runs them as modules.
    os.execv(sys.executable, [sys.executable, "-m", f"services.{stage}", *argv])


# ---- tandem up --------------------------------------------------------------------------------
@dataclass
class Child:
    stage: str
    address: str
    proc: subprocess.Popen
    log_path: str
    cmd: list[str]
    failures: int = 0
    started: float = 0.0

    def tail(self, n: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


def _die_with_parent() -> None:
    # A stage must not outlive `tandem up`, even when `tandem up` is killed with SIGKILL.
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _spawn(cmd: list[str], log_path: str, append: bool = False) -> subprocess.Popen:
    logf = open(log_path, "a" if append else "w")  # noqa: SIM115 - the child owns it
    env = _stage_env(cmd[2].removeprefix("services."))  # cmd: python -m services.<stage> ...
    return subprocess.Popen(
        cmd,
        stdout=logf,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
        preexec_fn=_die_with_parent,
    )


def _wait_healthy(children: list[Child], timeout: float) -> None:
    import asyncio

    from tandem.rpc.health import check

    deadline = time.monotonic() + timeout
    pending = list(children)
    while pending:
        for c in list(pending):
            if c.proc.poll() is not None:
                raise RuntimeError(
                    f"{c.stage} (pid {c.proc.pid}) exited with code {c.proc.returncode} during start-up; "
                    f"last lines of {c.log_path}:\n{c.tail()}"
                )
            if asyncio.run(check(c.address, timeout=1.0)):
                pending.remove(c)
        if time.monotonic() > deadline:
            names = ", ".join(c.stage for c in pending)
            raise RuntimeError(
                f"timed out after {timeout:.0f}s waiting for {names} to become healthy"
            )
        if pending:
            time.sleep(0.3)


def _stop(children: list[Child]) -> None:
    for c in reversed(children):
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for c in children:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()


def _stage_env(stage: str) -> dict[str, str]:
    """The environment of a stage: one OTEL_SERVICE_NAME per process (`<name>-<stage>`)."""
    env = dict(os.environ)
    name = env.get("OTEL_SERVICE_NAME")
    if name:
        env["OTEL_SERVICE_NAME"] = f"{name}-{stage}"
    return env


def _gateway_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split `tandem up`'s pass-through flags: the gateway's own settings (`GatewayConfig`, e.g.
    --disagg-threshold, --ttft-slo-ms, --shed-load) go to the gateway only, the rest to all."""
    from dataclasses import fields

    from tandem.config import GatewayConfig, add_gateway_args

    gp = argparse.ArgumentParser(add_help=False)
    add_gateway_args(gp)
    ns, rest = gp.parse_known_args(argv)
    gateway = []
    for f in fields(GatewayConfig):
        v = getattr(ns, f.name)
        if v is not None:
            gateway += ["--" + f.name.replace("_", "-"), str(v)]
    return gateway, rest


def cmd_up(args: argparse.Namespace, engine_argv: list[str]) -> int:
    gateway_argv, engine_argv = _gateway_argv(engine_argv)
    host = args.host
    port = args.port
    http_port = args.http_port
    if http_port is None:
        http_port = DEFAULT_HTTP_PORT if port == DEFAULT_GATEWAY_PORT else port + 3
    prefill_port = args.prefill_port or port + 1
    decode_port = args.decode_port or port + 2
    # Prometheus /metrics of each stage: its gRPC port + 1000 unless given; -1 turns all off.
    metrics_ports = {
        "gateway": args.metrics_port if args.metrics_port is not None else port + 1000,
        "prefill": args.prefill_metrics_port or prefill_port + 1000,
        "decode": args.decode_metrics_port or decode_port + 1000,
        "draft": (args.draft_port or port + 4) + 1000,
    }
    if args.metrics_port is not None and args.metrics_port < 0:
        metrics_ports = dict.fromkeys(metrics_ports, -1)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix=f"tandem-{port}-")
    os.makedirs(log_dir, exist_ok=True)
    common = ["--host", host, *engine_argv]
    if args.model:
        common += ["--model", args.model]
    prefill_addr = f"{host}:{prefill_port}"
    decode_addr = f"{host}:{decode_port}"
    draft_port = args.draft_port or port + 4
    draft_addr = f"{host}:{draft_port}"
    plan = [
        ("prefill", prefill_addr, ["--port", str(prefill_port)]),
        (
            "decode",
            decode_addr,
            [
                "--port",
                str(decode_port),
                "--prefill",
                prefill_addr,
                "--kv-transport",
                args.kv_transport,
            ],
        ),
        (
            "gateway",
            f"{host}:{port}",
            [
                "--port",
                str(port),
                "--http-port",
                str(http_port),
                "--prefill",
                prefill_addr,
                "--decode",
                decode_addr,
                *gateway_argv,
            ],
        ),
    ]
    if args.draft:
        # The draft worker starts first; decode and gateway are told where it is.
        plan.insert(0, ("draft", draft_addr, ["--port", str(draft_port), "--draft", args.draft]))
        for stage, _, extra in plan:
            if stage in ("decode", "gateway"):
                extra += ["--draft", draft_addr]
            if stage == "decode" and args.spec_k is not None:
                extra += ["--spec-k", str(args.spec_k)]
    # Per-stage devices (prefill and decode on separate GPUs): the last --device on a command
    # line wins, so these follow the shared flags.
    for stage, _, extra in plan:
        dev = getattr(args, f"{stage}_device", None)
        if dev:
            extra += ["--device", dev]
    children: list[Child] = []

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        for stage, addr, extra in plan:
            log_path = os.path.join(log_dir, f"{stage}.log")
            cmd = [sys.executable, "-m", f"services.{stage}", *common, *extra]
            cmd += ["--metrics-port", str(metrics_ports[stage])]
            children.append(Child(stage, addr, _spawn(cmd, log_path), log_path, cmd))
        _wait_healthy(children, args.start_timeout)
        print(f"Tandem is up (logs in {log_dir})", flush=True)
        print(f"  gateway gRPC  {host}:{port}   (tandem.v1.Gateway; reflection on)", flush=True)
        if http_port >= 0:
            print(f"  OpenAI HTTP   http://{host}:{http_port}/v1", flush=True)
        print(f"  prefill       {prefill_addr}", flush=True)
        print(f"  decode        {decode_addr}", flush=True)
        if args.draft:
            print(f"  draft         {draft_addr}   ({args.draft})", flush=True)
        if metrics_ports["gateway"] >= 0:
            urls = "  ".join(
                f"{s}=http://{host}:{metrics_ports[s]}/metrics"
                for s in ("gateway", "prefill", "decode")
            )
            print(f"  metrics       {urls}", flush=True)
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        if endpoint:
            print(f"  traces        OTLP/gRPC to {endpoint}", flush=True)
        if args.then_chat:
            rc = cmd_chat(
                argparse.Namespace(
                    message=args.then_chat,
                    address=f"{host}:{port}",
                    max_tokens=128,
                    temperature=0.0,
                    system=None,
                    seed=None,
                ),
            )
            if rc != 0:
                return rc
            print("Still serving; Ctrl-C stops every stage.", flush=True)
        while True:
            for c in children:
                if c.proc.poll() is None:
                    if c.failures and time.monotonic() - c.started > 60:
                        c.failures = 0  # it stayed up: the next crash starts the backoff again
                    continue
                print(
                    f"tandem up: {c.stage} (pid {c.proc.pid}) exited with code {c.proc.returncode}; "
                    f"last lines of {c.log_path}:\n{c.tail()}",
                    file=sys.stderr,
                    flush=True,
                )
                if not args.restart:
                    return 1
                delay = min(30.0, 2.0**c.failures)
                c.failures += 1
                print(
                    f"tandem up: restarting {c.stage} in {delay:.0f}s", file=sys.stderr, flush=True
                )
                time.sleep(delay)
                c.proc = _spawn(c.cmd, c.log_path, append=True)
                c.started = time.monotonic()
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("stopping...", flush=True)
        return 0
    except RuntimeError as e:
        print(f"tandem up: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        _stop(children)


# ---- tandem chat ------------------------------------------------------------------------------
def cmd_chat(args: argparse.Namespace) -> int:
    import grpc

    from tandem.rpc import api_pb2, api_pb2_grpc

    msgs = []
    if args.system:
        msgs.append(api_pb2.ChatMessage(role="system", content=args.system))
    msgs.append(api_pb2.ChatMessage(role="user", content=args.message))
    sampling = api_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.seed is not None:
        sampling.seed = args.seed
    req = api_pb2.GenerateRequest(messages=api_pb2.ChatMessages(messages=msgs), sampling=sampling)
    t0 = time.monotonic()
    with grpc.insecure_channel(args.address) as ch:
        stub = api_pb2_grpc.GatewayStub(ch)
        try:
            for resp in stub.Generate(req):
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
            print(f"\ntandem chat: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


# ---- entry ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in STAGES:
        _exec_stage(argv[0], argv[1:])
    p = argparse.ArgumentParser(prog="tandem", description="Tandem: disaggregated LLM serving.")
    sub = p.add_subparsers(dest="cmd", required=True)
    for s in STAGES:
        sub.add_parser(s, help=f"run the {s} service (see `tandem {s} --help`)")
    up = sub.add_parser(
        "up", help="start every stage on this host, wait for health, print endpoints"
    )
    up.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT, help="gateway gRPC port")
    up.add_argument(
        "--http-port",
        type=int,
        default=None,
        help=f"OpenAI HTTP port (default {DEFAULT_HTTP_PORT} with the default --port, else port+3)",
    )
    for st in ("prefill", "decode", "draft"):
        up.add_argument(
            f"--{st}-device",
            default=None,
            help=f"the {st} worker's device, e.g. cuda:1 (default: --device, for every stage)",
        )
    up.add_argument("--prefill-port", type=int, default=None, help="default: port+1")
    up.add_argument("--decode-port", type=int, default=None, help="default: port+2")
    up.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="gateway Prometheus /metrics port (default: port+1000; -1: no stage serves metrics)",
    )
    up.add_argument(
        "--prefill-metrics-port", type=int, default=None, help="default: prefill-port+1000"
    )
    up.add_argument(
        "--decode-metrics-port", type=int, default=None, help="default: decode-port+1000"
    )
    up.add_argument(
        "--kv-transport",
        choices=["auto", "cuda_ipc", "shm", "nixl", "inline"],
        default="auto",
        help="how KV moves from prefill to decode (auto: CUDA IPC or shared memory on one host, "
        "NIXL between hosts)",
    )
    up.add_argument(
        "--draft",
        default=None,
        help="speculative decoding with a draft worker: ngram, self:N, self-int4, "
        "self-int4:DIR or a model path",
    )
    up.add_argument("--draft-port", type=int, default=None, help="default: port+4")
    up.add_argument("--spec-k", type=int, default=None, help="fixed speculation length")
    up.add_argument("--log-dir", default=None)
    up.add_argument(
        "--restart",
        action="store_true",
        help="restart a stage that dies (exponential backoff, 1 s doubling to 30 s)",
    )
    up.add_argument("--start-timeout", type=float, default=180.0)
    up.add_argument(
        "--then-chat",
        default=None,
        metavar="MESSAGE",
        help="once healthy, stream one chat reply to MESSAGE, then keep serving",
    )
    chat = sub.add_parser("chat", help="stream a chat reply from a running gateway")
    chat.add_argument("message")
    chat.add_argument("--address", default=f"127.0.0.1:{DEFAULT_GATEWAY_PORT}")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--system", default=None)
    chat.add_argument("--seed", type=int, default=None)
    from tandem.quant.cli import add_quantize_args, run_quantize

    quantize = sub.add_parser(
        "quantize", help="profile a model's weights, or write an INT4/INT8 checkpoint (AWQ/RTN)"
    )
    add_quantize_args(quantize)
    args, rest = p.parse_known_args(argv)
    if args.cmd == "up":
        return cmd_up(args, rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "quantize":
        return run_quantize(args)
    return cmd_chat(args)


if __name__ == "__main__":
    sys.exit(main())
