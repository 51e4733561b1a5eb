"""Performance gate: the headline rows measured with repeats and compared with a committed baseline.

One command (a few minutes on an H200) measures, on random Llama-3-8B-shaped weights built on
the GPU (nothing downloaded):

  decode_b1_bf16    single-stream decode tokens/s through `LLMEngine.step` (CUDA graphs,
                    asynchronous scheduling, greedy), bf16 weights
  decode_b1_int4    the same with INT4 g128 linears and head, INT8 embedding (RTN)
  decode_b64        decode tokens/s of 64 sequences decoding together, bf16
  decode_b256       the same with 256 sequences
  prefill_2k        prompt tokens/s of one 2,048-token prompt (time to its first token)
  prefill_8k        the same at 8,192 tokens
  kv_handover_2k    GB/s of a prompt's KV moving from a prefill worker to a decode worker over
                    CUDA IPC, 2,048 tokens (bench/transfer.py's processes and small model)
  kv_handover_8k    the same at 8,192 tokens
  services_b1       output tokens/s of one stream (closed loop) through `tandem up`: gateway,
                    prefill and decode processes, every prompt prefilled on the prefill worker
                    and its KV handed to the decode worker by CUDA IPC; bf16
  services_b64      the same with 64 concurrent streams
  sharegpt_engine   output tokens/s of bench/throughput.py's ShareGPT-like run, 300 requests
                    sent at once, through the engine in-process (one run per gate run)
  sharegpt_services the same requests through `tandem up`'s processes; it also records its
                    fraction of the engine's tokens/s and its TTFT p50

Decode rows use bench/throughput.py's workload (128-token prompts, 128 new tokens, max model
length 4096) and also report their fraction of the roofline (every weight plus each sequence's KV
read once per step, over the device-to-device copy bandwidth measured in the same run). Every row
is measured --repeats times (prefill rows three times as often), the repeats of all rows
interleaved, and its value is the median; the handover rows take HANDOVER_ROUNDS rounds in one
pair of worker processes and their best (a round of 1 to 3 ms is only ever slowed by the rest of
the machine). Pairs of processes differ more than rounds do: on one H100 two runs of one build
handed 8k tokens over in 1.73 and 2.37 ms (best rounds 1.61 and 2.20). So a handover row over
several runs (`--base --rounds`) is the median of each run's best, and its tolerance is the
larger spread between the runs of either tree (max - min over median), at most
PROCESS_NOISE_CAP.

Services rows use bench/serve.py's load generator (gRPC `Gateway/Generate` clients) on the decode
rows' workload and engine settings, over a random checkpoint written once to
$TMPDIR/tandem-gate-llama3-8b (16 GB; reused by later runs; --services-checkpoint DIR elsewhere). The same requests also run through
the engine in a child process of its own (serve.py's in-process path); the services and that
engine are started once, side by side, for both rows, and after a warm-up level per row each
repeat runs a services level and then the in-process level of the same requests (fresh prompts
every level: 3 requests at one stream, one wave of 64 at 64). Besides the value (the median of
the services' output tokens/s over the level), a row records `fraction_of_inprocess` (the median
of services / in-process tokens/s: service overhead) and both paths' TPOT and TTFT p50.

A row fails when its value is worse than the baseline's by more than its noise: the larger
relative spread (interquartile range / median) of its repeats here and in the baseline, at least
NOISE_FLOOR (repeats within one run do not see the spread between machines of one kind: on two
H200s here the same kernels decoded batch 64 at 11,660 and 11,450 tok/s, 1.8% apart, each run's
repeats within 0.3%) and at most NOISE_CAP. The exit status is 1 when
a row fails (or errors), 0 otherwise; with no baseline of the same device, nothing is compared.

    python bench/gate.py                           # H200: compare with bench/baseline_h200.json
    python bench/gate.py --out /tmp/gate.json      # results elsewhere
    python bench/gate.py --smoke --rows decode_b1_bf16,prefill_2k     # a tiny model on a CPU
    python bench/gate.py --smoke --rows services_b1,services_b64       # the services, on a CPU
    python bench/gate.py --readme                  # README's performance table from the baseline

The baseline is a results file of this script (`cp bench/results/gate_h200.json
bench/baseline_h200.json`); replace it only with a better measurement, and say so in the commit.

H200s of one kind differ by more than a row's noise (batch 256 decoded at 23,600 to 25,100
tok/s on different ones with the same code). When a row fails, measure the baseline's revision
on the same machine before calling it a regression: `--base DIR` runs the rows in this tree and
in the checkout DIR alternately, `--rounds` times each, every run a process importing its own
tree, and judges this tree against DIR's pooled repeats instead of the baseline file, e.g.

    git worktree add /tmp/base $(python -c "import json; print(json.load(open(
        'bench/baseline_h200.json'))['git_revision'])")
    python bench/gate.py --rows decode_b256 --repeats 3 --base /tmp/base
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BASELINE = os.path.join(HERE, "baseline_h200.json")
README = os.path.join(ROOT, "README.md")
NOISE_CAP = 0.03
NOISE_FLOOR = 0.02
# Rows whose runs differ more than their repeats (the handover rows): their tolerance may reach
# this spread between runs.
PROCESS_NOISE_CAP = 0.4
HANDOVER_ROUNDS = 25
# Prefill medians of 5 moved by 1% between two runs of one build: three times the repeats.
PREFILL_REPEATS_PER_REPEAT = 3

# name -> (unit, what it measures): the order of the table.
ROWS: dict[str, tuple[str, str]] = {
    "decode_b1_bf16": ("tok/s", "decode, batch 1, bf16"),
    "decode_b1_int4": ("tok/s", "decode, batch 1, INT4 weights and head"),
    "decode_b64": ("tok/s", "decode, batch 64, bf16"),
    "decode_b256": ("tok/s", "decode, batch 256, bf16"),
    "prefill_2k": ("tok/s", "prefill, one 2,048-token prompt, bf16"),
    "prefill_8k": ("tok/s", "prefill, one 8,192-token prompt, bf16"),
    "kv_handover_2k": ("GB/s", "KV handover by CUDA IPC, 2,048 tokens"),
    "kv_handover_8k": ("GB/s", "KV handover by CUDA IPC, 8,192 tokens"),
    "services_b1": ("tok/s", "services (gateway, prefill, decode), 1 stream, bf16"),
    "services_b64": ("tok/s", "services (gateway, prefill, decode), 64 streams, bf16"),
    "sharegpt_engine": ("tok/s", "ShareGPT-like, 300 requests at once, engine in-process"),
    "sharegpt_services": ("tok/s", "ShareGPT-like, 300 requests at once, through the services"),
}
# Services rows: concurrent streams (closed loop), and requests per level: at least
# SERVICES_MIN_REQUESTS, and one per stream (64 streams: one wave of 64 requests).
SERVICES_ROWS = {"services_b1": 1, "services_b64": 64}
SHAREGPT_ROWS = {"sharegpt_engine": "engine", "sharegpt_services": "services"}
SHAREGPT_REQUESTS = 300  # smoke: bench/throughput.py's 12
SHAREGPT_KV_GB = 16  # per engine: every request's KV at once, two workers' beside an H100's weights
SERVICES_MIN_REQUESTS = 3
SERVICES_TIMEOUT_S = 120.0  # a services level that takes longer is an error (not a hang)
README_BEGIN = "<!-- performance table: generated by `python bench/gate.py --readme` -->"
README_END = "<!-- end of performance table -->"


# ---- comparison (pure: unit-tested on a CPU) -----------------------------------------------------
def rel_spread(xs: list[float]) -> float:
    """The interquartile range of the repeats over their median (quartiles of the repeats
    themselves, so one outlier among five moves it little); 0 for fewer than two."""
    if len(xs) < 2:
        return 0.0
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return (q3 - q1) / med if med else 0.0


def tolerance(current: list[float], baseline: list[float]) -> float:
    """How much worse than the baseline a row may be: its noise, within [floor, cap]."""
    noise = max(rel_spread(current), rel_spread(baseline))
    return min(NOISE_CAP, max(NOISE_FLOOR, noise))


def rel_range(xs: list[float]) -> float:
    """(max - min) / median of one value per run; 0 for fewer than two."""
    if len(xs) < 2:
        return 0.0
    med = statistics.median(xs)
    return (max(xs) - min(xs)) / med if med else 0.0


def row_tolerance(row: dict[str, Any], base: dict[str, Any]) -> float:
    """`tolerance`, or for a row with one value per run on both sides (`run_values`, two runs
    or more each) the larger spread between runs when it is larger, at most
    PROCESS_NOISE_CAP."""
    tol = tolerance(row["repeats"], base["repeats"])
    runs, base_runs = row.get("run_values", []), base.get("run_values", [])
    if len(runs) < 2 or len(base_runs) < 2:
        return tol
    return max(tol, min(PROCESS_NOISE_CAP, max(rel_range(runs), rel_range(base_runs))))


def compare(current: dict[str, dict], baseline: dict[str, dict] | None) -> list[dict[str, Any]]:
    """One verdict per measured row: `fail` when its median is below the baseline's median by
    more than `tolerance` (every row is higher-is-better) or when it errored, `better` when above
    by more, `same` within it, `new` when the baseline lacks the row."""
    out = []
    for name, row in current.items():
        v = {"row": name}
        if "error" in row:
            out.append({**v, "verdict": "fail", "why": row["error"]})
            continue
        base = (baseline or {}).get(name)
        if not base or "value" not in base:
            out.append({**v, "verdict": "new", "value": row["value"]})
            continue
        tol = row_tolerance(row, base)
        ratio = row["value"] / base["value"]
        verdict = "fail" if ratio < 1 - tol else "better" if ratio > 1 + tol else "same"
        out.append({**v, "verdict": verdict, "value": row["value"], "baseline": base["value"],
                    "ratio": ratio, "tolerance": tol})  # fmt: skip
    return out


def pooled(runs: list[dict], name: str) -> dict[str, Any]:
    """Row `name` over several runs of the gate: their repeats together and the row's statistic
    over them (the median; for the handover rows the median of each run's best, for the
    ShareGPT-like rows of each run's value, kept in `run_values`); the last run's other fields. An error in any run, or a run without the
    row, is the row's error."""
    rows = [run["rows"].get(name) for run in runs]
    for row in rows:
        if row is None or "error" in row:
            return {"error": row["error"] if row else "not measured"}
    repeats = [x for row in rows for x in row["repeats"]]
    per_run = rows[-1].get("statistic") in ("best", "run")
    out = {**rows[-1], "repeats": repeats}
    if per_run:
        out["run_values"] = [row["value"] for row in rows]
        out["value"] = statistics.median(out["run_values"])
    else:
        out["value"] = statistics.median(repeats)
    fractions = [x for row in rows for x in row.get("fraction_repeats", [])]
    if fractions:
        out["fraction_of_roofline"] = statistics.median(fractions)
        out["fraction_repeats"] = fractions
    return out


def failed(verdicts: list[dict[str, Any]]) -> bool:
    return any(v["verdict"] == "fail" for v in verdicts)


def comparable(result: dict, baseline: dict | None) -> bool:
    """A baseline measured on the same kind of device (and not a smoke run)."""
    return (
        bool(baseline)
        and baseline.get("device") == result.get("device")
        and not (result.get("smoke") or baseline.get("smoke"))
    )


def services_row(
    services: list[dict[str, Any]], in_process: list[dict[str, Any]], transport: str
) -> dict[str, Any]:
    """A services row from bench/serve.py's level summaries, repeat by repeat (`services[i]` and
    `in_process[i]` served the same requests): its value is the median over repeats of the
    services' output tokens/s, `fraction_of_inprocess` the median of services / in-process
    tokens/s per repeat, and TPOT / TTFT p50 of both paths the medians over repeats. Raises
    when a level had errors, lost tokens, or moved KV by another transport than `transport`."""
    if not services or len(services) != len(in_process):
        raise ValueError(f"{len(services)} services levels for {len(in_process)} in-process ones")
    for path, levels in (("services", services), ("in-process", in_process)):
        for lv in levels:
            if lv["errors"] or lv["output_tokens"] != lv["expected_output_tokens"]:
                raise RuntimeError(
                    f"{path} {lv['level']}: {lv['errors']} errors, {lv['output_tokens']} of "
                    f"{lv['expected_output_tokens']} tokens: {lv.get('error_messages', [])}"
                )
    for lv in services:
        if lv.get("kv_transports") != [transport]:
            raise RuntimeError(
                f"services {lv['level']}: KV moved by {lv.get('kv_transports')}, not {transport!r}"
            )

    def med(levels: list[dict[str, Any]], key: str) -> float:
        return statistics.median(lv[key] for lv in levels)

    tps = [lv["output_tokens_per_s"] for lv in services]
    tps_in = [lv["output_tokens_per_s"] for lv in in_process]
    frac = [a / b for a, b in zip(tps, tps_in, strict=True)]
    tpot, tpot_in = med(services, "tpot_p50_ms"), med(in_process, "tpot_p50_ms")
    return {
        "value": statistics.median(tps),
        "statistic": "median",
        "repeats": tps,
        "fraction_of_inprocess": statistics.median(frac),
        "fraction_repeats": frac,
        "inprocess_value": statistics.median(tps_in),
        "inprocess_repeats": tps_in,
        "services_tpot_p50_ms": tpot,
        "inprocess_tpot_p50_ms": tpot_in,
        "tpot_ratio": tpot / tpot_in,
        "services_ttft_p50_ms": med(services, "ttft_p50_ms"),
        "inprocess_ttft_p50_ms": med(in_process, "ttft_p50_ms"),
        "kv_transport": transport,
    }


def fraction(row: dict[str, Any]) -> float | None:
    """A row's fraction column: of the roofline (decode rows), of in-process (services rows), of
    the engine (the ShareGPT-like services row)."""
    for key in ("fraction_of_roofline", "fraction_of_inprocess", "fraction_of_engine"):
        if key in row:
            return row[key]
    return None


# ---- tables --------------------------------------------------------------------------------------
def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.1f}"


