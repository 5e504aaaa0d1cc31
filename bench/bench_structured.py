"""Structured outputs: what a JSON schema costs per output token in the engine, and the grammar
engines side by side (llguidance, which appliance uses, and xgrammar when it imports).

Part 1, the engine (the default model, float32): C requests at once (C = 1 and 16), each with
--output-len tokens, free (ignore_eos) and constrained by a JSON schema whose array needs more items
than fit (so every sequence runs the full --output-len, like the free run). Time per output token,
the constrained run's overhead, and the mask time that the forward pass did not hide (the join).

Part 2, the grammar engines on the default model's tokenizer, one thread, fresh compile each time:
compile time of a set of JSON schemas, and the per-token mask time while replaying a valid document
token by token. Run it with nothing else on the machine (it is noisy):

    .venv/bin/python bench/bench_structured.py --json bench/results/structured.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import _reexec_as_worker, machine  # noqa: E402

from appliance import LLM, SamplingParams  # noqa: E402
from appliance.sampling_params import StructuredOutputsParams  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,8}\\.com$"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "email", "tags"], "additionalProperties": False}
# Longer than any run: the grammar never completes, so each sequence produces exactly --output-len.
LONG = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 1000}},
        "required": ["people"], "additionalProperties": False}
SCHEMAS = {
    "person": PERSON,
    "people_list": LONG,
    "nested_any_of": {"type": "object", "properties": {
        "id": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]},
        "point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                  "required": ["x", "y"]},
        "kind": {"enum": ["a", "b", "c", "d"]}}, "required": ["id", "point", "kind"]},
}
DOC = {"name": "Alice Smith", "age": 34, "email": "alice@example.com", "tags": ["a", "c"]}


def engine_run(llm: LLM, conc: int, out_len: int, schema: dict | None) -> dict:
    eng = llm.engine
    prompts = [f"Here is a list of people, as JSON (batch {i}):" for i in range(conc)]
    so = StructuredOutputsParams(json=schema) if schema is not None else None
    sp = SamplingParams(temperature=1.0, max_tokens=out_len, ignore_eos=schema is None, seed=0,
                        structured_outputs=so)
    llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=4, structured_outputs=so))  # warm, compile
    eng.kv.pool.reset_prefix_cache()
    for k in eng.stats:
        eng.stats[k] = 0.0 if k.endswith("_s") else 0
    st0 = dict(eng.structured.stats)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    s = eng.stats
    return {"concurrency": conc, "output_tokens": n, "wall_s": wall, "ms_per_output_token": 1e3 * wall / n,
            "step_ms": 1e3 * s["step_s"] / s["steps"], "forward_ms": 1e3 * s["forward_s"] / s["steps"],
            "sample_ms": 1e3 * s["sample_s"] / s["steps"],
            "mask_ms_total_per_step": 1e3 * (eng.structured.stats["mask_s"] - st0["mask_s"]) / s["steps"],
            "finish": sorted({o.outputs[0].finish_reason for o in outs})}


def doc_tokens(tok) -> list[int]:
    return tok.encode(json.dumps(DOC, separators=(", ", ": ")), add_special_tokens=False)


def bench_llguidance(tok, vocab: int, eos: list[int], reps: int) -> dict:
    import llguidance
    import llguidance.hf
    import numpy as np

    from appliance.structured.grammar import JSON_OPTIONS

    t = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
    tok_s = time.perf_counter() - t
    compile_ms = {}
    for name, schema in SCHEMAS.items():
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
            times.append(time.perf_counter() - t)
            assert not m.is_error(), m.get_error()
        compile_ms[name] = 1e3 * statistics.median(times)
    ids = doc_tokens(tok)
    bits = np.zeros((1, (lt.vocab_size + 31) // 32), dtype=np.int32)
    per = []
    for _ in range(reps):
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(PERSON, defaults=JSON_OPTIONS))
        for tid in ids:
            t = time.perf_counter()
            m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            per.append(time.perf_counter() - t)
            assert m.consume_token(tid), m.get_error()
    from importlib.metadata import version

    return {"version": version("llguidance"), "tokenizer_s": tok_s, "compile_ms": compile_ms,
            "mask_us_median": 1e6 * statistics.median(per), "mask_us_mean": 1e6 * statistics.mean(per),
            "mask_us_max": 1e6 * max(per), "tokens": len(ids)}


def bench_xgrammar(tok, vocab: int, reps: int) -> dict:
    try:
        import xgrammar as xgr
    except Exception as e:  # noqa: BLE001 - any import failure means: not installed here
        return {"status": f"not installed ({type(e).__name__}: {e})"}
    from importlib.metadata import version

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    tok_s = time.perf_counter() - t
    compile_ms = {}
    for name, schema in SCHEMAS.items():
        times = []
        for _ in range(reps):
            comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            t = time.perf_counter()
            comp.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
            times.append(time.perf_counter() - t)
        compile_ms[name] = 1e3 * statistics.median(times)
    ids = doc_tokens(tok)
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    cg = comp.compile_json_schema(json.dumps(PERSON), any_whitespace=False, separators=(", ", ": "))
    bits = xgr.allocate_token_bitmask(1, info.vocab_size)
    per = []
    for _ in range(reps):
        m = xgr.GrammarMatcher(cg)
        for tid in ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(bits)
            per.append(time.perf_counter() - t)
            assert m.accept_token(tid)
    return {"version": version("xgrammar"), "tokenizer_s": tok_s, "compile_ms": compile_ms,
            "mask_us_median": 1e6 * statistics.median(per), "mask_us_mean": 1e6 * statistics.mean(per),
            "mask_us_max": 1e6 * max(per), "tokens": len(ids)}


def lscpu_flags() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    return next((line for line in out.splitlines() if line.startswith("Flags:")), "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--allocator", default="mimalloc", help="mimalloc (as appliance serve) | glibc-tuned | system")
    args = ap.parse_args()
    _reexec_as_worker(args.allocator)

    llm = LLM(args.model, dtype="float32", max_model_len=1024, max_num_seqs=max(args.concurrency), seed=0)
    eng = llm.engine
    rows = []
    for c in args.concurrency:
        free = engine_run(llm, c, args.output_len, None)
        con = engine_run(llm, c, args.output_len, LONG)
        rows.append({"concurrency": c, "free": free, "json_schema": con,
                     "overhead": con["ms_per_output_token"] / free["ms_per_output_token"] - 1})
    tok = eng.tokenizer
    engines = {"llguidance": bench_llguidance(tok, eng.vocab_size, list(eng.eos_token_ids), args.reps),
               "xgrammar": bench_xgrammar(tok, eng.vocab_size, args.reps)}
    result = {"benchmark": "structured_outputs", "machine": machine(), "lscpu_flags": lscpu_flags(),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "model": str(eng.model_path),
              "load_average": os.getloadavg(),
              "workload": {"output_len": args.output_len, "dtype": "float32", "temperature": 1.0,
                           "schema": "people_list (never completes: every sequence runs output_len)"},
              "engine": rows, "grammar_engines": engines}
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"engine: ms per output token, free vs JSON schema ({args.output_len} tokens each, fp32)")
    for col in ("concurrency", "free ms/tok", "schema ms/tok", "overhead", "mask ms/step (overlapped)",
                "sample ms/step free / schema"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["concurrency"]), f"{r['free']['ms_per_output_token']:.2f}",
                  f"{r['json_schema']['ms_per_output_token']:.2f}", f"{r['overhead']:+.1%}",
                  f"{r['json_schema']['mask_ms_total_per_step']:.3f}",
                  f"{r['free']['sample_ms']:.2f} / {r['json_schema']['sample_ms']:.2f}")
    Console().print(t)
    g = Table(title="grammar engines (default model's tokenizer, one thread, fresh compiles)")
    for col in ("engine", "tokenizer s", *[f"compile ms: {k}" for k in SCHEMAS], "mask us median / mean / max"):
        g.add_column(col, justify="right")
    for name, r in engines.items():
        if "status" in r:
            g.add_row(name, r["status"], *[""] * (len(SCHEMAS) + 1))
            continue
        g.add_row(f"{name} {r['version']}", f"{r['tokenizer_s']:.2f}",
                  *[f"{r['compile_ms'][k]:.2f}" for k in SCHEMAS],
                  f"{r['mask_us_median']:.0f} / {r['mask_us_mean']:.0f} / {r['mask_us_max']:.0f}")
    Console().print(g)
    Console().print(f"{result['command']} | load average {result['load_average']} | {result['machine']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
