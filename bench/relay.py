"""How many tokens a second one gateway relays, and what each costs it: real processes, no model.

A real gateway process (`python -m services.gateway`, as `tandem up` starts it: the gateway
secret, no prefill worker) is pointed at a stand-in decode worker: a gRPC server of its own
process that answers what the gateway asks of a decode worker (health, `Stats`, one `Session`
stream, behind the stage secret's check) and computes nothing. Each admitted sequence gets one
token per step, every sequence's tokens in one `DecodeOut` per step stamped with
`step_ended_at`, as the real worker sends them, at a fixed step interval; after `max_tokens`
tokens a `SeqFinished` (length) rides the step's message. The tokens are ids of ordinary English
words of the default model's tokenizer (each decodes to a space and letters), so detokenization
does real work.

Client processes hold N streams in closed loop through the gateway's gRPC `Generate`
(`--api grpc`) or OpenAI `/v1/completions` with `stream: true` (`--api http`). Each prompt ends
in ids naming its request, so that the stand-in's record of when it sent each token (the
`step_ended_at` of its step) can be joined with the client's receipt of it.

Per point (streams, step interval), over a measured window after a warm-up:
  offered tok/s    streams / step interval (every stream always has a sequence running)
  emitted tok/s    what the stand-in sent in the window
  delivered tok/s  what the clients received in the window
  gw CPU ms/1k     the gateway process's CPU time (every thread, psutil) per 1,000 tokens delivered
  gw cores         its CPU time over the window's length
  delivery p50/p99 step_ended_at to the client's receipt of the token, ms
  kept up          delivered >= 90 % of offered and delivery p99 <= 100 ms
On a host with few cores the clients and the stand-in take CPU too: the gateway's CPU time per
token is the figure that carries over; 1000 / (ms per 1k) is what one core of it would relay.

    .venv/bin/python bench/relay.py                         # the sweep, both APIs
    .venv/bin/python bench/relay.py --base /tmp/relay-base  # A/B: a checkout's gateway, alternated
    .venv/bin/python bench/relay.py --quick --out -         # a short run (the test suite's)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import aiohttp  # noqa: E402
import grpc  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from launch import die_with_parent, wait_grpc_serving  # noqa: E402
from meta import run_metadata  # noqa: E402
from report import print_table, write_json  # noqa: E402

from tandem.config import EngineConfig  # noqa: E402
from tandem.model.info import load_model_info  # noqa: E402
from tandem.rpc import api_pb2, api_pb2_grpc, stages_pb2, stages_pb2_grpc  # noqa: E402
from tandem.rpc.auth import StageCredentials, add_stage_port, stage_server  # noqa: E402
from tandem.rpc.health import add_health, set_serving  # noqa: E402
from tandem.rpc.limits import decode_limits  # noqa: E402

# Words the stand-in streams: each a token of its own, a space and letters when decoded.
TEXT = (
    "The committee met on a quiet morning to discuss the annual budget of the city library. "
    "Several members argued that the reading rooms needed better light and more chairs, while "
    "others wanted to spend the money on new books, public lectures and longer opening hours. "
    "After a long debate the chairman asked everyone to write down their own plan, and the "
    "secretary promised to collect every proposal before the next meeting in early spring. "
    "Outside the window a small bird was singing in the old garden behind the market square."
)
PROMPT_WORDS = 12  # prompt: this many words, then the request's name (KEY_IDS ids)
KEY_IDS = 3
KEY_BASE = 1000  # the name's ids: KEY_BASE + a number below KEY_SPAN
KEY_SPAN = 30000
MAX_SEQ_TOKENS = 8192
SERVICE = "tandem.v1.Decode"
# Kept up: delivered at least this share of the offered load, with delivery p99 at most this.
KEPT_UP_SHARE = 0.9
KEPT_UP_P99_MS = 100.0


def word_ids(tokenizer) -> list[int]:
    """Ids of TEXT's words that decode alone to a space and letters, each once, in order."""
    out: list[int] = []
    for t in tokenizer.encode(TEXT, add_special_tokens=False):
        s = tokenizer.decode([t])
        if s[:1] == " " and s[1:].isalpha() and t not in out:
            out.append(t)
    return out


# ---- the stand-in decode worker ------------------------------------------------------------
@dataclass
class StandInSeq:
    session: asyncio.Queue
    key: tuple[int, ...] | None  # None: running on from an earlier point, not recorded
    max_tokens: int
    offset: int  # where in the word list its tokens start
    first_step: int = -1  # the step index of its first token
    sent: int = 0