def readme_block(baseline: dict) -> str:
    """The README's performance table (markdown) from a baseline file, between its markers."""
    hw = baseline.get("hardware") or {}
    machine = ", ".join(
        x
        for x in (
            f"{hw['memory_GiB']:.0f} GiB" if "memory_GiB" in hw else "",
            f"CUDA {hw['cuda']}" if hw.get("cuda") else "",
            f"{hw['cpu_count']} CPU cores" if hw.get("cpu_count") else "",
            f"torch {baseline['torch']}" if baseline.get("torch") else "",
            f"Triton {baseline['triton']}" if baseline.get("triton") else "",
        )
        if x
    )
    lines = [
        README_BEGIN,
        "## Performance",
        "",
        f"Measured by `python bench/gate.py` ({baseline['seconds'] / 60:.0f} minutes) on one"
        f" {baseline['device']}{f' ({machine})' if machine else ''} at"
        f" {baseline['git_revision'][:7]} ({baseline['date'][:10]}),",
        "random Llama-3-8B-shaped weights: the median of the repeats (KV handover: the best of"
        f" {baseline.get('handover_rounds', HANDOVER_ROUNDS)} rounds), from",
        "`bench/baseline_h200.json`. Decode: 128-token prompts, 128 new tokens; its roofline is",
        "every weight plus each sequence's KV read once per step at the copy bandwidth measured in",
        f"the same run ({baseline['copy_bandwidth_Bps'] / 1e9:,.0f} GB/s).",
    ]
    services = any(name in baseline["rows"] for name in SERVICES_ROWS)
    if services:
        lines += [
            "Services: the same decode workload through `tandem up` (gateway, prefill and decode",
            "processes, KV by CUDA IPC) as one stream or 64 concurrent streams, output tokens/s",
            "of the closed loop; its fraction is of the same load through the engine in-process.",
        ]
    lines += [
        "",
        "| row | value | interquartile range of the repeats | fraction of roofline"
        f"{' or in-process' if services else ''} |",
        "|---|---:|---:|---:|",
    ]
    for name, (unit, what) in ROWS.items():
        r = baseline["rows"].get(name)
        if not r or "value" not in r:
            continue
        frac = fraction(r)
        lines.append(
            f"| {what} | {_fmt(r['value'])} {unit} | {rel_spread(r['repeats']) * 100:.1f}% | "
            f"{f'{frac:.3f}' if frac is not None else '-'} |"
        )
    lines += ["", README_END]
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """`text` with its marked performance block replaced by `block`."""
    i, j = text.find(README_BEGIN), text.find(README_END)
    if i < 0 or j < i:
        raise ValueError(f"README has no block between {README_BEGIN!r} and {README_END!r}")
    return text[:i] + block + text[j + len(README_END) :]


