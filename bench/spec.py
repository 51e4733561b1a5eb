"""Speculative decoding on SmolLM2 (CPU): mean accepted length and tokens/s with and without it.

    python bench/spec.py            # writes bench/results/spec_cpu.json

Greedy decoding, the same prompts through the same engine; speculation uses the in-process
proposers that the draft worker serves (`ngram` on a rewrite prompt, `self:N` on chat prompts).
Runs alternate plain / speculative so machine noise hits both alike; the median of 3 is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import tandem  # noqa: E402

REWRITE = (
    "Rewrite the following paragraph exactly, word for word:\n"
    "Tandem serves large language models as a pipeline of cooperating processes: a gateway that "
    "speaks to clients and streams tokens, a prefill worker that turns prompts into KV cache, and "
    "a decode worker that continuously batches every live sequence. KV cache moves between "
    "processes as handles, never as serialized tensors on the hot path."
)
CHATS = [
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is to a beginner.",
]


def timed(llm: tandem.LLM, prompts: list[list[int]], sp: tandem.SamplingParams):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    return outs, dt


def run_case(name, plain, spec, prompts, sp, repeats):
    plain_t, spec_t, toks_p, toks_s = [], [], 0, 0
    st = spec.speculator.stats
    p0, a0, r0 = st.proposed, st.accepted, st.verify_rounds
    same = True
    for _ in range(repeats):
        po, pt = timed(plain, prompts, sp)
        so, stt = timed(spec, prompts, sp)
        plain_t.append(pt)
        spec_t.append(stt)
        toks_p = sum(len(o.token_ids) for o in po)
        toks_s = sum(len(o.token_ids) for o in so)
        same &= all(a.token_ids == b.token_ids for a, b in zip(po, so, strict=True))
    rounds = st.verify_rounds - r0
    acc = st.accepted - a0
    return {
        "case": name,
        "prompts": len(prompts),
        "output_tokens": toks_p,
        "identical_output": same,
        "plain_tokens_per_s": toks_p / statistics.median(plain_t),
        "spec_tokens_per_s": toks_s / statistics.median(spec_t),
        "speedup": statistics.median(plain_t) / statistics.median(spec_t),
        "mean_accepted_length": (acc + rounds) / rounds if rounds else 0.0,
        "draft_tokens_proposed": st.proposed - p0,
        "draft_tokens_accepted": acc,
        "acceptance_rate": acc / (st.proposed - p0) if st.proposed - p0 else 0.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--self-layers", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "spec_cpu.json"))
    args = ap.parse_args()
    sp = tandem.SamplingParams(max_tokens=args.max_tokens, temperature=0)
    plain = tandem.LLM()
    rewrite = [plain.chat_prompt([{"role": "user", "content": REWRITE}])]
    chats = [plain.chat_prompt([{"role": "user", "content": q}]) for q in CHATS]
    results = []
    ngram = tandem.LLM(speculative="ngram")
    results.append(run_case("ngram / rewrite prompt", plain, ngram, rewrite, sp, args.repeats))
    results.append(run_case("ngram / chat prompts", plain, ngram, chats, sp, args.repeats))
    del ngram
    selfn = tandem.LLM(speculative=f"self:{args.self_layers}")
    results.append(
        run_case(f"self:{args.self_layers} / chat prompts", plain, selfn, chats, sp, args.repeats)
    )
    hdr = f"{'case':<28}{'plain tok/s':>12}{'spec tok/s':>12}{'speedup':>9}{'mean acc len':>14}{'accept %':>10}{'same':>6}"
    print(hdr)
    for r in results:
        print(
            f"{r['case']:<28}{r['plain_tokens_per_s']:>12.1f}{r['spec_tokens_per_s']:>12.1f}"
            f"{r['speedup']:>9.2f}{r['mean_accepted_length']:>14.2f}{100 * r['acceptance_rate']:>9.0f}%"
            f"{'yes' if r['identical_output'] else 'NO':>6}"
        )
    out = {
        "command": "python " + " ".join(sys.argv),
        "git_revision": subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "torch": torch.__version__,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d"),
        "notes": "Greedy; mean accepted length = tokens emitted per verification round (accepted "
        "drafts + the target's own token). Other processes shared the 2-core machine during the run.",
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
