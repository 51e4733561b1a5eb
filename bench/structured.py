"""Structured output's cost: decode under a JSON schema against the same decode unconstrained.

On random Llama-3-8B-shaped weights built on the GPU (nothing downloaded) with a real tokenizer
(the embedded SmolLM2's, or --tokenizer DIR; ids past its vocabulary are never allowed by a
grammar), for each batch size in --batches and each of greedy and seeded sampling
(temperature 0.7):

  constrained  every sequence decodes under SCHEMA (`response_format` json_schema, strict):
               up to --new-tokens tokens, fewer where the JSON completes first;
  plain        the same prompts, unconstrained, each sequence generating exactly as many tokens
               as its constrained run did (ignore_eos), so both runs step the same batch shapes.

Both through `LLMEngine.step` with CUDA graphs and asynchronous scheduling, as the performance
gate runs them; the two alternate for --repeats rounds after a warm-up of each. Per run:
decode time = last token - every sequence's first token; TPOT = decode time / decode steps.
The cost is the median constrained decode time over the median plain one, minus 1 (target:
at most 10% at batch 1 and 32). The constrained outputs are checked: every finished one parses
as JSON and validates against SCHEMA (jsonschema), every unfinished one is a prefix the grammar
accepted.

    python bench/structured.py                              # H200: batches 1 and 32
    python bench/structured.py --smoke                      # a tiny model on a CPU
    python bench/structured.py --out bench/results/h200_structured.json
    python bench/structured.py --spec --repeats 3 --out bench/results/structured_spec_cpu.json

--spec measures instead what n-gram drafts (speculative decoding by prompt lookup) do under a
grammar: the embedded default model answers four order questions under SCHEMA, greedy, with
and without drafts, on this machine's device (target steps, tokens/s, and that both give the
same tokens).

Results (JSON with the exact command, revision and hardware) go to --out; a table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import llama_random as lr  # noqa: E402
import torch  # noqa: E402

# What an extraction API asks of a model: nested objects, arrays of objects, enums, bounded
# integers, short patterned strings and required fields.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "[A-Z]{3}-[0-9]{4}"},
        "status": {"type": "string", "enum": ["pending", "shipped", "delivered", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "[A-Za-z ]{1,24}"},
                "age": {"type": "integer", "minimum": 18, "maximum": 120},
                "tier": {"type": "string", "enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "age", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "[a-z0-9]{2,10}"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "quantity", "gift"],
                "additionalProperties": False,
            },
            "minItems": 1,
        },
    },
    "required": ["order_id", "status", "customer", "items"],
    "additionalProperties": False,
}


class HostTimes:
    """Seconds the engine thread spends per step: waiting for the step in flight, reading its
    tokens into the grammars, filling masks, enqueueing sampling, and in `step()` overall."""

    def __init__(self, engine) -> None:
        import tandem.engine.async_step as le  # where decode steps launched ahead sample

        self.t = {"step": 0.0, "wait": 0.0, "collect": 0.0, "masks": 0.0, "sample": 0.0}
        self.steps = 0
        ahead, inputs = engine.async_step, engine.sample_inputs
        collect, masks, step, sample = ahead.collect, inputs.masks, engine.step, le.sample_ids

        def timed(name, fn):
            def run(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.t[name] += time.perf_counter() - t0

            return run

        def collect_timed(inflight):
            t0 = time.perf_counter()
            if inflight.event is not None:
                inflight.event.synchronize()
            t1 = time.perf_counter()
            out = collect(inflight)
            self.t["wait"] += t1 - t0
            self.t["collect"] += time.perf_counter() - t1
            return out

        def step_timed():
            self.steps += 1
            return timed("step", step)()

        ahead.collect = collect_timed
        inputs.masks = timed("masks", masks)
        engine.step = step_timed
        le.sample_ids = timed("sample", sample)

    def per_step_ms(self) -> dict[str, float]:
        return {k: v / max(1, self.steps) * 1e3 for k, v in self.t.items()}

    def reset(self) -> None:
        self.t = dict.fromkeys(self.t, 0.0)
        self.steps = 0


def grammar_strategies(grammars, so, outputs: list[list[int]], threads: int) -> dict[str, float]:
    """The host's grammar work per step, replayed along the constrained outputs of one batch
    (each step: every live sequence accepts its token, then its next mask is filled), timed
    per strategy: serial calls, xgrammar's batch matcher, or a thread pool of `threads`
    (which helps only where xgrammar releases the GIL). Median ms per step. The batch matcher
    runs with its default thread count and with `threads`."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(threads)
    xgr = grammars._xgr
    batch = {"batch_matcher": xgr.BatchGrammarMatcher(),  # "auto": half the hardware threads
             "batch_matcher_n": xgr.BatchGrammarMatcher(max_threads=threads)}  # fmt: skip
    steps = max(len(o) for o in outputs)
    times: dict[str, list[float]] = {}

    def chunks(items: list, n: int) -> list[list]:
        k = (len(items) + n - 1) // n
        return [items[i : i + k] for i in range(0, len(items), k)]

    for strategy in ("serial", "batch_matcher", "batch_matcher_n", "thread_pool"):
        ms = [grammars.matcher(so) for _ in outputs]
        mask = xgr.allocate_token_bitmask(len(ms), grammars.vocab_size)
        acc, fill = [], []
        for j in range(steps - 1):
            live = [(i, m, outputs[i][j]) for i, m in enumerate(ms) if j < len(outputs[i]) - 1]
            t0 = time.perf_counter()
            if strategy == "thread_pool" and len(live) > 1:
                list(pool.map(lambda part: [m.accept_token(t) for _, m, t in part],
                              chunks(live, threads)))  # fmt: skip
            else:
                for _, m, t in live:
                    m.accept_token(t)
            t1 = time.perf_counter()
            if strategy in batch and len(live) > 1:
                batch[strategy].batch_fill_next_token_bitmask(
                    [m for _, m, _ in live], mask, [i for i, _, _ in live]
                )
            elif strategy == "thread_pool" and len(live) > 1:
                list(pool.map(lambda part, mask=mask: [m.fill_next_token_bitmask(mask, i) for i, m, _ in part],
                              chunks(live, threads)))  # fmt: skip
            else:
                for i, m, _ in live:
                    m.fill_next_token_bitmask(mask, i)
            t2 = time.perf_counter()
            acc.append(t1 - t0)
            fill.append(t2 - t1)
        times[f"{strategy}_accept"] = acc
        times[f"{strategy}_fill"] = fill
    pool.shutdown()
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _tokenizer(path: str | None):
    from tandem.model.info import load_model_info
    from tandem.model.tokenizer import Tokenizer

    if path:
        return Tokenizer.from_dir(path)
    return load_model_info()[1]