def print_table(result: dict, verdicts: list[dict[str, Any]]) -> None:
    by = {v["row"]: v for v in verdicts}
    print(f"\n{result['device']}  copy bandwidth {result['copy_bandwidth_Bps'] / 1e9:,.0f} GB/s  "
          f"{result['seconds']:.0f} s")  # fmt: skip
    print(f"{'row':<18}{'value':>12} {'unit':<6}{'spread':>8}{'fraction':>10}"
          f"{'baseline':>12}{'ratio':>8}{'tol':>7}  verdict")  # fmt: skip
    for name, row in result["rows"].items():
        v = by.get(name, {})
        if "error" in row:
            print(f"{name:<18}  error: {row['error'][:80]}")
            continue
        frac = fraction(row)
        base = v.get("baseline")
        print(
            f"{name:<18}{_fmt(row['value']):>12} {ROWS[name][0]:<6}"
            f"{rel_spread(row['repeats']) * 100:>7.2f}%{f'{frac:.3f}' if frac else '-':>10}"
            f"{_fmt(base) if base else '-':>12}{v.get('ratio', float('nan')):>8.3f}"
            f"{v.get('tolerance', float('nan')) * 100:>6.1f}%  {v.get('verdict', '-')}"
        )
    services = {n: r for n, r in result["rows"].items() if n in SERVICES_ROWS and "value" in r}
    if services:
        print("fraction: of the roofline (decode rows), of the same load in-process (services)")
        print(f"\n{'services':<16}{'tok/s':>10}{'in-process':>12}{'TPOT p50':>10}"
              f"{'in-process':>12}{'ratio':>7}{'TTFT p50':>10}{'in-process':>12}  (ms)")  # fmt: skip
        for name, r in services.items():
            print(
                f"{name:<16}{_fmt(r['value']):>10}{_fmt(r['inprocess_value']):>12}"
                f"{r['services_tpot_p50_ms']:>10.2f}{r['inprocess_tpot_p50_ms']:>12.2f}"
                f"{r['tpot_ratio']:>7.2f}{r['services_ttft_p50_ms']:>10.1f}"
                f"{r['inprocess_ttft_p50_ms']:>12.1f}"
            )


