"""`tandem up`: every stage on this host as child processes, shown while they start, supervised.

The stages run as `python -m services.<stage>` (tandem/ never imports services/); each setting is
checked before anything starts, and a stage that exits is restarted (`--restart`) or stops the
rest.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from tandem.chat import cmd_chat
from tandem.config import EngineConfig, GatewayConfig, StageAuthConfig, StageTlsConfig
from tandem.config_options import dataclass_from_args
from tandem.credentials import gateway_secret, role_secrets, stage_secret
from tandem.kv.sizing import GIB, NON_TORCH_BYTES, ModelShape, activation_bytes
from tandem.model.info import context_length, load_model_config
from tandem.progress import LOGGER as PROGRESS_LOGGER
from tandem.stage_args import (
    DEFAULT_GATEWAY_PORT,
    DEFAULT_HTTP_PORT,
    add_engine_args,
    add_gateway_args,
    add_metrics_auth_args,
    add_stage_auth_args,
    engine_config_from_args,
    gateway_config_from_args,
    metrics_token_from_args,
    stage_parser,
)
from tandem.tenants import load_api_keys

STAGES = ("prefill", "decode", "gateway", "draft")
# Ports of a stage's further workers (--prefill-workers, --decode-workers): worker i listens on
# the stage's port + WORKER_PORT_STRIDE * i, clear of the gateway's neighbours (port+1..port+4).
WORKER_PORT_STRIDE = 10
# What a prefill worker's share holds beyond what it needs (`_prefill_need`): the allocator's
# rounding and the small buffers beside the weights (rotary tables, sampling state).
PREFILL_MARGIN = 0.05


def exec_stage(stage: str, argv: list[str]) -> None:
    """Replace this process with the stage `stage` (its own command line `argv`)."""
    # Stages live in services/; tandem/ never imports them, it runs them as modules.
    os.execv(sys.executable, [sys.executable, "-m", f"services.{stage}", *argv])


# Flags of `tandem up` that go to one stage only, beside the engine settings every stage takes and
# the gateway's own (GatewayConfig). Each is declared once, in the stage parsers (stage_args.py).
STAGE_FLAGS = {
    "prefill": ["--lease-ttl", "--max-leases-per-peer"],
    "decode": [
        "--prefill-wait",
        "--kv-transfer-timeout",
        "--kv-reservation-ttl",
        "--spec-k-min",
        "--spec-k-max",
        "--draft-timeout-ms",
    ],
    "draft": ["--draft-blocks"],
}


@dataclass
class Child:
    stage: str
    proc: subprocess.Popen
    log_path: str
    cmd: list[str]
    failures: int = 0
    started: float = 0.0
    ready: bool = False
    _offset: int = 0

    def tail(self, n: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def progress(self) -> list[str]:
        """The progress lines the stage logged since the last call (tandem/progress.py)."""
        try:
            with open(self.log_path, errors="replace") as f:
                f.seek(self._offset)
                text = f.read()
        except OSError:
            return []
        # Only whole lines: a line still being written is read next time.
        cut = text.rfind("\n") + 1
        self._offset += len(text[:cut].encode(errors="replace"))
        marker = f" {PROGRESS_LOGGER}: "
        return [ln.split(marker, 1)[1] for ln in text[:cut].splitlines() if marker in ln]


def _die_with_parent() -> None:
    # A stage must not outlive `tandem up`, even when `tandem up` is killed with SIGKILL.
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(frozen=True)
class Secrets:
    """The credentials `tandem up` hands out: the workers' stage secret, the gateway's, the
    metrics token (None: /metrics open) and, with `--stage-mtls auto`, each stage's TLS files
    as its TANDEM_STAGE_TLS_* variables."""

    stage: str
    gateway: str
    metrics_token: str | None = field(default=None, repr=False)
    tls: dict[str, dict[str, str]] = field(default_factory=dict)

    def env(self, stage: str) -> dict[str, str]:
        """The credentials of `stage`, as variables (a command line is public): every stage
        gets the gateway secret (the workers check it), only the workers the stage secret;
        every stage the metrics token and its own TLS files."""
        env = {"TANDEM_GATEWAY_SECRET": self.gateway}
        if stage != "gateway":
            env["TANDEM_STAGE_SECRET"] = self.stage
        if self.metrics_token is not None:
            env["TANDEM_METRICS_TOKEN"] = self.metrics_token
        return {**env, **self.tls.get(stage, {})}


def _spawn(
    cmd: list[str], log_path: str, credentials: Secrets, append: bool = False
) -> subprocess.Popen:
    logf = open(log_path, "a" if append else "w")  # noqa: SIM115 - the child owns it
    stage = _stage_of(cmd)
    env = {**_stage_env(stage), **credentials.env(stage)}
    return subprocess.Popen(
        cmd,
        stdout=logf,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
        preexec_fn=_die_with_parent,
    )


def _stage_of(cmd: list[str]) -> str:
    """The stage a child's command runs (cmd: python -m services.<stage> ...)."""
    return cmd[2].removeprefix("services.")


