"""CPU engine: a step that joins a prompt to running decodes against the decode step beside it.

The embedded SmolLM2 (float32, as `tandem up` runs it on a CPU host), B sequences decoding; then,
step after step, one new P-token prompt joins them (the step computes its P tokens beside the
B decodes), and the decode-only steps of the same batch are timed around those steps. The
ratio mixed / decode is what a new request costs every stream at that moment.

    .venv/bin/python bench/mixed_step_cpu.py                 # batches 16 and 64, 150-token prompts
    .venv/bin/python bench/mixed_step_cpu.py --batches 8 --reps 5
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from meta import run_metadata  # noqa: E402
from report import print_table, write_json  # noqa: E402

import tandem  # noqa: E402


def measure(batch: int, prompt: int, reps: int) -> dict[str, Any]:
    llm = tandem.LLM(device="cpu", dtype="float32", enable_prefix_cache=False)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    sp = tandem.SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([100 + (i * 7 + j) % (vocab - 200) for j in range(32)], sp)
    for _ in range(3):  # every prompt computed; decoding from here on
        engine.step()
    decode, mixed = [], []
    for k in range(reps):
        t = time.perf_counter()
        engine.step()
        decode.append(time.perf_counter() - t)
        engine.add_request([100 + (k * 11 + j) % (vocab - 200) for j in range(prompt)], sp)
        t = time.perf_counter()
        engine.step()
        mixed.append(time.perf_counter() - t)
    d, m = sorted(decode)[reps // 2], sorted(mixed)[reps // 2]
    return {"batch": batch, "prompt": prompt, "decode_ms": d * 1e3, "mixed_ms": m * 1e3,
            "mixed_over_decode": m / d}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="16,64", help="decoding sequences (comma list)")
    ap.add_argument("--prompt", type=int, default=150, help="tokens of each joining prompt")
    ap.add_argument("--reps", type=int, default=9, help="steps of each kind (median)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "mixed_step_cpu.json"))
    args = ap.parse_args()
    rows = [measure(int(b), args.prompt, args.reps) for b in args.batches.split(",")]
    print_table(["batch", "prompt", "decode ms", "mixed ms", "mixed / decode"],
                [[r["batch"], r["prompt"], r["decode_ms"], r["mixed_ms"], r["mixed_over_decode"]]
                 for r in rows])  # fmt: skip
    write_json(args.out, {"benchmark": "mixed_step_cpu", "meta": run_metadata(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