# ---- measurement ---------------------------------------------------------------------------------
def _measure(rows: list[str], args, res: dict) -> None:
    """Fill res["rows"] with each selected row's repeats and median."""
    import torch

    sys.path.insert(0, HERE)
    import llama_random as lr

    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    smoke = not cuda
    # Room for an 8,192-token prompt: max_position_embeddings only sizes the rotary table.
    shape = dict(lr.SMOKE if smoke else lr.LLAMA3_8B, max_position_embeddings=16384)
    prompt, new = (16, 8) if smoke else (128, 128)
    reps = args.repeats
    bw = lr.copy_bandwidth() if cuda else 1e11
    res["copy_bandwidth_Bps"] = bw
    out: dict[str, dict] = res["rows"]
    samples: dict[str, list[float]] = {n: [] for n in rows}
    fractions: dict[str, list[float]] = {n: [] for n in rows}

    def guarded(name: str, fn) -> None:
        if name not in rows or "error" in out.get(name, {}):
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - report the row, go on with the others
            import traceback

            traceback.print_exc()
            out[name] = {"error": repr(e)[:400]}

    dtype = torch.bfloat16 if cuda else torch.float32
    in_process_rows = [n for n in rows if n.startswith(("decode_", "prefill_"))]
    hf = lr.build_hf_model(shape, dev, dtype) if in_process_rows else None
    vocab = shape["vocab_size"]
    common = dict(device=dev, dtype="bfloat16" if cuda else "float32", cuda_graphs=True,
                  async_scheduling=True)  # fmt: skip
    decode_rows = {"decode_b1_bf16": ("bf16", 1), "decode_b1_int4": ("int4", 1),
                   "decode_b64": ("bf16", 64), "decode_b256": ("bf16", 256)}  # fmt: skip
    wanted = [n for n in decode_rows if n in rows]
    engines: dict[str, Any] = {}
    if wanted:
        max_b = max(decode_rows[n][1] for n in wanted)
        kv_gb = 1.2 * max_b * (prompt + new + 16) * 131072 / 2**30 if cuda else 0.25
        opts = dict(common, max_model_len=4096, kv_cache_memory_gb=max(kv_gb, 1.0),
                    max_num_seqs=max(8, max_b), max_num_batched_tokens=max(8192, max_b * prompt))  # fmt: skip
        if any(decode_rows[n][0] == "bf16" for n in wanted):
            engines["bf16"] = lr.tandem_engine(hf, **opts)
        if "decode_b1_int4" in wanted:
            guarded("decode_b1_int4", lambda: engines.update(int4=_int4_all(hf, opts, lr)))
    prompts = {n: lr.random_prompts(decode_rows[n][1], prompt, vocab, seed=decode_rows[n][1])
               for n in wanted}  # fmt: skip

    def decode_once(name: str, tokens: int) -> None:
        kind, b = decode_rows[name]
        engine = engines[kind]
        run = lr.run_engine(engine, prompts[name], tokens)
        if tokens == new:
            wb, kvt = lr.weight_bytes_per_step(engine), lr.kv_bytes_per_token(engine)
            roof = lr.decode_roofline_s(wb, kvt, b, prompt, new, bw)
            samples[name].append(run.decode_tokens / run.decode_s)
            fractions[name].append(roof / run.decode_s)

    # Warm-up, a whole run: kernels compiled, the batch's graph captured (and the first run of
    # 256 sequences after a short warm-up measured 16% slower than the rest).
    for name in wanted:
        guarded(name, lambda name=name: decode_once(name, new + 1))
    for _ in range(reps):
        for name in wanted:
            guarded(name, lambda name=name: decode_once(name, new))
    engines.clear()

    prefill_rows = {"prefill_2k": 2048, "prefill_8k": 8192}
    wanted_p = [n for n in prefill_rows if n in rows]
    if wanted_p:
        longest = max(prefill_rows[n] for n in wanted_p)
        engine = lr.tandem_engine(
            hf, **common, max_model_len=longest + 64, kv_cache_memory_gb=4.0 if cuda else 0.5,
            max_num_seqs=8, max_num_batched_tokens=max(8192, longest), enable_prefix_cache=False,
        )  # fmt: skip
        seed = iter(range(1000, 10**6))

        def prefill_once(name: str, record: bool) -> None:
            n = prefill_rows[name]
            run = lr.run_engine(engine, lr.random_prompts(1, n, vocab, seed=next(seed)), 1)
            if record:
                samples[name].append(n / run.e2e_s)

        for name in wanted_p:
            guarded(name, lambda name=name: prefill_once(name, False))
        for _ in range(PREFILL_REPEATS_PER_REPEAT * reps):  # a prompt takes 0.05 to 0.25 s
            for name in wanted_p:
                guarded(name, lambda name=name: prefill_once(name, True))
        del engine
    hf = None  # the engines above hold what they use of it
    if cuda:
        gc.collect()  # the engines' captured graphs and pools, before the next rows' processes
        torch.cuda.empty_cache()

    handover_rows = {"kv_handover_2k": 2048, "kv_handover_8k": 8192}
    wanted_h = [n for n in handover_rows if n in rows]
    if wanted_h:

        def handover() -> None:
            lens = sorted(handover_rows[n] for n in wanted_h)
            res["handover_rounds"] = max(reps, HANDOVER_ROUNDS)
            for name, rec in _handover(lens, res["handover_rounds"], cuda):
                samples[name].extend(rec["samples"])
                out[name] = {k: v for k, v in rec.items() if k != "samples"}

        guarded(wanted_h[0], handover)
        for name in wanted_h[1:]:
            if "error" in out.get(wanted_h[0], {}):
                out[name] = out[wanted_h[0]]

    wanted_g = [n for n in SHAREGPT_ROWS if n in rows]
    if wanted_g:

        def sharegpt() -> None:
            for name, row in _sharegpt(wanted_g, cuda, args.services_checkpoint).items():
                out[name] = row
                samples[name] = row.get("repeats", [])

        guarded(wanted_g[0], sharegpt)
        for name in wanted_g[1:]:
            if "error" in out.get(wanted_g[0], {}):
                out[name] = out[wanted_g[0]]

    wanted_s = [n for n in SERVICES_ROWS if n in rows]
    if wanted_s:
        levels: dict[str, tuple[list[dict], list[dict]]] = {}
        transport = "cuda_ipc_push" if cuda else "shm_push"  # pushed into reserved blocks

        def services() -> None:
            res["services"] = {}
            levels.update(_services(wanted_s, cuda, reps, prompt, new, lr, args.services_checkpoint,
                                    res["services"]))  # fmt: skip

        guarded(wanted_s[0], services)
        for name in wanted_s:
            if name not in levels:
                out[name] = out[wanted_s[0]]
                continue

            def summary(name: str = name) -> None:
                out[name] = services_row(*levels[name], transport)
                samples[name] = out[name]["repeats"]

            guarded(name, summary)

    for name in rows:
        if "error" in out.get(name, {}):
            continue
        if not samples[name]:
            out[name] = {"error": "no repeats measured"}
            continue
        row = out.setdefault(name, {})
        best = name.startswith("kv_handover")
        value = max(samples[name]) if best else statistics.median(samples[name])
        stat = "best" if best else "run" if name in SHAREGPT_ROWS else "median"
        row.update(value=value, statistic=stat, repeats=samples[name])
        if fractions[name]:
            row["fraction_of_roofline"] = statistics.median(fractions[name])
            row["fraction_repeats"] = fractions[name]
    res["rows"] = {name: out[name] for name in rows}