def _devices(value: str | None) -> list[str]:
    """The devices of a --device flag: one, or a comma list (empty: not given)."""
    return [d.strip() for d in (value or "").split(",") if d.strip()]


def _cuda_driver() -> ctypes.CDLL | None:
    """The CUDA driver library, initialized, or None where there is none or it finds no device.
    Loading it makes no CUDA context."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return cuda if cuda.cuInit(0) == 0 else None


def _host_has_gpu() -> bool:
    """Whether a stage given no --device would run on a GPU: torch's "auto" resolves to cuda.

    Asked as torch would answer, without importing it (a second and more before any stage
    starts): a CUDA build of torch, and a CUDA driver that counts a device this process may use
    (it honours CUDA_VISIBLE_DEVICES). No CUDA context is made."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    libs = [os.path.join(d, "lib", "libtorch_cuda*") for d in spec.submodule_search_locations]
    if not any(glob.glob(pattern) for pattern in libs):
        return False  # a CPU build
    cuda = _cuda_driver()
    count = ctypes.c_int(0)
    return cuda is not None and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def _gpu_total_memory(device: str) -> int | None:
    """The memory of the CUDA device `device` ("cuda" is cuda:0) in bytes, as the CUDA driver
    counts it (the devices CUDA_VISIBLE_DEVICES leaves, as torch numbers them); None where it
    cannot be read. No torch, no CUDA context."""
    cuda = _cuda_driver()
    if cuda is None:
        return None
    index = int(device.partition(":")[2] or 0)
    handle, total = ctypes.c_int(0), ctypes.c_size_t(0)
    if cuda.cuDeviceGet(ctypes.byref(handle), index) != 0:
        return None
    if cuda.cuDeviceTotalMem_v2(ctypes.byref(total), handle) != 0:
        return None
    return total.value


def default_prefill_workers(args: argparse.Namespace) -> tuple[int, str]:
    """--prefill-workers when not given, and why.

    Where the prefill and decode workers would share one GPU, none: two processes on one device
    run by time slices, while one engine mixes prompt chunks into its decode steps (on an H100,
    ShareGPT-like load through the services kept 0.96-1.0 of the engine's throughput with none
    and 0.87-0.95 with one; `bench/results/h100_one_gpu.json`). Where a prefill-only setting
    is given, the stages get devices of their own or run on the CPU: one."""
    wanted = [f"--{f.replace('_', '-')}" for f in ("prefill_device", "prefill_port",
              "prefill_metrics_port", "disagg_threshold") if getattr(args, f, None) is not None]  # fmt: skip
    if getattr(args, "kv_transport", "auto") != "auto":
        wanted.append("--kv-transport")
    if wanted:
        return 1, f"{', '.join(wanted)} given"
    shared = _devices(args.device)
    if len(shared) > 1:
        return 1, "several devices"
    decode = set(_devices(args.decode_device)) or set(shared) or {"auto"}
    prefill = shared[0] if shared else "auto"
    if decode != {prefill}:
        return 1, "the stages have devices of their own"
    if prefill.startswith("cuda") or (prefill == "auto" and _host_has_gpu()):
        return 0, "the stages share one GPU"
    return 1, "the CPU"


def _memory_shares(
    args: argparse.Namespace, procs: list[tuple[str, str, list[str], int]]
) -> list[tuple[str, float, str, str]]:
    """Split --gpu-memory-utilization among the workers that hold a model on one GPU.

    A worker whose KV pool is not sized (--num-blocks, --kv-cache-memory-gb) takes that share
    of its device's memory; two on one device would each take it all. Each worker of a shared
    device gets an equal part (appended to its own flags: the last one wins), except where
    prefill and decode workers share it: a prefill worker hands each prompt's KV to a decode
    worker and frees it, so it gets what it needs (`_prefill_need`) and the decode workers,
    whose pools hold every running sequence, what the others leave. Returns (worker, its share,
    the device, how the share was found: "" for an equal part) for each worker given one."""

    def given(name: str) -> str | None:  # a flag, else its TANDEM_* variable (non-empty)
        v = getattr(args, name, None)
        env = os.environ.get(f"TANDEM_{name.upper()}", "").strip()
        return str(v) if v is not None else env if env.lower() not in ("", "none") else None

    if given("num_blocks") is not None or given("kv_cache_memory_gb") is not None:
        return []
    total = float(given("gpu_memory_utilization") or EngineConfig.gpu_memory_utilization)
    by_device: dict[str, list[tuple[str, str, list[str]]]] = {}
    gpu: bool | None = None
    for stage, name, own, _ in procs:
        if stage == "gateway" or (stage == "draft" and args.draft == "ngram"):
            continue  # holds no model on a device
        device = own[own.index("--device") + 1] if "--device" in own else args.device or "auto"
        if device == "auto":
            gpu = _host_has_gpu() if gpu is None else gpu
            device = "cuda" if gpu else "cpu"
        if not device.startswith("cuda"):
            continue
        device = "cuda:0" if device == "cuda" else device
        by_device.setdefault(device, []).append((stage, name, own))
    out = []
    for device, workers in by_device.items():
        if len(workers) < 2:
            continue
        equal = round(total / len(workers), 4)
        shares = {name: (equal, "") for _, name, _ in workers}
        stages = [stage for stage, _, _ in workers]
        if "prefill" in stages and "decode" in stages:
            shares.update(_prefill_decode_shares(args, device, workers, total, equal))
        for _, name, own in workers:
            share, why = shares[name]
            own += ["--gpu-memory-utilization", str(share)]
            out.append((name, share, device, why))
    return out


