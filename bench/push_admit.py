"""The decode worker's own part of a pushed KV handover, in one process: Admit to sequence joined.

What `bench/transfer.py --transport shm_push` (or cuda_ipc_push) reports as the handover is the
decode worker's `kv_transfer_ms`: from its admission of the Admit to its engine thread having
joined the sequence, the pushed KV already in the reserved blocks. This script runs that path
alone, the services' own code (`services.decode.admission.Admission` on a running `EngineLoop`),
without other processes or gRPC: each round reserves a prompt's blocks on the engine thread
(`LLMEngine.reserve`, its names given as `Decode.Reserve` gives them), signs the reservation and
the writer's proof as the workers do, waits, then parses the Admit from its bytes and admits it
(no KV is written: the admission never reads it). Prompt lengths and the wait (how long the
worker idled since the Reserve: on a real run, the prefill's time) take turns round by round,
so that the load of the machine falls on all of them alike.

Reported per (prompt length, idle): the handover (`kv_transfer_ms`, median and p10-p90 over the
rounds) and the Admit's parse from its bytes (before the handover's clock starts). At one idle,
the lengths differ only by what grows with the prompt; at one length, the idles by how much
slower a worker's first work after an idle spell runs (on a VM especially).

    .venv/bin/python bench/push_admit.py                 # CPU: 2k and 8k tokens, idle 2-100 ms
    python bench/push_admit.py --device cuda --out bench/results/h100_push_admit.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from llama_random import tandem_engine  # noqa: E402
from meta import run_metadata  # noqa: E402
from report import percentile, print_table, write_json  # noqa: E402
from transfer import BLOCK_SIZE, MODEL  # noqa: E402

from services.decode.admission import Admission, PushTarget  # noqa: E402
from services.decode.observe import DecodeTelemetry  # noqa: E402
from services.decode.server import Session  # noqa: E402
from tandem.engine.engine_loop import EngineLoop  # noqa: E402
from tandem.kv.events import KvEventFeed  # noqa: E402
from tandem.kv.names import block_hashes  # noqa: E402
from tandem.kv.reservation import prompt_digest, push_proof, sign_reservation  # noqa: E402
from tandem.rpc import api_pb2, stages_pb2  # noqa: E402

KEY = b"push-admit-bench-reservation-key"
SAMPLING = api_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def admit_bytes(res, sid: str, prompt: list[int], ids: np.ndarray) -> bytes:
    """The Admit a gateway sends for reservation `res` (an engine `Reservation`), written and
    proven, as the decode worker's stream receives it."""
    out = stages_pb2.KvReservation(
        pool_id="decode-pool",
        writer_pool_id="prefill-pool",
        token=res.token,
        seq_id=sid,
        first_block=res.first,
        block_ids=res.table.blocks[res.first :],
        num_tokens=len(prompt),
        expires_at=time.time() + 30,
        prompt_digest=prompt_digest(ids),
    )
    out.signature = sign_reservation(KEY, out)
    admit = stages_pb2.Admit(
        seq_id=sid,
        prompt_token_ids=prompt,
        first_token=5,
        sampling=SAMPLING,
        reservation=out,
        push_proof=push_proof(KEY, out.token, out.signature),
    )
    return stages_pb2.DecodeIn(admit=admit).SerializeToString()


async def one_round(
    admission: Admission,
    engine_loop: EngineLoop,
    transfer: dict[str, tuple[float, str]],
    prompt: list[int],
    idle_ms: float,
) -> tuple[float, float]:
    """Reserve, idle, admit, abort: (the handover, the Admit's parse), in microseconds."""
    sid = uuid.uuid4().hex
    ids = np.array(prompt, dtype=np.uint32)
    names = block_hashes(ids, BLOCK_SIZE)
    res = await asyncio.wrap_future(
        engine_loop.submit(lambda e: e.reserve(ids, sid, 30.0, block_names=names))
    )
    wire = admit_bytes(res, sid, prompt, ids)
    await asyncio.sleep(idle_ms / 1e3)
    t = time.perf_counter()
    msg = stages_pb2.DecodeIn.FromString(wire)
    parse_us = (time.perf_counter() - t) * 1e6
    session = Session(out=asyncio.Queue())
    await admission.admit(msg.admit, session)
    ms, _ = transfer.pop(sid, (None, ""))
    if ms is None:
        raise RuntimeError(f"not admitted: {session.out.get_nowait()}")
    await asyncio.wrap_future(engine_loop.submit(lambda e: e.abort(sid)))
    return ms * 1e3, parse_us