def _int4_all(hf, opts: dict, lr):
    """The engine over the same weights with INT4 g128 linears and LM head, INT8 embedding."""
    from tandem.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.formats.weight import LayerSpec, quantize_weights
    from tandem.model.config import ModelConfig
    from tandem.model.layer_names import linear_layer_names
    from tandem.model.loader import LoadedModel

    cfg = ModelConfig.from_hf(hf.config.to_dict(), name="random-llama-int4")
    specs = {n: LayerSpec(4, 128, True) for n in linear_layer_names(cfg.num_layers)}
    specs["lm_head"] = LayerSpec(4, 128, True)
    specs["model.embed_tokens"] = LayerSpec(8, 128, True)
    weights = quantize_weights(dict(hf.state_dict()), specs)
    loaded = LoadedModel(cfg, weights, lr._NoTokenizer(), "random-llama-int4")
    config = EngineConfig(**dict(opts, max_num_seqs=8))
    config.validate()
    return LLMEngine(loaded, config)


def _services(
    names: list[str], cuda: bool, reps: int, prompt: int, new: int, lr, ckpt: str | None,
    info: dict[str, Any],
):  # fmt: skip
    """bench/serve.py's closed-loop load through `tandem up` (gateway, prefill and decode
    processes; KV by CUDA IPC on a GPU, shared memory on a CPU; every prompt prefilled on the
    prefill worker) and through the engine in a child process, on one random checkpoint with the
    same engine settings as the decode rows. Both are started once, side by side, for every row;
    a warm-up level per row, then per repeat and row a services level and an in-process level of
    the same requests (fresh prompts each level, so no prefix cache helps). Returns {row:
    (services level summaries, in-process level summaries)}, one of each per repeat; `info`
    gets the checkpoint, the `tandem up` command and how long each part took."""
    import serve

    dims = lr.LLAMA3_8B if cuda else lr.SMOKE
    streams = max(SERVICES_ROWS[n] for n in names)
    # Every stage and the in-process engine get this pool: room for all streams at once, as the
    # decode rows size theirs (Llama-3-8B bf16: 128 KiB of KV per token, 2.6 GB for 64 streams).
    engine = serve.random_services_engine(cuda, streams, prompt + new + 16, ckpt, info,
                                          max_num_batched_tokens=max(8192, streams * prompt))  # fmt: skip
    seeds = iter(range(2000, 10**6))

    def level(name: str) -> Any:
        c = SERVICES_ROWS[name]
        n = max(SERVICES_MIN_REQUESTS, c)
        reqs = [serve.Req(p, new) for p in lr.random_prompts(n, prompt, dims["vocab_size"],
                                                             seed=next(seeds))]  # fmt: skip
        return serve.Level(f"{name} c={c}", "concurrency", c, reqs)

    out: dict[str, tuple[list[dict], list[dict]]] = {n: ([], []) for n in names}
    with serve.InProcessEngine(engine) as in_process:  # loads while the services start
        launched = serve.launch_disaggregated(engine, cuda)
        info.update(command=launched.command, startup_s=launched.startup_s)
        try:
            t0 = time.perf_counter()
            roots = [os.getpid(), launched.proc.pid]
            warm = [level(n) for n in names]
            serve.run_services(launched.address, warm, [], roots, launched, SERVICES_TIMEOUT_S)
            in_process.run(warm)
            for _ in range(reps):
                for name in names:
                    lv = level(name)
                    out[name][0].extend(serve.run_services(launched.address, [lv], [], roots,
                                                           launched, SERVICES_TIMEOUT_S))  # fmt: skip
                    out[name][1].extend(in_process.run([lv]))
            info["levels_s"] = time.perf_counter() - t0
        finally:
            # What the stages warned of during the rows (a worker marked down, a resumed
            # stream): a slow repeat is explained by its log, which stays on the machine.
            warnings = launched.stage_log_lines(r"WARNING|ERROR")
            info["stage_warnings"] = warnings[-40:]
            print(f"stage warnings during the services rows: {len(warnings)}", flush=True)
            for line in warnings[-10:]:
                print("  " + line, flush=True)
            launched.stop()
    return out