def _prefill_decode_shares(
    args: argparse.Namespace,
    device: str,
    workers: list[tuple[str, str, list[str]]],
    total: float,
    equal: float,
) -> dict[str, tuple[float, str]]:
    """{worker: (its share, why)} for the prefill and decode `workers` (stage, name, own flags)
    of `device`, which share `total`: each prefill worker what it needs of the device, rounded
    up, and the decode workers equal parts of what is left once every other worker (a model
    draft) has its `equal` part. Where the need cannot be found, or leaves a prefill worker no
    less than an equal part, every worker keeps `equal` and the prefill workers say why."""
    prefill = [name for stage, name, _ in workers if stage == "prefill"]
    decode = [name for stage, name, _ in workers if stage == "decode"]
    others = [name for stage, name, _ in workers if stage not in ("prefill", "decode")]

    def equal_parts(reason: str) -> dict[str, tuple[float, str]]:
        return {name: (equal, f"an equal part: {reason}") for name in prefill}

    device_bytes = _gpu_total_memory(device)
    if device_bytes is None:
        return equal_parts(f"the memory of {device} could not be read from the CUDA driver")
    try:
        config = _engine_config(args)
        need, what = _prefill_need(config)
    except Exception as e:  # whatever fails keeps the equal split, and says why
        return equal_parts(f"what a prefill worker needs could not be found ({e})")
    share = math.ceil(need / device_bytes * 1e4) / 1e4
    what = f"{need / GIB:.1f} GiB of {device_bytes / GIB:.1f} GiB: {what}"
    if share >= equal:
        return equal_parts(f"a prefill worker needs {share:g}, no less than an equal part; {what}")
    rest = (total - share * len(prefill) - equal * len(others)) / len(decode)
    rest = math.floor(round(rest * 1e4, 6)) / 1e4
    if rest < equal:
        return equal_parts(f"a prefill worker's {share:g} would leave a decode worker {rest:g}")
    taken = [f"{share:g} for {name}" for name in prefill] + [f"{equal:g} for {n}" for n in others]
    return {
        **{name: (share, what) for name in prefill},
        **{name: (rest, f"the rest of {total:g} after {', '.join(taken)}") for name in decode},
    }


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings every worker `tandem up` starts shares (its flags, then TANDEM_*
    variables, then defaults); --device is left out: it may list one device a worker."""
    return engine_config_from_args(argparse.Namespace(**{**vars(args), "device": None}))


def _prefill_need(config: EngineConfig) -> tuple[int, str]:
    """The bytes of its GPU a prefill worker of `config` needs, and of what (for the line
    `tandem up` prints): its weights, what it holds outside torch and beside them
    (tandem/kv/sizing.py), and a KV pool of one longest prompt or two full steps of tokens,
    whichever is more; PREFILL_MARGIN on top. Raises where the model's config cannot be read."""
    mc = load_model_config(config.model)
    # As a worker on a GPU resolves them (tandem/device.py): "auto" is bfloat16, and the KV
    # pool holds the model's dtype unless it is FP8 or INT8.
    dtype_bytes = 4 if config.dtype == "float32" else 2
    kv_dtype_bytes = dtype_bytes if config.kv_dtype == "auto" else 1
    weights = mc.num_parameters() * dtype_bytes
    shape = ModelShape(mc.hidden_size, mc.intermediate_size, mc.num_heads,
                       mc.num_kv_heads, mc.head_dim, mc.vocab_size)  # fmt: skip
    activations = activation_bytes(
        shape, config.max_num_batched_tokens, config.max_num_seqs, dtype_bytes
    )
    longest = context_length(config.max_model_len, mc.max_position_embeddings)
    tokens = max(2 * config.max_num_batched_tokens, longest)
    pool = tokens * 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * kv_dtype_bytes
    need = math.ceil((weights + NON_TORCH_BYTES + activations + pool) * (1 + PREFILL_MARGIN))
    what = (
        f"weights {weights / GIB:.1f} GiB, KV {pool / GIB:.1f} GiB for {tokens} tokens, "
        f"activations {activations / GIB:.1f} GiB, {NON_TORCH_BYTES / GIB:.0f} GiB outside "
        f"torch, {PREFILL_MARGIN:.0%} margin"
    )
    return need, what