def _run(engine, prompts: list[list[int]], params: list) -> dict[str, Any]:
    """Every prompt with its own params through `LLMEngine.step`; decode time and the outputs."""
    lr.sync()
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    steps = 0
    t_first = None
    while engine.has_unfinished():
        engine.step()
        if t_first is None:
            if all(s.output_token_ids for s in seqs):
                lr.sync()
                t_first = time.perf_counter()
        else:
            steps += 1
    lr.sync()
    t1 = time.perf_counter()
    assert t_first is not None
    return {
        "decode_s": t1 - t_first,
        "steps": steps,
        "tokens": [list(s.output_token_ids) for s in seqs],
        "finish": [s.finish_reason for s in seqs],
    }


def _check(tok, outs: dict[str, Any], xgr_check) -> int:
    """Finished constrained outputs validate against SCHEMA; returns how many finished."""
    import jsonschema

    done = 0
    for ids, reason in zip(outs["tokens"], outs["finish"], strict=True):
        text = tok.decode(ids, skip_special_tokens=True)
        if reason == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)
            done += 1
        else:
            xgr_check(ids)
    return done


SPEC_QUESTIONS = [
    "Order ABC-1234 was shipped to Maria Lopez, 34, a pro customer: two mugs (sku mug01) and "
    "one gift card (sku gc50, a gift).",
    "Create an order record for John Smith, age 52, enterprise tier; status pending; items: 3 "
    "of sku a1b2, 1 of sku zz9 as a gift.",
    "Write the JSON for a cancelled order XYZ-0042 from Ann Lee (27, free tier) with 5 pens "
    "(sku pen5) and 2 notebooks (sku nb2).",
    "Give me a sample delivered order with three items.",
]