def _sharegpt(names: list[str], cuda: bool, ckpt: str | None):
    """bench/throughput.py's ShareGPT-like run (SHAREGPT_REQUESTS requests at once; smoke: its
    12) through the paths the rows name, in a process of its own: {row name: row}, one repeat
    each, or {"error": why}. The services row also gets its fraction of the engine's tokens/s (when both
    ran) and its TTFT p50."""
    path = os.path.join(tempfile.mkdtemp(prefix="tandem-gate-"), "sharegpt.json")
    paths = [SHAREGPT_ROWS[n] for n in names]
    cmd = [sys.executable, os.path.join(HERE, "throughput.py"), "--workload", "sharegpt-like",
           "--paths", ",".join(paths), "--out", path]  # fmt: skip
    cmd += ["--requests", str(SHAREGPT_REQUESTS), "--kv-gb", str(SHAREGPT_KV_GB),
            "--max-num-seqs", str(SHAREGPT_REQUESTS)] if cuda else ["--smoke"]  # fmt: skip
    if ckpt:
        cmd += ["--services-checkpoint", ckpt]
    subprocess.run(cmd, cwd=ROOT, timeout=900)  # its rows say what failed
    with open(path) as f:
        runs = {r["path"].split(" ")[0]: r for r in json.load(f)["rows"]}
    got: dict[str, dict[str, Any]] = {}
    for name in names:
        r = runs.get(SHAREGPT_ROWS[name])
        if r is None or "error" in r:
            got[name] = {"error": (r or {}).get("error", "not measured")}
            continue
        tps = r["output_tokens_per_s"]
        got[name] = {"value": tps, "repeats": [tps], "output_tokens": r["output_tokens"],
                     "wall_s": r["wall_s"]}  # fmt: skip
        if "ttft_p50_s" in r:
            got[name]["ttft_p50_ms"] = r["ttft_p50_s"] * 1e3
    eng, svc = got.get("sharegpt_engine", {}), got.get("sharegpt_services", {})
    if "value" in eng and "value" in svc:
        svc["fraction_of_engine"] = svc["value"] / eng["value"]
    return got


