"""One NIXL READ of N KV blocks between two processes: what a descriptor costs, what a byte costs.

A child process owns a KV pool in shared memory (as a CPU prefill worker does) registered with
its NIXL agent; this process reads N of its blocks into its own pool with `NixlPeerPool.read`,
the call the decode worker makes, timing each READ from posting to completion. Pool layout as
in bench/transfer.py (8 layers x 8 KV heads x 32 dims, fp32, 16-token blocks: 16 KiB per
(layer, k|v, block), 16 KiB per token). Block orders:

    runs       blocks 0..N-1 into 0..N-1: one descriptor per (layer, k|v) row, 16 in all
    reversed   the same pairs listed last-first (what a pool hands out after freeing a prompt
               last-block-first): merged into the same 16 descriptors
    scattered  a random permutation of 0..N-1 into 0..N-1: almost no two pairs adjacent on both
               sides, so ~16 N descriptors of 16 KiB (what a per-block READ costs)

Medians of --reps READs after one warm-up; a plain in-process copy of the same bytes for
reference. UCX chooses its transports (on one host: CMA, i.e. process_vm_readv); set UCX_TLS to
compare (e.g. UCX_TLS=tcp).

    .venv/bin/python bench/nixl_read.py                    # writes bench/results/nixl_read_cpu.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import shlex
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM = 8, 16, 8, 32
BLOCK_BYTES = BLOCK_SIZE * HEADS * HEAD_DIM * 4  # one (layer, k|v) row's piece of a block


def _owner(conn, num_blocks: int) -> None:
    """The prefill side: a shared-memory pool registered with NIXL, until told to stop."""
    from tandem.kv.layout import PoolLayout
    from tandem.kv.transports.nixl import NixlEndpoint
    from tandem.kv.transports.shm import SharedPool

    pool = SharedPool.create(PoolLayout(LAYERS, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM, "float32"))
    pool.kv.data.normal_()
    ep = NixlEndpoint("bench-owner", pool.kv)
    conn.send((ep.info, ep.layout))
    conn.recv()
    ep.close()
    pool.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--orders", nargs="+", default=["runs", "reversed", "scattered"])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "nixl_read_cpu.json"))
    args = p.parse_args()

    import numpy as np
    import torch

    from tandem.kv.block_copy import block_runs
    from tandem.kv.cache import KVCache
    from tandem.kv.transports.nixl import NixlEndpoint

    torch.set_num_threads(1)
    num_blocks = max(args.blocks) + 2
    load_start = list(os.getloadavg())
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(child_conn, num_blocks))
    owner.start()
    rows = []
    try:
        info, layout = conn.recv()
        kv = KVCache.allocate(LAYERS, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM, torch.float32, "cpu")
        ep = NixlEndpoint("bench-reader", kv)
        peer = ep.open_peer("owner", info, layout)
        rng = np.random.default_rng(0)
        for n in args.blocks:
            nbytes = n * BLOCK_BYTES * LAYERS * 2
            for order in args.orders:
                times = []
                runs = 0
                for _ in range(args.reps + 1):
                    dst = list(range(n))
                    if order == "runs":
                        src = list(range(n))
                    elif order == "reversed":
                        src, dst = list(range(n))[::-1], dst[::-1]
                    else:
                        src = rng.permutation(n).tolist()
                    runs = block_runs(src, dst)[2].size
                    t0 = time.perf_counter()
                    peer.read(src, dst, timeout_s=60)
                    times.append(time.perf_counter() - t0)
                med = statistics.median(times[1:])
                rows.append(
                    {
                        "blocks": n,
                        "order": order,
                        "kv_bytes": nbytes,
                        "descriptors": runs * LAYERS * 2,
                        "read_ms": round(med * 1e3, 3),
                        "read_ms_samples": [round(t * 1e3, 3) for t in times[1:]],
                        "GBps": round(nbytes / med / 1e9, 3),
                    }
                )
                print(
                    f"{n:5d} blocks {nbytes / 1e6:7.1f} MB {order:9s} "
                    f"{runs * LAYERS * 2:6d} descriptors: {med * 1e3:8.2f} ms "
                    f"{nbytes / med / 1e9:6.3f} GB/s",
                    flush=True,
                )
            # The same bytes copied within this process, for reference.
            a = torch.empty(nbytes // 4)
            b = torch.empty(nbytes // 4)
            a.normal_()
            copies = []
            for _ in range(args.reps + 1):
                t0 = time.perf_counter()
                b.copy_(a)
                copies.append(time.perf_counter() - t0)
            med = statistics.median(copies[1:])
            rows.append(
                {
                    "blocks": n,
                    "order": "memcpy (in process)",
                    "kv_bytes": nbytes,
                    "read_ms": round(med * 1e3, 3),
                    "GBps": round(nbytes / med / 1e9, 3),
                }
            )
            print(
                f"{n:5d} blocks {nbytes / 1e6:7.1f} MB memcpy in one process: {med * 1e3:8.2f} ms"
            )
        peer.close()
        ep.close()
    finally:
        conn.send(None)
        owner.join(30)
    result = {
        "benchmark": "nixl_read",
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": {"cpu_count": os.cpu_count(), "loadavg_at_start": load_start},
        "loadavg_at_end": list(os.getloadavg()),
        "ucx_tls": os.environ.get("UCX_TLS"),
        "layout": {
            "layers": LAYERS,
            "block_size": BLOCK_SIZE,
            "kv_heads": HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "float32",
            "bytes_per_row_block": BLOCK_BYTES,
        },
        "results": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