@dataclass
class Worker:
    """One prefill or decode worker `tandem up` starts."""

    stage: str
    name: str  # "decode" alone, "decode0", "decode1", ... when there are several
    port: int
    metrics_port: int
    device: str | None


def _workers(args: argparse.Namespace, base: dict[str, int], metrics: dict[str, int]) -> list:
    """The prefill workers, then the decode workers, with their ports and devices (raises
    ValueError naming a bad count or device)."""
    shared = _devices(args.device)
    out: list[Worker] = []
    turn = 0
    for stage in ("prefill", "decode"):
        n = getattr(args, f"{stage}_workers")
        if n is None:  # --prefill-workers not given
            n = default_prefill_workers(args)[0]
        least = 0 if stage == "prefill" else 1  # none: the decode workers prefill every prompt
        if n < least:
            raise ValueError(f"--{stage}-workers must be >= {least}, got {n}")
        own = _devices(getattr(args, f"{stage}_device", None))
        for i in range(n):
            if own:
                device = own[i % len(own)]
            elif len(shared) > 1:
                device = shared[turn % len(shared)]
                turn += 1
            else:
                device = None  # the shared --device, if any, reaches every stage as it is
            step = WORKER_PORT_STRIDE * i
            out.append(
                Worker(
                    stage,
                    stage if n == 1 else f"{stage}{i}",
                    base[stage] + step,
                    metrics[stage] + step if metrics[stage] >= 0 else -1,
                    device,
                )
            )
    return out


def _wait_ready(children: list[Child], timeout: float, t0: float) -> None:
    """Show each stage's progress until every one reports `ready`; fail at a death or timeout."""
    deadline = time.monotonic() + timeout
    width = max(len(c.stage) for c in children)
    while True:
        for c in children:
            for line in c.progress():
                print(f"  [{time.monotonic() - t0:5.1f}s] {c.stage:<{width}}  {line}", flush=True)
                if line == "ready":
                    c.ready = True
            if c.proc.poll() is not None:
                raise RuntimeError(
                    f"{c.stage} exited with code {c.proc.returncode} during start-up; "
                    f"last lines of {c.log_path}:\n{c.tail()}"
                )
        if all(c.ready for c in children):
            return
        if time.monotonic() > deadline:
            names = ", ".join(c.stage for c in children if not c.ready)
            raise RuntimeError(
                f"timed out after {timeout:.0f}s (--start-timeout) waiting for {names}; "
                f"logs in {os.path.dirname(children[0].log_path)}"
            )
        time.sleep(0.1)


def _stop(children: list[Child]) -> None:
    """Stop the stages front to back (gateway, then decode, then the rest), so that none sees
    a peer vanish while it still serves.

    A second Ctrl-C or SIGTERM meanwhile (a user pressing it twice; `timeout`, which passes its
    signal on to its whole process group) is ignored: the stop is bounded anyway (SIGKILL after
    10 s per stage), and each stage's own SIGTERM handling frees its shared memory."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        order = {"gateway": 0, "decode": 1}
        # Several workers of a stage are named decode0, decode1, ...
        for c in sorted(children, key=lambda c: order.get(c.stage.rstrip("0123456789"), 2)):
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
                try:
                    c.proc.wait(10)
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _stage_env(stage: str) -> dict[str, str]:
    """The environment of a stage: one OTEL_SERVICE_NAME per process (`<name>-<stage>`). The
    stage-TLS certificate and key exported for the workers' ports are not the gateway's, which
    serves no stage port (it would refuse them); it keeps the CA that checks the workers. The
    credentials come from `Secrets.env`, by value: the files or variables `tandem up` read them
    from are not passed on (the gateway must never see the stage secret), nor the metrics
    token's."""
    env = dict(os.environ)
    for var in (
        "TANDEM_STAGE_SECRET",
        "TANDEM_STAGE_SECRET_FILE",
        "TANDEM_GATEWAY_SECRET",
        "TANDEM_GATEWAY_SECRET_FILE",
        "TANDEM_METRICS_TOKEN",
        "TANDEM_METRICS_TOKEN_FILE",
    ):
        env.pop(var, None)
    name = env.get("OTEL_SERVICE_NAME")
    if name:
        env["OTEL_SERVICE_NAME"] = f"{name}-{stage}"
    if stage == "gateway":
        env.pop("TANDEM_STAGE_TLS_CERT", None)
        env.pop("TANDEM_STAGE_TLS_KEY", None)
    return env