def _handover(lens: list[int], reps: int, cuda: bool):
    """bench/transfer.py's prefill and decode processes (CUDA IPC on a GPU, shared memory on a
    CPU): (row name, {samples: GB/s per round, handover_ms, ttft_share, kv_bytes}) per length."""
    path = os.path.join(tempfile.mkdtemp(prefix="tandem-gate-"), "transfer.json")
    cmd = [sys.executable, os.path.join(HERE, "transfer.py"), "--device", "cuda" if cuda else "cpu",
           "--transport", "cuda_ipc" if cuda else "shm", "--prompt-lens", *map(str, lens),
           "--reps", str(reps), "--out", path]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=600)
    with open(path) as f:
        rows = json.load(f)["results"]
    for r in rows:
        n = r["prompt_tokens"]
        name = f"kv_handover_{n // 1024}k"
        yield (
            name,
            {
                "samples": [r["kv_bytes"] / (ms / 1e3) / 1e9 for ms in r["handover_ms_samples"]],
                "handover_ms": r["handover_ms"],
                "ttft_ms": r["ttft_ms"],
                "ttft_share": r["ttft_share"],
                "kv_bytes": r["kv_bytes"],
                "transport": r["transport"],
            },
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help="comma list of rows (default: all)")
    ap.add_argument("--repeats", type=int, default=None, help="per row (default 5; smoke 2)")
    ap.add_argument("--baseline", default=BASELINE)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gate_h200.json"))
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    ap.add_argument(
        "--services-checkpoint",
        default=None,
        help="the services rows' random checkpoint: written there once, reused after "
        "(default $TMPDIR/tandem-gate-llama3-8b, 16 GB; smoke: tandem-gate-smoke)",
    )
    ap.add_argument("--readme", action="store_true", help="rewrite README's table from --baseline")
    ap.add_argument(
        "--base",
        default=None,
        help="a checkout to compare with on this machine instead of the baseline file (a copy "
        "without its history, e.g. from `git archive`, names its revision in a file REVISION; "
        "TANDEM_GIT_REV names this tree's)",
    )
    ap.add_argument("--rounds", type=int, default=2,
                    help="--base: runs of each tree, alternated (default 2)")  # fmt: skip
    args = ap.parse_args()
    if args.readme:
        with open(args.baseline) as f:
            block = readme_block(json.load(f))
        with open(README) as f:
            text = f.read()
        new = replace_block(text, block)
        if new != text:
            with open(README, "w") as f:
                f.write(new)
        print(f"README.md: performance table {'rewritten' if new != text else 'already current'}")
        return 0
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; known: {list(ROWS)}")
    args.repeats = args.repeats or (2 if args.smoke else 5)
    if args.out == ap.get_default("out") and (args.smoke or args.base):
        name = "gate_smoke.json" if args.smoke else "gate_ab.json"
        args.out = os.path.join(tempfile.mkdtemp(prefix="tandem-gate-"), name)
    if args.base:
        return against_base(rows, args)
    sys.path.insert(0, HERE)
    import llama_random as lr

    t0 = time.perf_counter()
    import tandem

    res: dict[str, Any] = {"benchmark": "gate", **lr.run_info(sys.argv), "smoke": args.smoke,
                           "repeats": args.repeats, "tandem_path": os.path.dirname(tandem.__file__),
                           "rows": {}}  # fmt: skip
    try:
        import torch

        if torch.cuda.is_available() and not args.smoke:
            res["hardware"] = {"gpu": torch.cuda.get_device_name(),
                               "capability": list(torch.cuda.get_device_capability()),
                               "memory_GiB": torch.cuda.get_device_properties(0).total_memory / 2**30,
                               "cuda": torch.version.cuda, "cpu_count": os.cpu_count()}  # fmt: skip
        else:
            res["device"] = "cpu"
            res["hardware"] = {"cpu_count": os.cpu_count()}
        _measure(rows, args, res)
    finally:
        res["seconds"] = time.perf_counter() - t0
        baseline = None
        if os.path.exists(args.baseline):
            with open(args.baseline) as f:
                baseline = json.load(f)
        ok_base = comparable(res, baseline)
        verdicts = compare(res["rows"], baseline["rows"] if ok_base else None)
        res["baseline"] = {"path": os.path.relpath(args.baseline, ROOT),
                           "git_revision": baseline.get("git_revision") if baseline else None,
                           "compared": ok_base}  # fmt: skip
        save(res, verdicts, args.out)
    print_table(res, verdicts)
    if not ok_base:
        print(f"no comparable baseline ({args.baseline}): nothing compared")
    print(f"{'PASS' if res['passed'] else 'FAIL'}; wrote {args.out}")
    return 0 if res["passed"] else 1