def spec_rows(new_tokens: int, repeats: int) -> dict[str, Any]:
    """The default model (real weights, this machine's device) answering SPEC_QUESTIONS under
    SCHEMA, greedy, without drafts and with n-gram drafts: target steps, tokens per step and
    wall time (median of `repeats`); the two must give the same tokens."""
    import tandem
    from tandem.api.sampling_params import SamplingParams, StructuredOutput

    so = StructuredOutput("json_schema", json.dumps(SCHEMA))
    sp = SamplingParams(max_tokens=new_tokens, temperature=0, structured=so)
    out: dict[str, Any] = {}
    tokens_of = {}
    for name, opts in (("plain", {}), ("ngram drafts", {"speculative": "ngram"})):
        llm = tandem.LLM(enable_prefix_cache=False, **opts)
        tok = llm.engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": q + " Answer in JSON."}])
                   for q in SPEC_QUESTIONS]  # fmt: skip
        steps = [0]
        step = llm.engine.step

        def counted(step=step, steps=steps):
            steps[0] += 1
            return step()

        llm.engine.step = counted
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0))  # warm-up
        times, n_steps = [], []
        for _ in range(repeats):
            steps[0] = 0
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp)
            times.append(time.perf_counter() - t0)
            n_steps.append(steps[0])
        tokens_of[name] = [o.token_ids for o in outs]
        n = sum(len(t) for t in tokens_of[name])
        out[name] = {"tokens": n, "engine_steps": statistics.median(n_steps),
                     "tokens_per_step": n / statistics.median(n_steps),
                     "seconds": times, "tokens_per_s": n / statistics.median(times)}  # fmt: skip
        print(f"{name:<13} {n} tokens, {out[name]['engine_steps']} engine steps "
              f"({out[name]['tokens_per_step']:.2f} tokens a step), "
              f"{out[name]['tokens_per_s']:.1f} tokens/s", flush=True)  # fmt: skip
    out["same_tokens"] = tokens_of["plain"] == tokens_of["ngram drafts"]
    out["speedup"] = out["ngram drafts"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    print(f"same tokens: {out['same_tokens']}; speedup {out['speedup']:.2f}x")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokenizer", default=None, help="a local HF tokenizer directory")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--out", default=None)
    ap.add_argument("--spec", action="store_true",
                    help="n-gram drafts under a grammar on the default model instead")  # fmt: skip
    args = ap.parse_args()
    if args.spec:
        res = {"benchmark": "structured --spec", **lr.run_info(sys.argv), "schema": SCHEMA,
               "questions": SPEC_QUESTIONS, "new_tokens": args.new_tokens,
               "repeats": args.repeats}  # fmt: skip
        res["results"] = spec_rows(args.new_tokens, args.repeats)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=2)
                f.write("\n")
            print(f"wrote {args.out}")
        return 0
    from tandem.api.sampling_params import SamplingParams, StructuredOutput

    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    shape = dict(lr.SMOKE if not cuda else lr.LLAMA3_8B)
    tok = _tokenizer(args.tokenizer)
    if not cuda:
        shape["vocab_size"] = max(shape["vocab_size"], len(tok.hf))  # a grammar needs its tokens
        args.new_tokens = min(args.new_tokens, 48)
        args.repeats = min(args.repeats, 2)
    batches = [int(b) for b in args.batches.split(",")]
    hf = lr.build_hf_model(shape, dev, torch.bfloat16 if cuda else torch.float32)
    engine = lr.tandem_engine(
        hf, tokenizer=tok, device=dev, dtype="bfloat16" if cuda else "float32", cuda_graphs=True,
        async_scheduling=True, max_model_len=1024, kv_cache_memory_gb=8.0 if cuda else 0.25,
        max_num_seqs=max(8, max(batches)), enable_prefix_cache=False,
    )  # fmt: skip
    hf = None
    so = StructuredOutput("json_schema", json.dumps(SCHEMA))
    res: dict[str, Any] = {"benchmark": "structured", **lr.run_info(sys.argv), "smoke": not cuda}
    if cuda:
        res["hardware"] = {"gpu": torch.cuda.get_device_name(), "cpu_count": os.cpu_count()}
    res["settings"] = {"batches": batches, "new_tokens": args.new_tokens,
                       "prompt_len": args.prompt_len, "repeats": args.repeats,
                       "shape": "llama3-8b" if cuda else "smoke", "schema": SCHEMA,
                       "tokenizer": args.tokenizer or "embedded SmolLM2-135M-Instruct",
                       "engine": "cuda_graphs, async_scheduling, bf16" if cuda else "cpu"}  # fmt: skip

    def xgr_check(ids: list[int]) -> None:
        m = engine.sample_inputs.grammars.matcher(so)
        for t in ids:
            if not m.accept_token(int(t)):
                raise AssertionError(f"token {t} is outside the grammar")

    host = HostTimes(engine)
    rows = []
    last_tokens: dict[int, list[list[int]]] = {}  # batch -> greedy constrained outputs
    for b in batches:
        prompts = lr.random_prompts(b, args.prompt_len, shape["vocab_size"], seed=b)
        for mode, temp in (("greedy", 0.0), ("sampled", 0.7)):

            def constrained(temp=temp, b=b, prompts=prompts):
                sp = [SamplingParams(max_tokens=args.new_tokens, temperature=temp, seed=i,
                                     structured=so) for i in range(b)]  # fmt: skip
                return _run(engine, prompts, sp)

            first = constrained()  # warm-up; also fixes each sequence's length
            lengths = [len(t) for t in first["tokens"]]

            def plain(temp=temp, lengths=lengths, prompts=prompts):
                sp = [SamplingParams(max_tokens=n, temperature=temp, seed=i, ignore_eos=True)
                      for i, n in enumerate(lengths)]  # fmt: skip
                return _run(engine, prompts, sp)

            plain()  # warm-up
            c_s, p_s, steps, finished = [], [], [], 0
            host_c, host_p = [], []
            for _ in range(args.repeats):
                host.reset()
                c = constrained()
                host_c.append(host.per_step_ms())
                if [len(t) for t in c["tokens"]] != lengths:
                    raise AssertionError("a seeded constrained run changed its lengths")
                finished = _check(tok, c, xgr_check)
                if mode == "greedy":
                    last_tokens[b] = c["tokens"]
                host.reset()
                p = plain()
                host_p.append(host.per_step_ms())
                c_s.append(c["decode_s"])
                p_s.append(p["decode_s"])
                steps.append(c["steps"])
            cm, pm = statistics.median(c_s), statistics.median(p_s)
            n_steps = statistics.median(steps)
            row = {"batch": b, "mode": mode, "tokens_per_seq": lengths,
                   "finished_valid_json": finished, "decode_steps": n_steps,
                   "constrained_decode_s": c_s, "plain_decode_s": p_s,
                   "constrained_tpot_ms": cm / n_steps * 1e3, "plain_tpot_ms": pm / n_steps * 1e3,
                   "cost": cm / pm - 1,
                   "host_ms_per_step_constrained": {k: statistics.median(h[k] for h in host_c)
                                                    for k in host_c[0]},
                   "host_ms_per_step_plain": {k: statistics.median(h[k] for h in host_p)
                                              for k in host_p[0]}}  # fmt: skip
            rows.append(row)
            print(f"batch {b:>3} {mode:<8} TPOT constrained {row['constrained_tpot_ms']:.3f} ms, "
                  f"plain {row['plain_tpot_ms']:.3f} ms: cost {row['cost'] * 100:+.1f}%", flush=True)  # fmt: skip
    res["rows"] = rows
    threads = max(1, (os.cpu_count() or 2) // 2)
    res["grammar_host_ms_per_step"] = {}
    print(f"\ngrammar work per step on the host, replayed along the outputs ({threads} threads)")
    for r in rows:
        if r["mode"] != "greedy":
            continue
        g = grammar_strategies(engine.sample_inputs.grammars, so, last_tokens[r["batch"]], threads)
        res["grammar_host_ms_per_step"][str(r["batch"])] = g
        print(f"batch {r['batch']:>3}: " + "  ".join(f"{k} {v:.3f}" for k, v in g.items()))
    print(f"\n{'batch':>5} {'mode':<8} {'tokens/seq':>11} {'valid JSON':>10} "
          f"{'TPOT constr ms':>15} {'TPOT plain ms':>14} {'cost':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['batch']:>5} {r['mode']:<8} {statistics.mean(r['tokens_per_seq']):>11.1f} "
              f"{r['finished_valid_json']:>10} {r['constrained_tpot_ms']:>15.3f} "
              f"{r['plain_tpot_ms']:>14.3f} {r['cost'] * 100:>+6.1f}%")  # fmt: skip
    print(
        "\nhost ms per step (median of repeats): step = engine.step() overall, wait = for the "
        "step in flight, collect = reading its tokens (grammars advanced), masks, sample"
    )
    for r in rows:
        for what in ("constrained", "plain"):
            h = r[f"host_ms_per_step_{what}"]
            print(f"{r['batch']:>5} {r['mode']:<8} {what:<12} "
                  + "  ".join(f"{k} {v:.3f}" for k, v in h.items()))  # fmt: skip
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