def add_up_args(up: argparse.ArgumentParser) -> None:
    """`tandem up`'s own flags, then the settings it passes to the stages, grouped."""
    up.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    up.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the gateway binds: its gRPC, HTTP and /metrics ports (default %(default)s)",
    )
    up.add_argument(
        "--stage-host",
        default="127.0.0.1",
        help="address the prefill, decode and draft workers bind (default %(default)s: only "
        "this host reaches them, whatever --host says)",
    )
    up.add_argument(
        "--port",
        type=int,
        default=DEFAULT_GATEWAY_PORT,
        help="gateway gRPC port (default %(default)s)",
    )
    up.add_argument(
        "--http-port",
        type=int,
        default=None,
        help=f"OpenAI HTTP port (default {DEFAULT_HTTP_PORT} with the default --port, else "
        "port+3; -1: none)",
    )
    for st in ("prefill", "decode", "draft"):
        up.add_argument(
            f"--{st}-device",
            default=None,
            help=f"the {st} worker's device, e.g. cuda:1, or a comma list given to its workers in "
            "turn (default: --device, which may be a comma list too: its devices go to the "
            "prefill workers, then the decode workers, in turn; the draft worker takes the first)",
        )
    for st in ("prefill", "decode"):
        up.add_argument(
            f"--{st}-workers",
            type=int,
            default=None if st == "prefill" else 1,
            help=f"{st} workers to start"
            + (
                " (default: none where the stages would share one GPU, else 1); 0: none, the "
                "decode workers prefill every prompt"
                if st == "prefill"
                else " (default %(default)s)"
            )
            + f"; the gateway routes each request to the one holding the longest cached prefix "
            f"of it. Worker i listens on the {st} port + {WORKER_PORT_STRIDE}*i (its /metrics "
            "likewise)",
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
    up.add_argument(
        "--stage-mtls",
        choices=["auto"],
        default=None,
        help="auto: mutual TLS between the stages, with a CA and a certificate per stage made "
        "at start into a private temporary folder and removed at exit; a stage port then takes "
        "only callers presenting one of them (default: plaintext, or what the exported "
        "TANDEM_STAGE_TLS_* and TANDEM_STAGE_MTLS variables set)",
    )
    up.add_argument("--spec-k", type=int, default=None, help="fixed speculation length")
    up.add_argument(
        "--log-dir", default=None, help="where the stage logs go (default: a new temporary folder)"
    )
    up.add_argument(
        "--log-level",
        default=None,
        help="log level of every stage (default INFO, or TANDEM_LOG_LEVEL)",
    )
    up.add_argument(
        "--restart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="restart a stage that dies, with exponential backoff (1 s doubling to 30 s) while "
        "the others keep serving (default on; --no-restart: stop everything instead)",
    )
    up.add_argument(
        "--start-timeout", type=float, default=600.0, help="seconds (default %(default)s)"
    )
    up.add_argument(
        "--then-chat",
        default=None,
        metavar="MESSAGE",
        help="once ready, stream one chat reply to MESSAGE, then keep serving",
    )
    add_engine_args(
        up.add_argument_group("engine settings, for every stage (or TANDEM_<NAME> variables)"),
        skip=("model",),
    )
    add_gateway_args(up.add_argument_group("gateway settings (or TANDEM_<NAME> variables)"))
    add_stage_auth_args(
        up.add_argument_group(
            "stage credentials (default: fresh random secrets at every start, or "
            "TANDEM_STAGE_SECRET and TANDEM_GATEWAY_SECRET)"
        )
    )
    add_metrics_auth_args(
        up.add_argument_group(
            "metrics credential, for every stage's /metrics (default: none, or "
            "TANDEM_METRICS_TOKEN)"
        )
    )
    for stage, flags in STAGE_FLAGS.items():
        group = up.add_argument_group(f"{stage} worker settings")
        for action in stage_parser(stage)._actions:
            if action.option_strings and action.option_strings[0] in flags:
                group._add_action(action)


def _stage_argv(args: argparse.Namespace) -> dict[str, list[str]]:
    """The flags each stage gets from `tandem up`'s parsed settings (only those given)."""
    from dataclasses import fields

    def flag(name: str, value) -> list[str]:
        return ["--" + name.replace("_", "-"), str(value)]

    common: list[str] = []
    for f in fields(EngineConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            common += flag(f.name, v)
    if args.log_level is not None:
        common += ["--log-level", args.log_level]
    out = {st: list(common) for st in STAGES}
    for f in fields(GatewayConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            out["gateway"] += flag(f.name, v)
    for stage, flags in STAGE_FLAGS.items():
        for fl in flags:
            v = getattr(args, fl[2:].replace("-", "_"), None)
            if v is not None:
                out[stage] += [fl, str(v)]
    return out


def _secrets(args: argparse.Namespace) -> Secrets:
    """The workers' stage secret and the gateway's secret: those given (TANDEM_STAGE_SECRET or
    --stage-secret-file, TANDEM_GATEWAY_SECRET or --gateway-secret-file), else fresh random
    ones, so that no stage port is ever open and the gateway never holds a worker's key."""
    import secrets

    cfg = dataclass_from_args(StageAuthConfig, args)
    stage, gateway = stage_secret(cfg), gateway_secret(cfg)
    metrics = metrics_token_from_args(args)
    out = Secrets(
        stage=stage.decode() if stage is not None else secrets.token_urlsafe(32),
        gateway=gateway.decode() if gateway is not None else secrets.token_urlsafe(32),
        metrics_token=metrics.decode() if metrics is not None else None,
    )
    role_secrets(StageAuthConfig(stage_secret=out.stage, gateway_secret=out.gateway), "decode")
    return out


def _auto_mtls(directory: str, stage_host: str) -> dict[str, dict[str, str]]:
    """`--stage-mtls auto`: a throwaway CA and a certificate per stage in `directory` (private,
    removed at exit), as each stage's TANDEM_STAGE_TLS_* variables. The workers serve theirs and
    present it to the stages they call; the gateway presents a client certificate."""
    from tandem.stage_certs import make_stage_certs

    workers = ["prefill", "decode", "draft"]
    hosts = ["127.0.0.1", "localhost", "::1", stage_host]
    files = make_stage_certs(directory, workers, ["gateway"], hosts)
    env = {}
    for stage, f in files.items():
        kind = "CLIENT_" if stage == "gateway" else ""
        env[stage] = {
            "TANDEM_STAGE_TLS_CA": f.ca,
            f"TANDEM_STAGE_TLS_{kind}CERT": f.cert,
            f"TANDEM_STAGE_TLS_{kind}KEY": f.key,
            "TANDEM_STAGE_MTLS": "true",
        }
    return env


def _then_chat_key(args: argparse.Namespace) -> str | None:
    """An API key the gateway accepts (--then-chat's reply must pass its check), or None."""
    cfg = gateway_config_from_args(args)
    if cfg.api_key:
        return cfg.api_key
    return next(iter(load_api_keys(cfg.api_keys)), None) if cfg.api_keys else None


def _dial(host: str) -> str:
    """The address to connect to a server bound to `host` from this host."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _validate_up(args: argparse.Namespace, ports: list[tuple[str, int]]) -> str | None:
    """What is wrong with `tandem up`'s settings, before anything starts (None: nothing)."""
    if args.model is not None and not os.path.exists(os.path.expanduser(args.model)):
        return f"--model {args.model}: no such file or directory"
    if args.prefill_workers == 0:
        given = [f"--{f.replace('_', '-')}" for f in ("prefill_device", "prefill_port",
                 "prefill_metrics_port") if getattr(args, f, None) is not None]  # fmt: skip
        if given:
            return f"{', '.join(given)}: --prefill-workers 0 starts no prefill worker"
    for flag in ("device", "prefill_device", "decode_device", "draft_device"):
        for device in _devices(getattr(args, flag, None)):
            try:
                EngineConfig(device=device).validate()
            except ValueError as e:
                return f"--{flag.replace('_', '-')}: {e}"
    taken: dict[tuple[str, int], int] = {}
    for host, port in ports:
        taken[(host, port)] = taken.get((host, port), 0) + 1
    twice = sorted(f"{h}:{p}" for (h, p), n in taken.items() if n > 1)
    if twice:
        return (
            f"two stages would listen on {', '.join(twice)}: choose other ports (workers past "
            f"the first of a stage take its port + {WORKER_PORT_STRIDE}*i)"
        )
    try:
        _engine_config(args)
        gateway_config_from_args(args)
        _secrets(args)
    except (TypeError, ValueError) as e:
        return str(e)
    if args.stage_mtls == "auto":
        from dataclasses import fields

        try:
            # The variables alone: `tandem up` has no stage TLS flags (its --stage-mtls is its own).
            tls = dataclass_from_args(StageTlsConfig, argparse.Namespace())
        except ValueError as e:
            return str(e)
        given = [f.name for f in fields(tls) if getattr(tls, f.name) not in (None, False)]
        if given:
            names = ", ".join(f"TANDEM_{n.upper()}" for n in given)
            return (
                f"--stage-mtls auto makes the stages' certificates itself, but {names} is set: "
                "unset it, or leave out --stage-mtls auto to use your own certificates "
                "(TANDEM_STAGE_TLS_* with TANDEM_STAGE_MTLS=true)"
            )
    for host, port in ports:
        problem = _cannot_listen(host, port)
        if problem is not None:
            return problem
    return None


def _cannot_listen(host: str, port: int) -> str | None:
    """Why a stage could not listen on host:port, or None. The probe binds as the stages' servers
    do (gRPC, aiohttp and the metrics server all set SO_REUSEADDR): connections of a stopped
    stage left in TIME_WAIT do not hold its port."""
    import socket

    if not 0 < port < 65536:
        return f"cannot listen on {host}:{port}: a port must be in 1-65535"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return (
                f"cannot listen on {host}:{port} ({e.strerror}); is another Tandem running? "
                "choose another --port"
            )
    return None


def cmd_up(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    t0 = time.monotonic()
    host = args.host
    port = args.port
    http_port = args.http_port
    if http_port is None:
        http_port = DEFAULT_HTTP_PORT if port == DEFAULT_GATEWAY_PORT else port + 3
    prefill_port = args.prefill_port or port + 1
    decode_port = args.decode_port or port + 2
    draft_port = args.draft_port or port + 4
    # Prometheus /metrics of each stage: its gRPC port + 1000 unless given; -1 turns all off.
    metrics_ports = {
        "gateway": args.metrics_port if args.metrics_port is not None else port + 1000,
        "prefill": args.prefill_metrics_port or prefill_port + 1000,
        "decode": args.decode_metrics_port or decode_port + 1000,
        "draft": draft_port + 1000,
    }
    if args.metrics_port is not None and args.metrics_port < 0:
        metrics_ports = dict.fromkeys(metrics_ports, -1)
    if args.prefill_workers is None:
        args.prefill_workers, why = default_prefill_workers(args)
        if args.prefill_workers == 0:
            print(
                f"No prefill worker ({why}): the decode worker prefills every prompt; "
                "--prefill-workers 1 starts one",
                flush=True,
            )
    try:
        workers = _workers(args, {"prefill": prefill_port, "decode": decode_port}, metrics_ports)
    except ValueError as e:
        parser.error(str(e))
    stages = ["draft"] if args.draft else []
    stages += [s for s in ("prefill", "decode") if any(w.stage == s for w in workers)]
    stages += ["gateway"]
    names = ([] if not args.draft else ["draft"]) + [w.name for w in workers] + ["gateway"]
    log_dir = args.log_dir or tempfile.mkdtemp(prefix=f"tandem-{port}-")
    os.makedirs(log_dir, exist_ok=True)
    print(f"Starting Tandem: {', '.join(names)} (logs in {log_dir})", flush=True)
    binds = {s: args.host if s == "gateway" else args.stage_host for s in STAGES}
    ports = [(binds["gateway"], port)] + [(args.stage_host, w.port) for w in workers]
    ports += [(args.stage_host, w.metrics_port) for w in workers if w.metrics_port >= 0]
    if args.draft:
        ports.append((binds["draft"], draft_port))
    ports += [
        (binds[s], metrics_ports[s])
        for s in ("gateway", "draft")
        if s in stages and metrics_ports[s] >= 0
    ]
    if http_port >= 0:
        ports.append((host, http_port))
    problem = _validate_up(args, ports)
    if problem:
        parser.error(problem)
    shared_devices = _devices(args.device)
    if len(shared_devices) > 1:
        args.device = shared_devices[0]  # each worker's own follows (the last --device wins)
    argv = _stage_argv(args)
    credentials = _secrets(args)
    stage_host = _dial(args.stage_host)
    addrs = {
        s: ",".join(f"{stage_host}:{w.port}" for w in workers if w.stage == s)
        for s in ("prefill", "decode")
    }
    prefill_addr, decode_addr = addrs["prefill"], addrs["decode"]
    draft_addr = f"{stage_host}:{draft_port}"
    argv["decode"] += ["--prefill", prefill_addr, "--kv-transport", args.kv_transport]
    argv["gateway"] += [
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--prefill",
        prefill_addr,
        "--decode",
        decode_addr,
    ]
    if args.draft:
        argv["draft"] += ["--port", str(draft_port), "--draft", args.draft]
        argv["decode"] += ["--draft", draft_addr]
        argv["gateway"] += ["--draft", draft_addr]
        if args.spec_k is not None:
            argv["decode"] += ["--spec-k", str(args.spec_k)]
    children: list[Child] = []
    procs: list[tuple[str, str, list[str], int]] = []
    if args.draft:
        device = (_devices(args.draft_device) or shared_devices)[:1]
        procs.append(
            ("draft", "draft", ["--device", *device] if device else [], metrics_ports["draft"])
        )
    for w in workers:
        own = ["--port", str(w.port), *(["--device", w.device] if w.device else [])]
        procs.append((w.stage, w.name, own, w.metrics_port))
    procs.append(("gateway", "gateway", [], metrics_ports["gateway"]))
    for name, share, device, why in _memory_shares(args, procs):
        why = f" ({why})" if why else ""
        print(f"{name} shares {device}: --gpu-memory-utilization {share:g}{why}", flush=True)
    for stage, name, own, metrics_port in procs:
        extra = ["--host", binds[stage], *argv[stage], "--metrics-port", str(metrics_port)]
        if args.model:
            extra += ["--model", args.model]
        # Per-stage and per-worker devices (prefill and decode on separate GPUs): the last
        # --device on a command line wins, so these follow the shared flags.
        extra += own
        cmd = [sys.executable, "-m", f"services.{stage}", *extra]
        children.append(Child(name, None, os.path.join(log_dir, f"{name}.log"), cmd))  # type: ignore[arg-type]

    mtls_dir = None
    if args.stage_mtls == "auto":
        # mkdtemp's folder is this user's alone (0700); each file in it is 0600.
        mtls_dir = tempfile.mkdtemp(prefix="tandem-stage-mtls-")
        try:
            credentials = dataclasses.replace(credentials, tls=_auto_mtls(mtls_dir, stage_host))
        except BaseException:
            shutil.rmtree(mtls_dir, ignore_errors=True)
            raise

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # SIGINT too: a process started in the background of a script inherits SIGINT ignored, and
    # Python then leaves it ignored; Ctrl-C or `kill -INT` must still stop every stage.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        width = max(len(c.stage) for c in children)
        for c in children:
            c.proc = _spawn(c.cmd, c.log_path, credentials)
            c.started = time.monotonic()
            print(
                f"  [{c.started - t0:5.1f}s] {c.stage:<{width}}  starting (pid {c.proc.pid})",
                flush=True,
            )
        _wait_ready(children, args.start_timeout, t0)
        print(f"Tandem is up in {time.monotonic() - t0:.1f}s (logs in {log_dir})", flush=True)
        scheme = "https" if args.tls_cert else "http"
        tls = ", TLS" if args.tls_cert else ""
        print(
            f"  gateway gRPC  {host}:{port}   (tandem.v1.Gateway; reflection on{tls})", flush=True
        )
        if http_port >= 0:
            print(f"  OpenAI HTTP   {scheme}://{host}:{http_port}/v1", flush=True)
        print(f"  prefill       {prefill_addr or 'none: the decode workers prefill'}", flush=True)
        print(f"  decode        {decode_addr}", flush=True)
        if args.draft:
            print(f"  draft         {draft_addr}   ({args.draft})", flush=True)
        if mtls_dir is not None:
            print(
                f"  stage mTLS    client certificates required (a CA made for this start, in "
                f"{mtls_dir}, removed at exit)",
                flush=True,
            )
        if metrics_ports["gateway"] >= 0:
            urls = "  ".join(
                [f"gateway=http://{host}:{metrics_ports['gateway']}/metrics"]
                + [f"{w.name}=http://{stage_host}:{w.metrics_port}/metrics" for w in workers]
            )
            token = "  (bearer token)" if credentials.metrics_token is not None else ""
            print(f"  metrics       {urls}{token}", flush=True)
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        if endpoint:
            print(f"  traces        OTLP/gRPC to {endpoint}", flush=True)
        if args.then_chat:
            rc = cmd_chat(
                argparse.Namespace(
                    message=args.then_chat,
                    address=f"{_dial(host)}:{port}",
                    port=None,
                    tls_ca=args.tls_cert,
                    max_tokens=128,
                    temperature=0.0,
                    system=None,
                    seed=None,
                    api_key=_then_chat_key(args),
                ),
            )
            if rc != 0:
                return rc
            print("Still serving; Ctrl-C stops every stage.", flush=True)
        return _supervise(children, args.restart, credentials)
    except KeyboardInterrupt:
        print("stopping...", flush=True)
        return 0
    except RuntimeError as e:
        print(f"tandem up: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        _stop([c for c in children if c.proc is not None])
        if mtls_dir is not None:
            shutil.rmtree(mtls_dir, ignore_errors=True)


def _supervise(children: list[Child], restart: bool, credentials: Secrets) -> int:
    """Watch the stages while they serve: a stage that dies is restarted (the others keep
    serving) or, with --no-restart, stops `tandem up`."""
    while True:
        for c in children:
            c.progress()  # keep the read position at the end of the log
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
            if not restart:
                return 1
            delay = min(30.0, 2.0**c.failures)
            c.failures += 1
            print(f"tandem up: restarting {c.stage} in {delay:.0f}s", file=sys.stderr, flush=True)
            time.sleep(delay)
            c.proc = _spawn(c.cmd, c.log_path, credentials, append=True)
            c.started = time.monotonic()
        time.sleep(0.5)
