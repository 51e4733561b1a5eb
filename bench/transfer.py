"""KV handover benchmark: how fast a prompt's KV moves from a prefill worker to a decode worker.

A real prefill process and one real decode process per --transport are started on this machine
with a random Llama checkpoint whose KV is large (many layers and KV heads: 16 KiB per token in
float32). For each --prompt-len this script, acting as the gateway, calls Prefill.Run (its
latency is the TTFT: the first token comes from the prefill worker) and then Decode.Session/Admit
with that KV on each transport's decode worker in turn (one prefill per round, whose KV every
decode worker imports, so load from elsewhere on the machine falls on all of them alike);
medians of --reps rounds after one warm-up round. The decode worker reports the handover time
(`kv_transfer_ms`: from admission to the KV sitting in its own blocks, engine queueing
included), from which

    bandwidth  = KV bytes / handover time
    TTFT share = handover / (TTFT + handover)   (the handover's share of the time until the
                                                 decode worker can take the next step)

Transports: shm (shared-memory pool, same host: the decode worker pulls), shm_push (the same
pools the other way, and cuda_ipc_push likewise for cuda_ipc: this script reserves the blocks at the decode worker, Decode.Reserve, and a
Prefill.Run of its own, for another prompt of the same length, writes the KV into them before it
answers; its TTFT includes that write, and the handover is the admission alone), inline (block bytes over gRPC), nixl (one
NIXL READ per request; prefill and decode get different TANDEM_HOST_ID values so that shared
memory is ruled out; UCX chooses its transports, or nixl:UCX_TLS forces them, e.g. nixl:tcp
through the loopback interface as between two hosts without RDMA), cuda_ipc (--device cuda:
CUDA IPC of the GPU pool). For reference, the same blocks are also copied within this process:
tandem's gather copy (one kernel on a GPU, `index_select` + `index_copy_` on a CPU: what the
cuda_ipc and shm paths run) and a plain slice copy.

Between a push's Reserve and its Admit the decode worker idles as long as that prefill takes
(longer for a longer prompt), and a worker's first work after an idle spell runs slower (on a
VM especially; bench/push_admit.py measures both in one process): `--admit-after-ms` sends
every Admit that long after its Reserve, so that the lengths differ only by the prompt.

On one host UCX does not use the network: it reads the peer process's memory directly (CMA)
or goes through loopback TCP (nixl:tcp). Between two machines the figures depend on the
fabric: measure there.

    .venv/bin/python bench/transfer.py                       # nixl, nixl:tcp, shm, inline on CPU
    .venv/bin/python bench/transfer.py --transport nixl:tcp --prompt-lens 8192
    .venv/bin/python bench/transfer.py --device cuda --transport cuda_ipc nixl \
        --out bench/results/h200_transfer.json
    .venv/bin/python bench/transfer.py --device cuda --transport cuda_ipc_push \
        --prompt-lens 2048 8000 --model DIR  # a random Llama-3-8B: a real model's TTFT

Results go to --out (default bench/results/transfer_cpu.json) with the exact command, the git
revision and the host; a table is printed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # forks stages; see tandem/cli.py
import platform
import queue
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))  # its sibling modules, however it is loaded

import grpc  # noqa: E402
import torch  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from meta import cpu_model, git_revision  # noqa: E402

from tandem.rpc import api_pb2, stages_pb2, stages_pb2_grpc  # noqa: E402

# A small Llama with a large KV: 8 layers x 8 KV heads x 32 dims x (k, v) x fp32 = 16 KiB/token.
MODEL = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=16384,
)
BLOCK_SIZE = 16


def build_model(path: str) -> None:
    """Write the random checkpoint (weights and a word-level tokenizer) to `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(tie_word_embeddings=False, bos_token_id=2, eos_token_id=1, **MODEL)
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(MODEL["vocab_size"])}, "w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="w1", bos_token="w2").save_pretrained(
        path
    )


def model_shape(path: str) -> dict[str, int]:
    """What this script needs of the checkpoint at `path` (its config.json)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    shape = {k: cfg[k] for k in MODEL}
    shape["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return shape


def kv_bytes_per_token(shape: dict[str, int], dtype_bytes: int) -> int:
    layers, heads = shape["num_hidden_layers"], shape["num_key_value_heads"]
    return layers * 2 * heads * shape["head_dim"] * dtype_bytes


# ---- stage processes ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stage:
    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: str) -> None:
        self.name = name
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"{name}-{self.port}.log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{name}", "--port", str(self.port), *args],
            cwd=ROOT,
            stdout=open(self.log_path, "w"),  # noqa: SIM115 - owned by the child
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )

    def wait_healthy(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(self.log_path) as f:
                    raise RuntimeError(f"{self.name} exited:\n{f.read()[-3000:]}")
            ch = grpc.insecure_channel(self.address)
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            finally:
                ch.close()
            time.sleep(0.3)
        raise TimeoutError(f"{self.name} did not become healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class DecodeSession:
    """One Decode.Session stream, driven by hand (this script plays the gateway)."""

    def __init__(self, address: str) -> None:
        self.prefill_address = ""  # the prefill worker whose KV it takes
        self.push_ms: list[float] = []  # the prefill worker's writes into this worker's pool
        self.idle_ms: list[float] = []  # from each Reserve's answer to the Admit sent after it
        self.channel = grpc.insecure_channel(address)
        self.send: queue.Queue = queue.Queue()
        self.out: queue.Queue = queue.Queue()

        def requests():
            while (m := self.send.get()) is not None:
                yield m

        self.call = stages_pb2_grpc.DecodeStub(self.channel).Session(requests())
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                self.out.put(msg)
        except grpc.RpcError:
            pass

    def run(self, admit: stages_pb2.Admit, timeout: float = 300.0) -> stages_pb2.SeqFinished:
        self.send.put(stages_pb2.DecodeIn(admit=admit))
        deadline = time.monotonic() + timeout
        while True:
            msg = self.out.get(timeout=max(0.1, deadline - time.monotonic()))
            for f in msg.finished:
                if f.seq_id == admit.seq_id:
                    return f

    def close(self) -> None:
        self.send.put(None)
        self.channel.close()


def push_admit(
    prefill: stages_pb2_grpc.PrefillStub,
    session: DecodeSession,
    prompt: list[int],
    sampling,
    after_ms: float = 0.0,
) -> tuple[stages_pb2.Admit, float]:
    """Reserve the prompt's blocks at the decode worker, have the prefill worker write its KV
    into them: the Admit naming the written reservation, and the Prefill.Run latency (ms).
    `after_ms`: return no sooner than that after the Reserve was answered."""
    seq_id = uuid.uuid4().hex
    got = stages_pb2_grpc.DecodeStub(session.channel).Reserve(
        stages_pb2.ReserveRequest(
            seq_id=seq_id, prompt_token_ids=prompt, prefill_address=session.prefill_address
        ),
        timeout=60,
    )
    if not got.HasField("reservation"):
        raise RuntimeError(f"no reservation: {got.refused}")
    t0 = reserved = time.perf_counter()
    resp = prefill.Run(
        stages_pb2.PrefillRequest(
            request_id=seq_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            push_to=got.reservation,
        ),
        timeout=600,
    )
    ttft_ms = (time.perf_counter() - t0) * 1e3
    if not resp.push_proof:
        raise RuntimeError(f"not pushed: {resp.push_refused}")
    session.push_ms.append(resp.push_ms)
    time.sleep(max(0.0, reserved + after_ms / 1e3 - time.perf_counter()))
    session.idle_ms.append((time.perf_counter() - reserved) * 1e3)
    admit = stages_pb2.Admit(
        seq_id=seq_id,
        prompt_token_ids=prompt,
        first_token=resp.first_token,
        sampling=sampling,
        reservation=got.reservation,
        push_proof=resp.push_proof,
    )
    return admit, ttft_ms


# ---- measurement -------------------------------------------------------------------------------
def measure(
    specs: list[str], model: str, lens: list[int], reps: int, args, log_dir: str
) -> list[dict[str, Any]]:
    """One prefill worker and one decode worker per transport spec (a transport, or
    nixl:UCX_TLS, e.g. nixl:tcp, to choose UCX's transports on the decode side). The transports
    take turns on every repetition, so a machine whose load changes affects them alike."""
    blocks = max(lens) // BLOCK_SIZE + 2
    # No /metrics endpoints: their default ports (gRPC port + 1000) could collide here.
    engine = [
        "--model",
        model,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--metrics-port",
        "-1",
    ]
    prefill = Stage(
        "prefill",
        [*engine, "--num-blocks", str(blocks + 8)],
        {"TANDEM_HOST_ID": "bench-prefill"},
        log_dir,
    )
    decodes: dict[str, Stage] = {}
    try:
        prefill.wait_healthy()
        for spec in specs:
            transport, _, ucx_tls = spec.partition(":")
            transport = transport.removesuffix("_push")
            # NIXL and inline are for peers on other hosts: such a decode worker looks like one.
            other_host = transport in ("nixl", "inline")
            env = {"TANDEM_HOST_ID": "bench-decode" if other_host else "bench-prefill"}
            if ucx_tls:
                env["UCX_TLS"] = ucx_tls
            decodes[spec] = Stage(
                "decode",
                [
                    *engine,
                    "--num-blocks",
                    str(blocks + 8),
                    "--prefill",
                    prefill.address,
                    "--kv-transport",
                    transport,
                    "--kv-transfer-timeout",
                    "120",
                ],
                env,
                log_dir,
            )
        for d in decodes.values():
            d.wait_healthy()
        stub = stages_pb2_grpc.PrefillStub(grpc.insecure_channel(prefill.address))
        sessions = {spec: DecodeSession(d.address) for spec, d in decodes.items()}
        for sess in sessions.values():
            sess.prefill_address = prefill.address
        sampling = api_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        g = torch.Generator().manual_seed(0)
        vocab = model_shape(model)["vocab_size"]
        rows = []
        pulls = [spec for spec in specs if not spec.endswith("_push")]
        for n in lens:
            load = os.getloadavg()[0]
            samples: dict[str, list[tuple[float, float, int]]] = {spec: [] for spec in specs}
            for rep in range(reps + 1):  # the first round of each length warms up
                # One prefill per round, its KV handed to every decode worker in turn: inline
                # first, as it reads through the lease, which the first import releases; the
                # others read the prefill pool's memory, which nothing writes in between.
                prompt = torch.randint(3, vocab, (n,), generator=g).tolist()
                if pulls:  # (pushes only: no lease that nobody would take, holding the pool)
                    t0 = time.perf_counter()
                    resp = stub.Run(
                        stages_pb2.PrefillRequest(
                            request_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=sampling
                        ),
                        timeout=600,
                    )
                    ttft_ms = (time.perf_counter() - t0) * 1e3
                # Pushes last: their own prefills write into the prefill pool, whose released
                # blocks the pulls read.
                for spec in sorted(specs, key=lambda x: (x != "inline", x.endswith("_push"))):
                    if spec.endswith("_push"):
                        # A prompt of its own: the prefill worker's prefix cache holds this one.
                        own = torch.randint(3, vocab, (n,), generator=g).tolist()
                        admit, spec_ttft = push_admit(
                            stub, sessions[spec], own, sampling, args.admit_after_ms
                        )
                        admit.prefill_address = prefill.address
                    else:
                        admit = stages_pb2.Admit(
                            seq_id=uuid.uuid4().hex,
                            prompt_token_ids=prompt,
                            first_token=resp.first_token,
                            sampling=sampling,
                            kv=resp.kv,
                            prefill_address=prefill.address,
                        )
                        spec_ttft = ttft_ms
                    fin = sessions[spec].run(admit)
                    if fin.finish_reason == "error" or fin.kv_transport != spec.partition(":")[0]:
                        raise RuntimeError(f"{spec} at {n} tokens: {fin}")
                    if rep:
                        samples[spec].append((spec_ttft, fin.kv_transfer_ms, -(-n // BLOCK_SIZE)))
            for spec in specs:
                ss = samples[spec]
                ttft = statistics.median(x[0] for x in ss)
                xfer = statistics.median(x[1] for x in ss)
                nbytes = ss[0][2] * BLOCK_SIZE * args.kv_bytes_per_token
                rows.append(
                    {
                        "transport": spec,
                        "ucx_tls": spec.partition(":")[2] or None,
                        "prompt_tokens": n,
                        "kv_bytes": nbytes,
                        "ttft_ms": round(ttft, 2),
                        "handover_ms": round(xfer, 3),
                        "handover_ms_samples": [round(x[1], 3) for x in ss],
                        "bandwidth_GBps": round(nbytes / (xfer / 1e3) / 1e9, 3),
                        "ttft_share": round(xfer / (ttft + xfer), 4),
                        "loadavg_1min_before": round(load, 2),
                    }
                )
                write = ""
                if spec.endswith("_push"):  # the measured rounds' writes, inside the TTFT
                    w = statistics.median(sessions[spec].push_ms[-len(ss) :])
                    idle = statistics.median(sessions[spec].idle_ms[-len(ss) :])
                    rows[-1]["push_write_ms"] = round(w, 3)
                    rows[-1]["push_write_GBps"] = round(nbytes / (w / 1e3) / 1e9, 3)
                    rows[-1]["reserve_to_admit_ms"] = round(idle, 2)
                    write = f" (the prefill worker's write: {w:.2f} ms; Admit {idle:.1f} ms "
                    write += "after the Reserve)"
                print(f"  {spec:10s} {n:6d} tokens: handover {xfer:8.2f} ms{write}", flush=True)
        for sess in sessions.values():
            sess.close()
        return rows
    finally:
        for d in decodes.values():
            d.stop()
        prefill.stop()


def copy_baseline(
    lens: list[int], device: str, reps: int, shape: dict[str, int], dtype: torch.dtype
) -> list[dict[str, Any]]:
    """Local copies of the same blocks between two pools in this process: `gather` is
    tandem's gather_copy (one kernel on a GPU, what the cuda_ipc path runs; index_select +
    index_copy_ on a CPU, what the shm path runs), `memcpy` one
    slice copy of consecutive blocks. One CPU thread: the two-core machine is shared, and
    OpenMP's threads make these copies erratic when it is busy."""
    from tandem.kv.block_copy import gather_copy
    from tandem.kv.cache import KVCache

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    head_dim = shape["head_dim"]
    blocks = max(lens) // BLOCK_SIZE + 2
    layers, heads = shape["num_hidden_layers"], shape["num_key_value_heads"]
    src = KVCache.allocate(layers, blocks, BLOCK_SIZE, heads, head_dim, dtype, device)
    dst = KVCache.allocate(layers, blocks, BLOCK_SIZE, heads, head_dim, dtype, device)
    src.data.normal_()

    def timed(fn) -> float:
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    rows = []
    for n in lens:
        nb = (n + BLOCK_SIZE - 1) // BLOCK_SIZE
        ids = list(range(nb))
        nbytes = nb * BLOCK_SIZE * kv_bytes_per_token(shape, dtype.itemsize)
        gather = timed(lambda ids=ids: gather_copy(dst, ids[::-1], src, ids))
        memcpy = timed(lambda nb=nb: dst.data[:, :, :nb].copy_(src.data[:, :, :nb]))
        rows.append(
            {
                "prompt_tokens": n,
                "kv_bytes": nbytes,
                "gather_ms": round(gather * 1e3, 3),
                "gather_GBps": round(nbytes / gather / 1e9, 3),
                "memcpy_ms": round(memcpy * 1e3, 3),
                "memcpy_GBps": round(nbytes / memcpy / 1e9, 3),
            }
        )
    torch.set_num_threads(threads)
    return rows


def host_info(device: str, loadavg_at_start: list[float]) -> dict[str, Any]:
    info = {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": loadavg_at_start,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        from importlib.metadata import version

        info["nixl"] = next(
            (f"{n} {version(n)}" for n in ("nixl-cu13", "nixl-cu12", "nixl") if _has(n)), None
        )
    except Exception:  # noqa: BLE001
        pass
    return info


def _has(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--transport",
        nargs="+",
        default=["nixl", "nixl:tcp", "shm", "inline"],
        help="nixl, nixl:UCX_TLS (e.g. nixl:tcp), shm, shm_push, inline, cuda_ipc, cuda_ipc_push "
        "(default: nixl nixl:tcp shm inline)",
    )
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--reps", type=int, default=5, help="measured rounds per length (median)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--admit-after-ms",
        type=float,
        default=0.0,
        help="pushes: send each Admit this long after its Reserve was answered (at once after a "
        "longer prefill), so that the decode worker idles as long before every handover "
        "whatever the prompt's length (default 0: at once, as a gateway does)",
    )
    p.add_argument(
        "--model",
        help="a Llama checkpoint directory to run instead of the small one this script writes "
        "(e.g. a random Llama-3-8B from bench/llama_random.py: a real model's KV and TTFT)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="the workers' dtype (default: float32 for the small model, else bfloat16)",
    )
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "transfer_cpu.json"))
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.model else "float32")
    for t in args.transport:
        known = ("nixl", "shm", "shm_push", "inline", "cuda_ipc", "cuda_ipc_push")
        if t.partition(":")[0] not in known or (":" in t and not t.startswith("nixl:")):
            p.error(f"unknown transport {t!r}")
    if {"cuda_ipc", "cuda_ipc_push"} & set(args.transport) and args.device != "cuda":
        p.error("--transport cuda_ipc needs --device cuda")
    if {"shm", "shm_push"} & set(args.transport) and args.device == "cuda":
        p.error("--transport shm needs --device cpu (a GPU prefill pool is not in shared memory)")
    started = time.time()
    load_start = list(os.getloadavg())
    log_dir = tempfile.mkdtemp(prefix="tandem-transfer-")
    model = args.model
    if model is None:
        model = os.path.join(log_dir, "model")
        build_model(model)
    shape = model_shape(model)
    if max(args.prompt_lens) >= shape["max_position_embeddings"]:
        p.error(f"--prompt-lens: the model's context is {shape['max_position_embeddings']} "
                "tokens (prompt and output): each prompt must be shorter")  # fmt: skip
    dtype = getattr(torch, args.dtype)
    args.kv_bytes_per_token = kv_bytes_per_token(shape, dtype.itemsize)
    print(f"prefill + {len(args.transport)} decode workers on {args.device} (logs in {log_dir})")
    rows = measure(args.transport, model, args.prompt_lens, args.reps, args, log_dir)
    baseline = copy_baseline(args.prompt_lens, args.device, args.reps, shape, dtype)
    inline = {r["prompt_tokens"]: r for r in rows if r["transport"] == "inline"}
    for r in rows:
        if r["prompt_tokens"] in inline:
            ref = inline[r["prompt_tokens"]]
            r["speedup_vs_inline"] = round(ref["handover_ms"] / r["handover_ms"], 2)
            # Per round (both imported the same prefill's KV moments apart), then the median:
            # less sensitive to load that changes between rounds than the ratio of medians.
            r["speedup_vs_inline_per_round"] = round(
                statistics.median(
                    a / b
                    for a, b in zip(
                        ref["handover_ms_samples"], r["handover_ms_samples"], strict=True
                    )
                ),
                2,
            )
    print()
    hdr = f"{'transport':10s} {'tokens':>6s} {'KV MB':>7s} {'TTFT ms':>9s} {'handover ms':>12s}"
    print(hdr + f" {'GB/s':>7s} {'TTFT share':>10s} {'x inline':>9s} {'(per round)':>11s}")
    for r in rows:
        print(
            f"{r['transport']:10s} {r['prompt_tokens']:6d} {r['kv_bytes'] / 1e6:7.1f} "
            f"{r['ttft_ms']:9.1f} {r['handover_ms']:12.2f} {r['bandwidth_GBps']:7.3f} "
            f"{r['ttft_share'] * 100:9.1f}% {r.get('speedup_vs_inline', float('nan')):9.1f}"
            f" {r.get('speedup_vs_inline_per_round', float('nan')):11.1f}"
        )
    for b in baseline:
        print(
            f"{'local':10s} {b['prompt_tokens']:6d} {b['kv_bytes'] / 1e6:7.1f} {'':9s} "
            f"{b['gather_ms']:12.2f} {b['gather_GBps']:7.3f}   gather copy in one process "
            f"(memcpy {b['memcpy_GBps']:.3f} GB/s)"
        )
    result = {
        "benchmark": "kv_handover",
        "command": shlex.join([sys.executable, *sys.argv]),
        "git_revision": git_revision(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "duration_s": round(time.time() - started, 1),
        "host": host_info(args.device, load_start),
        "device": args.device,
        "model": {
            "path": args.model or "written by this script",
            **shape,
            "dtype": args.dtype,
            "kv_bytes_per_token": args.kv_bytes_per_token,
        },
        "definitions": {
            "ttft_ms": "Prefill.Run latency seen by the caller (the first token comes from it)",
            "handover_ms": "decode worker's kv_transfer_ms: admission to KV in its own blocks",
            "bandwidth_GBps": "kv_bytes / handover_ms",
            "ttft_share": "handover_ms / (ttft_ms + handover_ms)",
            "push_write_ms": "shm_push: the prefill worker's write into the reserved decode "
            "blocks, inside ttft_ms (push_ms of its answer)",
            "reserve_to_admit_ms": "pushes: from the Reserve's answer to the Admit, the time "
            "the decode worker idled before the handover (the prefill's, or --admit-after-ms)",
        },
        "loadavg_at_end": list(os.getloadavg()),
        "results": rows,
        "copy_baseline": baseline,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
