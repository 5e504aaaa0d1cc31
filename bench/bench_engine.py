"""Offline engine throughput against transformers ``generate`` and against this machine's compute
roofline, with the engine's step time split into model forward vs everything else.

Workload (issue 2): N requests of random-token prompts (default 64 x 128 tokens), 128 output tokens
each, ignore_eos, the default model, float32. transformers runs the same prompts in static batches
of 16 with the same dtype. The script re-executes itself once in the engine process environment of
`appliance serve` (mimalloc preloaded, OpenMP threads placed; --allocator to change). Run it with
nothing else on the machine:

    .venv/bin/python bench/bench_engine.py --json bench/results/engine_offline.json
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from appliance import LLM, SamplingParams
from appliance.bench.common import random_token_prompts
from appliance.bench.kernels import peak_gemm_gflops


def machine() -> dict:
    from appliance.runtime.cpu_features import detect

    f = detect()
    isa = [x for x in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "sve", "bf16", "i8mm")
           if f.has(x)]
    return {"cpu": f.model_name, "arch": f.arch, "threads": torch.get_num_threads(), "isa": isa,
            "torch": torch.__version__, "python": platform.python_version()}


def gemm_rate(n: int = 2048, reps: int = 5) -> float:
    """Peak fp32 GEMM FLOP/s on this machine with torch's threads (best of reps)."""
    return peak_gemm_gflops(torch.float32, n, reps) * 1e9


def workload_flops(cfg, n_req: int, p_len: int, o_len: int) -> float:
    """FLOPs the workload needs: every layer GEMM for each computed token (prompt + outputs but
    the last), attention QK^T and PV over each token's causal context, lm_head for each sampled
    token only."""
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    per_tok_linear = 2 * L * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * i)
    tokens = p_len + o_len - 1
    attn = sum(2 * 2 * L * hq * d * (pos + 1) for pos in range(tokens))
    lm_head = 2 * h * cfg.vocab_size * o_len
    return n_req * (tokens * per_tok_linear + attn + lm_head)


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    return random_token_prompts(n, length, vocab, seed)


PARTS = ("schedule_s", "prepare_s", "forward_s", "sample_s", "output_s")


def run_appliance(llm: LLM, prompts, out_len: int) -> dict:
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    eng.kv.pool.reset_prefix_cache()
    for k in eng.stats:
        eng.stats[k] = 0.0 if k.endswith("_s") else 0
    t = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    wall = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    s = eng.stats
    return {"wall_s": wall, "output_tokens": n_out, "output_tok_s": n_out / wall, "steps": s["steps"],
            "step_s": s["step_s"], **{k: s[k] for k in PARTS},
            "non_forward_fraction": 1 - s["forward_s"] / s["step_s"],
            "outside_step_s": wall - s["step_s"]}


def run_decode_split(llm: LLM, prompts, out_len: int, batch: int) -> dict:
    """Per-step split at a steady decode batch of ``batch`` requests (prefill steps excluded):
    model forward vs scheduling, input preparation, sampling and output processing (detokenization,
    stop checks)."""
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(prompts[:batch]):
        eng.add_request(f"split-{i}", p, sp)
    acc = dict.fromkeys(PARTS + ("step_s",), 0.0)
    n = 0
    while eng.has_unfinished_requests():
        before = {k: eng.stats[k] for k in acc}
        is_decode = eng.scheduler.num_running == batch and not eng.scheduler.waiting
        eng.step()
        if is_decode:
            for k in acc:
                acc[k] += eng.stats[k] - before[k]
            n += 1
    tot = acc["step_s"]
    return {"batch": batch, "decode_steps": n, "step_ms": 1e3 * tot / max(n, 1),
            **{k.replace("_s", "_ms"): 1e3 * acc[k] / max(n, 1) for k in PARTS},
            "forward_ms": 1e3 * acc["forward_s"] / max(n, 1),
            "non_forward_fraction": 1 - acc["forward_s"] / tot if tot else None}


def run_transformers(path, prompts, out_len: int, batch: int, dtype) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    model.generate(torch.tensor(prompts[:1]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    n_out = 0
    t = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[s:s + batch])  # equal lengths: no padding needed
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                               min_new_tokens=out_len, do_sample=False, pad_token_id=0)
            n_out += (g.shape[1] - ids.shape[1]) * ids.shape[0]
    wall = time.perf_counter() - t
    return {"wall_s": wall, "output_tokens": n_out, "output_tok_s": n_out / wall, "batch": batch}