async def measure(device: str, lens: list[int], idles_ms: list[float], reps: int) -> list[dict]:
    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **MODEL)).eval().to(device)
    engine = tandem_engine(
        hf, device=device, dtype="float32", num_blocks=max(lens) // BLOCK_SIZE + 8
    )
    loop = asyncio.get_running_loop()
    events = KvEventFeed()  # as the worker has it: the pool's listener, nobody subscribed
    engine.add_kv_listener(events.on_event)
    engine_loop = EngineLoop(engine, lambda outs: None)
    transfer: dict[str, tuple[float, str]] = {}
    admission = Admission(
        engine_loop,
        engine.prepare_matcher,
        None,  # no prefill peers: pushed admissions only
        DecodeTelemetry(engine, loop, 1),
        {},
        transfer,
        {},
        lambda sid, reason: stages_pb2.SeqFinished(seq_id=sid, finish_reason=reason),
        lambda reason: None,
        PushTarget("decode-pool", KEY, BLOCK_SIZE, "push"),
    )
    engine_loop.start()
    gen = torch.Generator().manual_seed(1)
    cases = [(n, idle) for n in lens for idle in idles_ms]
    got: dict[tuple[int, float], list[tuple[float, float]]] = {c: [] for c in cases}
    try:
        for rnd in range(reps + 1):  # the first round warms up
            for n, idle in cases:
                prompt = torch.randint(3, MODEL["vocab_size"], (n,), generator=gen).tolist()
                got_us = await one_round(admission, engine_loop, transfer, prompt, idle)
                if rnd:
                    got[n, idle].append(got_us)
    finally:
        engine_loop.stop()
    rows = []
    for (n, idle), samples in got.items():
        us = [s[0] for s in samples]
        rows.append(
            {
                "prompt_tokens": n,
                "idle_ms": idle,
                "handover_us": round(statistics.median(us), 1),
                "handover_us_p10": round(percentile(us, 10), 1),
                "handover_us_p90": round(percentile(us, 90), 1),
                "parse_us": round(statistics.median(s[1] for s in samples), 1),
                "rounds": len(samples),
            }
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument(
        "--idle-ms",
        type=float,
        nargs="+",
        default=[2, 7, 28, 100],
        help="how long the worker idles between the Reserve and the Admit",
    )
    p.add_argument("--reps", type=int, default=30, help="measured rounds per case")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "push_admit_cpu.json"))
    args = p.parse_args()
    meta = run_metadata()
    started = time.time()
    rows = asyncio.run(measure(args.device, args.prompt_lens, args.idle_ms, args.reps))
    print_table(
        ["tokens", "idle ms", "handover us", "p10", "p90", "parse us"],
        [
            [r["prompt_tokens"], r["idle_ms"], r["handover_us"], r["handover_us_p10"],
             r["handover_us_p90"], r["parse_us"]]
            for r in rows
        ],
    )  # fmt: skip
    write_json(
        args.out,
        {
            "benchmark": "push_admit",
            "meta": {**meta, "device": args.device, "duration_s": round(time.time() - started)},
            "model": {**MODEL, "dtype": "float32", "block_size": BLOCK_SIZE},
            "definitions": {
                "handover_us": "the decode worker's kv_transfer_ms for the Admit: admission to "
                "the sequence joined on the engine thread (median of the rounds)",
                "idle_ms": "the worker's wait between the Reserve and the Admit",
                "parse_us": "the Admit parsed from its bytes, before the handover's clock starts",
            },
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