@dataclass
class StandInRecord:
    """What the stand-in sent in one point: each step's `step_ended_at` and token count, and per
    request (named by its prompt's last ids) the step of its first token, the tokens sent,
    whether it ended (length) or was cancelled."""

    step_times: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    requests: dict[tuple[int, ...], list] = field(default_factory=dict)


class StandInDecode(stages_pb2_grpc.DecodeServicer):
    """The decode worker's side of the gateway's calls, with tokens from a list, not a model."""

    def __init__(self, words: list[int]) -> None:
        self.words = words
        self.step_s = 0.008
        self.seqs: dict[str, StandInSeq] = {}
        self.record = StandInRecord()

    async def Session(self, request_iterator, context):
        out: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            try:
                async for msg in request_iterator:
                    kind = msg.WhichOneof("kind")
                    if kind == "admit":
                        a = msg.admit
                        key = tuple(a.prompt_token_ids[-KEY_IDS:])
                        offset = hash(key) % len(self.words)
                        self.seqs[a.seq_id] = StandInSeq(out, key, a.sampling.max_tokens, offset)
                    elif kind == "cancel":
                        sid = msg.cancel.seq_id
                        seq = self.seqs.pop(sid, None)
                        if seq is not None:
                            self._note(seq, "cancelled")
                            fin = stages_pb2.SeqFinished(seq_id=sid, finish_reason="abort")
                            out.put_nowait(stages_pb2.DecodeOut(finished=[fin]))
            finally:
                out.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (msg := await out.get()) is not None:
                yield msg
        finally:
            reader.cancel()
            for sid in [s for s, q in self.seqs.items() if q.session is out]:
                self.seqs.pop(sid)

    async def Stats(self, request, context):
        return stages_pb2.WorkerStats(max_seq_tokens=MAX_SEQ_TOKENS, max_sequences=4096)

    def _note(self, seq: StandInSeq, how: str) -> None:
        if seq.key is not None and seq.first_step >= 0:
            self.record.requests[seq.key] = [seq.first_step, seq.sent, how]

    def step(self) -> None:
        """One step: a token for every sequence, one message per session."""
        rec = self.record
        index = len(rec.step_times)
        now = time.time()
        outs: dict[int, tuple[asyncio.Queue, stages_pb2.DecodeOut]] = {}
        words, n_words = self.words, len(self.words)
        done = []
        for sid, seq in self.seqs.items():
            q = seq.session
            entry = outs.get(id(q))
            if entry is None:
                entry = outs[id(q)] = (q, stages_pb2.DecodeOut(step_ended_at=now))
            msg = entry[1]
            if seq.first_step < 0:
                seq.first_step = index
            msg.tokens.add(seq_id=sid, token_ids=[words[(seq.offset + seq.sent) % n_words]])
            seq.sent += 1
            if seq.sent >= seq.max_tokens:
                msg.finished.add(seq_id=sid, finish_reason="length")
                done.append(sid)
        for sid in done:
            self._note(self.seqs.pop(sid), "length")
        if outs:
            rec.step_times.append(now)
            rec.step_tokens.append(sum(len(m.tokens) for _, m in outs.values()))
            for q, msg in outs.values():
                q.put_nowait(msg)

    async def run_steps(self) -> None:
        """Steps at `step_s` intervals on a fixed schedule (a late step does not shift the rest,
        nor does the schedule catch up by bursts)."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due += self.step_s
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                due = loop.time()
            self.step()

    def collect(self) -> StandInRecord:
        """This point's record; the sequences still running are noted as they stand."""
        for seq in self.seqs.values():
            self._note(seq, "running")
        rec, self.record = self.record, StandInRecord()
        for seq in self.seqs.values():
            seq.key = None  # its steps were this record's
        return rec


