"""Decode throughput of the Tandem engine at fixed batch sizes against transformers `generate` on
the same random weights and workload, in the same run (Llama-3-8B shape, bf16, no download).

For each batch size B, B prompts of --prompt random tokens each generate exactly --new-tokens
greedy tokens. Tandem rows report decode tokens/s (after every sequence has its first token; the
fraction of that batch's roofline: every weight plus each sequence's KV read once per step, at the
copy bandwidth measured in this run) and end-to-end tokens/s (prefill included, as `generate`
is timed). transformers rows time `generate` end to end: eager (dynamic cache) at every size and,
with --compiled, static cache + torch.compile at batch 1.

    python bench/throughput.py                 # writes bench/results/h200_throughput.json
    python bench/throughput.py --smoke         # tiny model, CPU or GPU, checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_random as lr  # noqa: E402


def ratios(rows: list[dict]) -> dict:
    """Tandem (default mode) over transformers, per batch size and transformers mode."""
    out = {}
    for r in rows:
        if r["engine"] != "tandem" or r["mode"] != "graphs+async":
            continue
        for h in rows:
            if h["engine"] == "transformers" and h["batch"] == r["batch"] and "e2e_s" in h:
                out[f"b{r['batch']}_vs_{h['mode']}"] = {
                    "e2e": r["e2e_tokens_per_s"] / h["e2e_tokens_per_s"],
                    "tandem_decode_vs_hf_e2e": r["decode_tokens_per_s"] / h["e2e_tokens_per_s"],
                }
    return out


@torch.no_grad()
def hf_step_s(model, prompt: int, vocab: int, steps: int = 20) -> float:
    """Median seconds of one single-token transformers forward with a dynamic KV cache."""
    ids = torch.tensor(lr.random_prompts(1, prompt, vocab), device="cuda")
    out = model(ids, use_cache=True)
    past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        lr.sync()
        t = time.perf_counter()
        out = model(tok, past_key_values=past, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        lr.sync()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--hf-batches", default=None, help="transformers sizes (default: --batches)")
    ap.add_argument("--compiled", action="store_true", help="also static cache + torch.compile")
    ap.add_argument("--sync-too", action="store_true", help="also Tandem without async scheduling")
    ap.add_argument("--smoke", action="store_true", help="tiny model; runs on CPU too")
    ap.add_argument(
        "--out", default=os.path.join(lr.ROOT, "bench", "results", "h200_throughput.json")
    )
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    hf_sizes = args.batches if args.hf_batches is None else args.hf_batches
    hf_batches = [int(b) for b in hf_sizes.split(",") if b]
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    shape = lr.SMOKE if args.smoke else lr.LLAMA3_8B
    res: dict = {"benchmark": "throughput", **lr.run_info(sys.argv), "smoke": args.smoke}
    res["workload"] = {"prompt_tokens": args.prompt, "new_tokens": args.new_tokens,
                       "max_model_len": args.max_model_len, "greedy": True, "shape": shape}  # fmt: skip
    t0 = time.perf_counter()
    bw = lr.copy_bandwidth() if cuda else 1e11
    res["copy_bandwidth_Bps"] = bw
    dtype = torch.bfloat16 if cuda else torch.float32
    hf = lr.build_hf_model(shape, dev, dtype)
    vocab = shape["vocab_size"]
    max_b = max(batches, default=1)
    kv_gb = (
        1.2 * max_b * (args.prompt + args.new_tokens + 16) * 131072 / 2**30
        if not args.smoke
        else 0.5
    )
    base = dict(
        device=dev,
        dtype="bfloat16" if cuda else "float32",
        max_model_len=args.max_model_len,
        kv_cache_memory_gb=max(kv_gb, 1.0),
        max_num_seqs=max(256, max_b),
        max_num_batched_tokens=max(8192, max_b * args.prompt),
    )
    modes = {"graphs+async": dict(cuda_graphs=True, async_scheduling=True)}
    if args.sync_too:
        modes["graphs"] = dict(cuda_graphs=True, async_scheduling=False)
    rows: list[dict] = []
    res["rows"] = rows

    def save() -> None:  # after every section: a later one may run out of time
        res["seconds"] = time.perf_counter() - t0
        res["ratios"] = ratios(rows)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)

    for mode, opts in modes.items() if batches else ():
        engine = lr.tandem_engine(hf, **base, **opts)
        wb = lr.weight_bytes_per_step(engine)
        kvt = lr.kv_bytes_per_token(engine)
        res["weight_bytes_per_step"], res["kv_bytes_per_token"] = wb, kvt
        for b in batches:
            prompts = lr.random_prompts(b, args.prompt, vocab, seed=b)
            lr.run_engine(engine, prompts, 4)  # warm-up: kernels compiled, this bucket captured
            run = lr.run_engine(engine, prompts, args.new_tokens)
            roof = lr.decode_roofline_s(wb, kvt, b, args.prompt, args.new_tokens, bw)
            row = {"engine": "tandem", "mode": mode, "batch": b,
                   "decode_tokens_per_s": run.decode_tokens / run.decode_s,
                   "roofline_tokens_per_s": run.decode_tokens / roof,
                   "fraction_of_roofline": roof / run.decode_s,
                   "e2e_tokens_per_s": run.tokens / run.e2e_s,
                   "decode_s": run.decode_s, "e2e_s": run.e2e_s, "steps": run.steps}  # fmt: skip
            rows.append(row)
            print(row, flush=True)
            save()
        del engine
        if cuda:
            torch.cuda.empty_cache()

    for b in hf_batches:
        ids = torch.tensor(lr.random_prompts(b, args.prompt, vocab, seed=b), device=dev)
        try:
            lr.hf_generate_s(hf, ids[:, :8], 2)  # warm-up
            t = lr.hf_generate_s(hf, ids, args.new_tokens)
            row = {"engine": "transformers", "mode": "eager", "batch": b,
                   "e2e_tokens_per_s": b * args.new_tokens / t, "e2e_s": t}  # fmt: skip
        except Exception as e:  # noqa: BLE001 - e.g. out of memory at the largest size
            traceback.print_exc()
            row = {"engine": "transformers", "mode": "eager", "batch": b, "error": repr(e)[:300]}
        rows.append(row)
        print(row, flush=True)
        save()
        if cuda:
            torch.cuda.empty_cache()

    if 1 in hf_batches and cuda:
        # Where transformers' time goes at batch 1: one cached decode forward alone.
        res["transformers_forward_step_s"] = hf_step_s(hf, args.prompt, vocab)
        print(f"transformers: one decode forward {res['transformers_forward_step_s'] * 1e3:.1f} ms")
        save()

    if args.compiled:
        b = 1
        ids = torch.tensor(lr.random_prompts(b, args.prompt, vocab, seed=b), device=dev)
        try:
            hf.generation_config.cache_implementation = "static"
            hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
            tc = time.perf_counter()
            for _ in range(2):  # compiles prefill and decode shapes
                lr.hf_generate_s(hf, ids, args.new_tokens)
            compile_s = time.perf_counter() - tc
            t = lr.hf_generate_s(hf, ids, args.new_tokens)
            row = {"engine": "transformers", "mode": "static+compile", "batch": b,
                   "e2e_tokens_per_s": b * args.new_tokens / t, "e2e_s": t,
                   "warmup_s": compile_s}  # fmt: skip
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row = {"engine": "transformers", "mode": "static+compile", "batch": b,
                   "error": repr(e)[:300]}  # fmt: skip
        rows.append(row)
        print(row, flush=True)

    save()

    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'engine':<14}{'mode':<16}{'batch':>6}{'decode tok/s':>14}{'roofline':>10}"
          f"{'fraction':>10}{'e2e tok/s':>11}")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"{r['engine']:<14}{r['mode']:<16}{r['batch']:>6}  error: {r['error'][:60]}")
            continue
        dec = r.get("decode_tokens_per_s")
        cells = ("-", "-", "-")
        if dec:
            cells = (f"{dec:.1f}", f"{r['roofline_tokens_per_s']:.1f}",
                     f"{r['fraction_of_roofline']:.3f}")  # fmt: skip
        print(f"{r['engine']:<14}{r['mode']:<16}{r['batch']:>6}{cells[0]:>14}{cells[1]:>10}"
              f"{cells[2]:>10}{r['e2e_tokens_per_s']:>11.1f}")  # fmt: skip
    for k, v in res["ratios"].items():
        print(
            f"tandem/transformers {k}: e2e {v['e2e']:.2f}x, "
            f"tandem decode vs transformers e2e {v['tandem_decode_vs_hf_e2e']:.2f}x"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