def save(res: dict, verdicts: list[dict[str, Any]], out: str) -> None:
    """The verdicts and whether the run passed, into `res`, and `res` into the file `out`."""
    res["verdicts"] = verdicts
    res["passed"] = not failed(verdicts)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
        f.write("\n")


def tree_revision(tree: str) -> str:
    """The revision a tree's results name: the file REVISION at its top when there is one (a
    copy made with `git archive`, or any copy whose history stays elsewhere), else git's HEAD
    when the tree is the top of a checkout of its own, else "unknown" (never the revision of a
    checkout it merely sits inside)."""
    marker = os.path.join(tree, "REVISION")
    if os.path.isfile(marker):
        with open(marker) as f:
            return f.read().strip() or "unknown"

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=tree, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip

    try:
        if os.path.realpath(git("rev-parse", "--show-toplevel")) != os.path.realpath(tree):
            return "unknown"
        return git("rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def against_base(rows: list[str], args) -> int:
    """The rows measured in this tree and in the checkout `args.base`, alternately (this, base,
    this, base...: `args.rounds` gate runs of each, every one a process of its own importing its
    own tree), each row's repeats pooled per tree, and this tree judged against the base as
    against a baseline. Machines of one kind differ by more than a row's noise; one machine
    measuring both does not."""
    base = os.path.abspath(args.base)
    if not (os.path.isfile(os.path.join(base, "bench", "gate.py"))
            and os.path.isdir(os.path.join(base, "tandem"))):  # fmt: skip
        raise SystemExit(f"--base {base}: not a checkout of Tandem (no bench/gate.py, tandem/)")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    tmp = tempfile.mkdtemp(prefix="tandem-gate-ab-")
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                 if p and os.path.abspath(p) not in (ROOT, base)]  # fmt: skip
    runs: dict[str, list[dict]] = {"this": [], "base": []}
    t0 = time.perf_counter()
    for i in range(args.rounds):
        for side, tree in (("this", ROOT), ("base", base)):
            out = os.path.join(tmp, f"{side}{i}.json")
            cmd = [sys.executable, os.path.join(tree, "bench", "gate.py"), "--rows", ",".join(rows),
                   "--repeats", str(args.repeats), "--out", out,
                   "--baseline", os.path.join(tmp, "none.json")]  # fmt: skip
            if args.smoke:
                cmd.append("--smoke")
            if args.services_checkpoint:
                cmd += ["--services-checkpoint", args.services_checkpoint]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, *inherited]))
            if side == "base" or "TANDEM_GIT_REV" not in os.environ:
                env["TANDEM_GIT_REV"] = tree_revision(tree)  # what its results will name
            print(f"round {i + 1} of {args.rounds}: {side} ({tree})", flush=True)
            proc = subprocess.run(cmd, cwd=tree, env=env)
            if not os.path.exists(out):
                raise SystemExit(f"the gate in {tree} wrote no results (exit {proc.returncode})")
            with open(out) as f:
                runs[side].append(json.load(f))
    first = runs["this"][0]
    res: dict[str, Any] = {
        "benchmark": "gate",
        **{k: first[k] for k in ("git_revision", "git_uncommitted_changes", "device", "torch",
                                 "triton", "transformers", "python", "hardware", "tandem_path")
           if k in first},
        "command": "python " + " ".join(sys.argv),
        "smoke": args.smoke,
        "repeats": args.repeats * args.rounds,
        "copy_bandwidth_Bps": statistics.median(
            r.get("copy_bandwidth_Bps", 0.0) for r in runs["this"] + runs["base"]),
        "seconds": time.perf_counter() - t0,
        "rows": {name: pooled(runs["this"], name) for name in rows},
    }  # fmt: skip
    base_rows = {name: pooled(runs["base"], name) for name in rows}
    verdicts = compare(res["rows"], base_rows)
    res["baseline"] = {"path": base, "git_revision": runs["base"][0].get("git_revision"),
                       "tandem_path": runs["base"][0].get("tandem_path"), "compared": True,
                       "rounds": args.rounds, "rows": base_rows}  # fmt: skip
    save(res, verdicts, args.out)
    print_table(res, verdicts)
    print(f"baseline: {base} ({res['baseline']['git_revision']}), alternated on this machine")
    print(f"{'PASS' if res['passed'] else 'FAIL'}; wrote {args.out}")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