async def _stand_in(port: int, stage_secret: bytes, gateway_secret: bytes, words, conn) -> None:
    service = StandInDecode(words)
    creds = StageCredentials(secret=stage_secret, gateway_secret=gateway_secret)
    server = stage_server(creds, decode_limits(MAX_SEQ_TOKENS, 16), lambda reason: None)
    stages_pb2_grpc.add_DecodeServicer_to_server(service, server)
    health = await add_health(server, [SERVICE])
    if add_stage_port(server, f"127.0.0.1:{port}", creds) == 0:
        raise OSError(f"stand-in decode worker: cannot bind port {port}")
    await server.start()
    await set_serving(health, [SERVICE], True)
    steps = asyncio.ensure_future(service.run_steps())
    loop = asyncio.get_running_loop()
    conn.send("ready")
    try:
        while True:
            cmd, arg = await loop.run_in_executor(None, conn.recv)
            if cmd == "step_ms":
                service.step_s = arg / 1e3
                service.collect()
                conn.send("ok")
            elif cmd == "collect":
                rec = service.collect()
                conn.send((rec.step_times, rec.step_tokens, rec.requests))
            else:
                break
    finally:
        steps.cancel()
        await server.stop(0.5)


def stand_in_main(port: int, stage_secret: bytes, gateway_secret: bytes, words, conn) -> None:
    """The stand-in decode worker's process: serves until told to stop."""
    _uvloop()
    asyncio.run(_stand_in(port, stage_secret, gateway_secret, words, conn))


# ---- clients -------------------------------------------------------------------------------
@dataclass
class Plan:
    """What one client process runs: `streams` closed loops from `start` until `stop` (Unix
    seconds) through `api` at `address`."""

    api: str
    address: str
    streams: int
    client: int  # this process's number, part of each request's name
    max_tokens: int
    start: float
    stop: float