def _reexec_as_worker(allocator: str) -> None:
    """Run the rest of the benchmark in the process environment `appliance serve` gives its engine
    (mimalloc preloaded, OpenMP threads placed), as `appliance bench` does: re-execute once."""
    import os
    import sys

    if os.environ.get("APPLIANCE_BENCH_WORKER") == "1":
        return
    from appliance.runtime import threads
    from appliance.runtime.worker import worker_env

    env = dict(os.environ)
    env.update(worker_env(allocator, placement=threads.resolve("auto", None)))
    env["APPLIANCE_BENCH_WORKER"] = "1"
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--split-batch", type=int, default=32)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--allocator", default="mimalloc", help="mimalloc (as appliance serve) | glibc-tuned | system")
    args = ap.parse_args()
    _reexec_as_worker(args.allocator)
    from appliance.runtime.allocator import allocator_in_use

    llm = LLM(args.model, dtype="float32", attention_backend=args.attention_backend,
              max_num_seqs=max(args.num_prompts, args.split_batch), max_num_batched_tokens=2048)
    eng = llm.engine
    cfg = eng.runner.model.config
    prompts = random_prompts(args.num_prompts, args.input_len, cfg.vocab_size)
    peak = gemm_rate()
    flops = workload_flops(cfg, args.num_prompts, args.input_len, args.output_len)
    app = run_appliance(llm, prompts, args.output_len)
    split = run_decode_split(llm, random_prompts(args.split_batch, args.input_len, cfg.vocab_size, seed=1),
                             args.output_len, args.split_batch)
    hf = None if args.skip_transformers else run_transformers(
        eng.model_path, prompts, args.output_len, args.hf_batch, torch.float32)
    roofline_s = flops / peak
    result = {
        "benchmark": "engine_offline", "machine": machine(), "model": str(eng.model_path),
        "allocator": allocator_in_use(),
        "kernels": eng.runner.ops.__name__.rsplit(".", 1)[-1],
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                     "dtype": "float32", "ignore_eos": True},
        "gemm_peak_gflops": peak / 1e9, "workload_gflop": flops / 1e9, "roofline_s": roofline_s,
        "appliance": app, "transformers": hf,
        "ratio_vs_transformers": app["output_tok_s"] / hf["output_tok_s"] if hf else None,
        "fraction_of_roofline": roofline_s / app["wall_s"],
        "decode_split": split,
    }
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"offline engine: {args.num_prompts} x ({args.input_len} in, {args.output_len} out), fp32")
    for c in ("system", "wall s", "output tok/s", "ratio", "roofline"):
        t.add_column(c, justify="right")
    t.add_row("appliance", f"{app['wall_s']:.1f}", f"{app['output_tok_s']:.1f}",
              f"{result['ratio_vs_transformers']:.2f}x" if hf else "-", f"{result['fraction_of_roofline']:.0%}")
    if hf:
        t.add_row(f"transformers (batch {args.hf_batch})", f"{hf['wall_s']:.1f}", f"{hf['output_tok_s']:.1f}",
                  "1.00x", f"{roofline_s / hf['wall_s']:.0%}")
    t.add_row("compute roofline", f"{roofline_s:.1f}", f"{app['output_tokens'] / roofline_s:.1f}", "",
              f"{peak / 1e9:.0f} GFLOP/s")
    Console().print(t)
    st = Table(title=f"step time at a steady decode batch of {split['batch']} (ms per step)")
    for c in ("step", "forward", "schedule", "input prep", "sampling", "output/detok", "outside forward"):
        st.add_column(c, justify="right")
    st.add_row(f"{split['step_ms']:.2f}", f"{split['forward_ms']:.2f}", f"{split['schedule_ms']:.2f}",
               f"{split['prepare_ms']:.2f}", f"{split['sample_ms']:.2f}", f"{split['output_ms']:.2f}",
               f"{split['non_forward_fraction']:.1%}")
    Console().print(st)
    Console().print(f"whole run outside forward {app['non_forward_fraction']:.1%} | kernels: {result['kernels']}"
                    f" | linear: {dict(sorted(eng.runner.linear_groups.items()))} | {result['machine']}"
                    f" | allocator: {result['allocator'].get('name')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