def _prompt(words: list[int], client: int, req: int) -> tuple[list[int], tuple[int, ...]]:
    key = (KEY_BASE + client, KEY_BASE + req // KEY_SPAN, KEY_BASE + req % KEY_SPAN)
    return [*words[:PROMPT_WORDS], *key], key


class ClientRun:
    """The requests of one client process in one point: per request its name, whether it ended
    with a finish, the tokens it received, the usage it was told, and each chunk's receipt time
    and token count."""

    def __init__(self) -> None:
        self.results: list[tuple] = []
        self.errors: list[str] = []
        self.counter = 0

    def next_request(self, words: list[int], client: int):
        self.counter += 1
        return _prompt(words, client, self.counter)


async def _grpc_loop(stub, plan: Plan, words, run: ClientRun) -> None:
    sampling = api_pb2.SamplingParams(max_tokens=plan.max_tokens, temperature=0.0, ignore_eos=True)
    while time.time() < plan.stop:
        prompt, key = run.next_request(words, plan.client)
        times, counts = array("d"), array("I")
        got, finished, usage = 0, False, -1
        call = stub.Generate(
            api_pb2.GenerateRequest(
                prompt_token_ids=api_pb2.TokenIds(ids=prompt), sampling=sampling
            )
        )
        try:
            async for r in call:
                now = time.time()
                if r.HasField("chunk"):
                    n = len(r.chunk.token_ids)
                    if n:
                        times.append(now)
                        counts.append(n)
                        got += n
                else:
                    finished = True
                    usage = r.finish.usage.completion_tokens
        except grpc.aio.AioRpcError as e:
            run.errors.append(f"{e.code().name}: {e.details()}")
        finally:
            call.cancel()
            run.results.append((key, finished, got, usage, times, counts))


async def _http_loop(session, plan: Plan, words, run: ClientRun) -> None:
    url = f"http://{plan.address}/v1/completions"
    while time.time() < plan.stop:
        prompt, key = run.next_request(words, plan.client)
        body = {
            "prompt": prompt,
            "max_tokens": plan.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        times, counts = array("d"), array("I")
        got, finished, usage = 0, False, -1
        try:
            async with session.post(url, json=body) as resp:
                if resp.status != 200:
                    run.errors.append(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                    await asyncio.sleep(0.05)
                    continue
                async for line in resp.content:
                    now = time.time()
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        break
                    obj = json.loads(data)
                    if obj.get("usage"):
                        usage = obj["usage"]["completion_tokens"]
                    for c in obj["choices"]:
                        # Each streamed word is one token: a space and letters.
                        n = c["text"].count(" ")
                        if n:
                            times.append(now)
                            counts.append(n)
                            got += n
                        if c.get("finish_reason"):
                            finished = True
        except aiohttp.ClientError as e:
            run.errors.append(f"{type(e).__name__}: {e}")
        finally:
            run.results.append((key, finished, got, usage, times, counts))


async def _run_plan(plan: Plan, words) -> ClientRun:
    run = ClientRun()
    await asyncio.sleep(max(0.0, plan.start - time.time()))
    if plan.api == "grpc":
        channel = grpc.aio.insecure_channel(plan.address)
        stub = api_pb2_grpc.GatewayStub(channel)
        loops = [_grpc_loop(stub, plan, words, run) for _ in range(plan.streams)]
        closer = channel.close
    else:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        )
        loops = [_http_loop(session, plan, words, run) for _ in range(plan.streams)]
        closer = session.close
    tasks = [asyncio.ensure_future(c) for c in loops]
    await asyncio.sleep(max(0.0, plan.stop - time.time()))
    for t in tasks:
        t.cancel()  # the requests still running end here: cancelled by their clients
    await asyncio.gather(*tasks, return_exceptions=True)
    await closer()
    return run


async def _client(words, conn) -> None:
    loop = asyncio.get_running_loop()
    conn.send("ready")
    while (plan := await loop.run_in_executor(None, conn.recv)) is not None:
        run = await _run_plan(plan, words)
        conn.send((run.results, run.errors))


def client_main(words, conn) -> None:
    """A client process: runs each plan it is sent, answers with what it received."""
    _uvloop()
    asyncio.run(_client(words, conn))


def _uvloop() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass


# ---- the gateway ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """`python -m services.gateway` of the checkout at `root`, pointed at one decode worker."""

    def __init__(self, root: str, decode: str, gateway_secret: bytes, name: str) -> None:
        self.name = name
        self.root = root
        self.port, self.http_port = _free_port(), _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.http_address = f"127.0.0.1:{self.http_port}"
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("TANDEM_", "OTEL_")) and k != "PYTHONPATH"
        }
        env["TANDEM_GATEWAY_SECRET"] = gateway_secret.decode()
        cmd = [
            sys.executable, "-m", "services.gateway", "--port", str(self.port),
            "--http-port", str(self.http_port), "--metrics-port", "-1", "--prefill", "",
            "--decode", decode, "--max-waiting", "4096", "--max-inflight", "4096",
            "--http-max-connections-per-client", "4096", "--log-level", "warning",
        ]  # fmt: skip
        self.command = " ".join(cmd[1:])
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            "w+", prefix=f"relay-gateway-{name}-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            cmd,
            cwd=root,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self.ps = psutil.Process(self.proc.pid)

    def wait_serving(self, timeout: float = 120.0) -> None:
        """Until its gRPC health says SERVING (it reached the decode worker)."""
        wait_grpc_serving(
            self.address, self.proc, lambda: f"gateway {self.name} exited: {self.output()}", timeout
        )

    def revision(self) -> str:
        """The commit its checkout is at ("unknown" outside git)."""
        try:
            return subprocess.run(
                ["git", "-C", self.root, "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-3000:]

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ---- one point -----------------------------------------------------------------------------
def join(step_times, step_tokens, sent, results, w0: float, w1: float) -> dict:
    """The point's figures from the stand-in's record (`step_times`, `step_tokens`, `sent`) and
    the clients' `results`, over the window [w0, w1]."""
    steps = np.asarray(step_times)
    lat: list[np.ndarray] = []
    delivered = chunks = 0
    finished = tokens_finished = standin_finished = 0
    mismatched = over = usage_wrong = 0
    for key, fin, got, usage, times, counts in results:
        rec = sent.get(key)
        if fin:
            finished += 1
            tokens_finished += got
            if rec is None or rec[2] != "length" or rec[1] != got:
                mismatched += 1
            else:
                standin_finished += rec[1]
            if usage != got:
                usage_wrong += 1
        elif rec is not None and got > rec[1]:
            over += 1  # more than was sent: never
        if rec is None or not len(times):
            continue
        t = np.asarray(times)
        c = np.asarray(counts, dtype=np.int64)
        # Token j of the request was sent at step first + j; chunk k holds tokens
        # [ends[k] - c[k], ends[k]).
        ends = np.cumsum(c)
        idx = np.arange(ends[-1])
        chunk = np.searchsorted(ends, idx, side="right")
        recv = t[chunk]
        keep = (recv >= w0) & (recv < w1) & (rec[0] + idx < len(steps))
        delivered += int(keep.sum())
        chunks += int(((t >= w0) & (t < w1)).sum())
        lat.append(recv[keep] - steps[rec[0] + idx[keep]])
    all_lat = np.concatenate(lat) * 1e3 if lat else np.zeros(0)
    in_window = (steps >= w0) & (steps < w1)
    emitted = int(np.asarray(step_tokens, dtype=np.int64)[in_window].sum()) if len(steps) else 0
    return {
        "delivered_tokens": delivered,
        "tokens_per_chunk": round(delivered / chunks, 2) if chunks else None,
        "emitted_tokens": emitted,
        "latency_ms_p50": round(float(np.percentile(all_lat, 50)), 2) if len(all_lat) else None,
        "latency_ms_p99": round(float(np.percentile(all_lat, 99)), 2) if len(all_lat) else None,
        "requests": len(results),
        "requests_finished": finished,
        "tokens_finished_client": tokens_finished,
        "tokens_finished_standin": standin_finished,
        "requests_mismatched": mismatched,
        "requests_over": over,
        "requests_usage_wrong": usage_wrong,
    }


def run_point(gw: Gateway, api: str, streams: int, step_ms: float, opts, stand_in, clients) -> dict:
    stand_in.send(("step_ms", step_ms))
    stand_in.recv()
    start = time.time() + 0.2
    w0 = start + opts.warmup
    w1 = w0 + opts.window
    share = [streams // len(clients) + (i < streams % len(clients)) for i in range(len(clients))]
    address = gw.address if api == "grpc" else gw.http_address
    for i, conn in enumerate(clients):
        conn.send(Plan(api, address, share[i], i, opts.max_tokens, start, w1))
    time.sleep(max(0.0, w0 - time.time()))
    cpu0, t0 = gw.cpu_s(), time.time()
    time.sleep(max(0.0, w1 - time.time()))
    cpu1, t1 = gw.cpu_s(), time.time()
    results, errors = [], []
    for conn in clients:
        r, e = conn.recv()
        results += r
        errors += e
    time.sleep(0.3)  # the cancellations reach the stand-in
    stand_in.send(("collect", None))
    step_times, step_tokens, sent = stand_in.recv()
    got = join(step_times, step_tokens, sent, results, w0, w1)
    span = t1 - t0
    cpu = cpu1 - cpu0
    offered = streams * 1e3 / step_ms
    delivered = got["delivered_tokens"] / opts.window
    row = {
        "gateway": gw.name,
        "api": api,
        "streams": streams,
        "step_ms": step_ms,
        "max_tokens": opts.max_tokens,
        "window_s": opts.window,
        "offered_tok_s": round(offered),
        "emitted_tok_s": round(got["emitted_tokens"] / opts.window),
        "delivered_tok_s": round(delivered),
        "gateway_cpu_ms_per_1k_tokens": (
            round(cpu * 1e3 / (got["delivered_tokens"] / 1e3), 2)
            if got["delivered_tokens"]
            else None
        ),
        "gateway_cores": round(cpu / span, 3),
        **got,
        "errors": len(errors),
        "first_errors": errors[:3],
    }
    p99 = got["latency_ms_p99"]
    row["kept_up"] = bool(
        delivered >= KEPT_UP_SHARE * offered and p99 is not None and p99 <= KEPT_UP_P99_MS
    )
    return row


def _points(arg: list[str]) -> list[tuple[str, int, float]]:
    out = []
    for p in arg:
        api, streams, step = p.split(":")
        out.append((api, int(streams), float(step)))
    return out


DEFAULT_POINTS = [
    "grpc:64:12", "grpc:64:6", "grpc:64:3", "grpc:256:12", "grpc:256:8", "grpc:256:6.4",
    "http:64:8", "http:256:16", "http:256:8",
]  # fmt: skip
QUICK_POINTS = ["grpc:32:8", "http:32:8"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--points",
        nargs="+",
        default=None,
        help="API:STREAMS:STEP_MS, e.g. grpc:256:8 (default: a sweep of 5k-40k tok/s offered)",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    p.add_argument("--warmup", type=float, default=1.5, help="seconds before each window")
    p.add_argument("--window", type=float, default=5.0, help="measured seconds per point")
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--base", default=None, help="a checkout whose gateway runs beside this one's")
    p.add_argument("--quick", action="store_true", help="two short points (the test suite's)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "relay_cpu.json"))
    opts = p.parse_args()
    if opts.quick:
        opts.points = opts.points or QUICK_POINTS
        opts.max_tokens, opts.warmup, opts.window = 32, 0.5, 1.5
    points = _points(opts.points or DEFAULT_POINTS)
    meta = run_metadata()
    started = time.time()
    _, tokenizer, _ = load_model_info(EngineConfig().model)
    words = word_ids(tokenizer)
    ctx = mp.get_context("spawn")
    stage_secret, gateway_secret = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    decode_port = _free_port()
    stand_in, child = ctx.Pipe()
    procs = [
        ctx.Process(
            target=stand_in_main,
            args=(decode_port, stage_secret.encode(), gateway_secret.encode(), words, child),
            daemon=True,
        )
    ]
    clients = []
    for _ in range(opts.clients):
        mine, theirs = ctx.Pipe()
        clients.append(mine)
        procs.append(ctx.Process(target=client_main, args=(words, theirs), daemon=True))
    for proc in procs:
        proc.start()
    decode = f"127.0.0.1:{decode_port}"
    gateways = [Gateway(ROOT, decode, gateway_secret.encode(), "this")]
    if opts.base:
        gateways.append(
            Gateway(os.path.abspath(opts.base), decode, gateway_secret.encode(), "base")
        )
    rows = []
    try:
        for conn in [stand_in, *clients]:
            conn.recv()
        for gw in gateways:
            gw.wait_serving()
            print(f"gateway {gw.name} (pid {gw.proc.pid}) serving: {gw.command}", flush=True)
        for k, (api, streams, step_ms) in enumerate(points):
            # Alternate which gateway goes first, so that the host's load falls on both alike.
            order = gateways if k % 2 == 0 else gateways[::-1]
            for gw in order:
                row = run_point(gw, api, streams, step_ms, opts, stand_in, clients)
                rows.append(row)
                print(
                    f"{gw.name} {api} {streams} streams, {step_ms:g} ms: offered "
                    f"{row['offered_tok_s']}, delivered {row['delivered_tok_s']} tok/s, "
                    f"{row['gateway_cpu_ms_per_1k_tokens']} gw CPU ms/1k, p99 "
                    f"{row['latency_ms_p99']} ms",
                    flush=True,
                )
    finally:
        for conn in clients:
            conn.send(None)
        stand_in.send(("stop", None))
        for gw in gateways:
            gw.stop()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    print()
    print_table(
        ["gateway", "api", "streams", "step ms", "offered", "emitted", "delivered",
         "gw CPU ms/1k", "gw cores", "tok/chunk", "p50 ms", "p99 ms", "kept up"],
        [
            [r["gateway"], r["api"], r["streams"], r["step_ms"], r["offered_tok_s"],
             r["emitted_tok_s"], r["delivered_tok_s"], r["gateway_cpu_ms_per_1k_tokens"],
             r["gateway_cores"], r["tokens_per_chunk"], r["latency_ms_p50"], r["latency_ms_p99"],
             "yes" if r["kept_up"] else "no"]
            for r in rows
        ],
    )  # fmt: skip
    result = {
        "benchmark": "relay",
        "meta": {
            **meta,
            "duration_s": round(time.time() - started),
            "gateways": {gw.name: {"root": gw.root, "revision": gw.revision()} for gw in gateways},
            "gateway_command": gateways[0].command,
            "loadavg_at_end": list(os.getloadavg()),
        },
        "settings": {
            "max_tokens": opts.max_tokens,
            "warmup_s": opts.warmup,
            "window_s": opts.window,
            "client_processes": opts.clients,
            "words": len(words),
        },
        "definitions": {
            "offered_tok_s": "streams / step interval",
            "emitted_tok_s": "tokens the stand-in decode worker sent in the window",
            "delivered_tok_s": "tokens the clients received in the window",
            "gateway_cpu_ms_per_1k_tokens": "the gateway process's CPU time (all threads) in "
            "the window per 1,000 tokens delivered",
            "gateway_cores": "the gateway's CPU seconds per second of the window",
            "tokens_per_chunk": "tokens delivered in the window per chunk (gRPC message or "
            "SSE event) that carried them",
            "latency_ms": "the token's step_ended_at to its receipt by the client",
            "kept_up": f"delivered >= {KEPT_UP_SHARE:.0%} of offered and latency p99 <= "
            f"{KEPT_UP_P99_MS:g} ms",
            "requests_mismatched": "finished requests whose tokens received differ from the "
            "tokens the stand-in sent them",
        },
        "rows": rows,
    }
    if opts.out == "-":
        print(json.dumps(result))
    else:
        write_json(opts.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
