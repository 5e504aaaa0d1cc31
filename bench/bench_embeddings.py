"""Embeddings throughput (the pooling runner) against the same model's prefill throughput (the
generate runner, one output token), side by side in one run.

Model: random weights at Qwen3-0.6B's shape (Qwen/Qwen3-0.6B config.json: 28 layers, hidden 1024, MLP
3072, 16 heads / 8 KV heads of 128, vocab 151936, tied embeddings), written once under
~/.cache/appliance/bench-models/ as a Qwen3ForCausalLM: the form Qwen3-Embedding-0.6B ships in, which
``--runner pooling`` loads as Qwen3Model (lm_head not loaded), pooled LAST + normalized (its default).

Workload: N prompts of L random token ids, all submitted at once, float32, prefix caching off (every
rep computes every token). Embeddings: ``LLM(runner="pooling").embed``; prefill: ``LLM.generate`` with
max_tokens=1 (prefill, the logits of the last position, one sampled token). Sequences/s and prompt
tokens/s for each, best of ``--reps`` reps (interleaved, so a busy neighbour hits both alike), and the
engine's forward share of the step time. The ratio is embeddings / prefill. The script re-executes
itself once in the engine process environment of ``appliance serve`` (mimalloc, OpenMP placement).

    .venv/bin/python bench/bench_embeddings.py --json bench/results/embeddings.json
    .venv/bin/python bench/bench_embeddings.py --smoke     # seconds: tiny widths, 2 layers, short prompts
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench_engine import _reexec_as_worker, machine  # noqa: E402  (bench/ is the script's directory)

QWEN3_0_6B = {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "bos_token_id": 151643,
              "eos_token_id": 151645}
SMOKE = {"vocab_size": 32768, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "bos_token_id": 1, "eos_token_id": 2}
MODELS_VERSION = 1


def lscpu_flags() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "lscpu unavailable"
    return next((line.strip() for line in out.splitlines() if line.startswith("Flags:")), "Flags: (none listed)")


def model_dir(smoke: bool) -> Path:
    from appliance.bench.random_models import cached_random_model

    cfg = dict(QWEN3_0_6B, **(SMOKE if smoke else {}))
    name = f"qwen3-0.6b-shape{'-smoke' if smoke else ''}-L{cfg['num_hidden_layers']}-v{MODELS_VERSION}"
    return cached_random_model(name, "Qwen3", cfg, seed=0)


def reset(eng) -> None:
    for k in eng.stats:
        eng.stats[k] = 0.0 if k.endswith("_s") else 0


def timed(llm, run) -> dict:
    eng = llm.engine
    reset(eng)
    t = time.perf_counter()
    n_seqs = len(run())
    wall = time.perf_counter() - t
    s = eng.stats
    return {"wall_s": wall, "seqs": n_seqs, "prompt_tokens": s["prompt_tokens"], "seqs_per_s": n_seqs / wall,
            "prompt_tok_per_s": s["prompt_tokens"] / wall, "steps": s["steps"],
            "forward_fraction": s["forward_s"] / s["step_s"] if s["step_s"] else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--smoke", action="store_true", help="tiny widths, 2 layers: checks the script, not a result")
    ap.add_argument("--json", default=None, help="write the result here, and the table next to it as .txt")
    ap.add_argument("--allocator", default="mimalloc", help="mimalloc (as appliance serve) | glibc-tuned | system")
    args = ap.parse_args()
    command = "python " + " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    _reexec_as_worker(args.allocator)
    from appliance import LLM, SamplingParams
    from appliance.bench.common import random_token_prompts
    from appliance.runtime.allocator import allocator_in_use

    if args.smoke:
        args.num_prompts, args.input_len = min(args.num_prompts, 8), min(args.input_len, 32)
    path = model_dir(args.smoke)
    common = dict(dtype="float32", enable_prefix_caching=False, max_num_seqs=args.num_prompts,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.input_len + 16)
    t = time.perf_counter()
    gen = LLM(str(path), runner="generate", **common)
    pool = LLM(str(path), runner="pooling", **common)
    load_s = time.perf_counter() - t
    cfg = pool.engine.runner.model.config
    prompts = random_token_prompts(args.num_prompts, args.input_len, min(cfg.vocab_size, 30000), 0)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    gen.generate(prompt_token_ids=prompts[:2], sampling_params=sp)  # warm-up: first shapes, allocator
    pool.embed(prompts[:2])
    reps = {"prefill": [], "embeddings": []}
    for _ in range(args.reps):
        reps["prefill"].append(timed(gen, lambda: gen.generate(prompt_token_ids=prompts, sampling_params=sp)))
        reps["embeddings"].append(timed(pool, lambda: pool.embed(prompts)))
    best = {k: max(v, key=lambda r: r["seqs_per_s"]) for k, v in reps.items()}
    result = {
        "benchmark": "embeddings", "command": command, "lscpu_flags": lscpu_flags(), "machine": machine(),
        "allocator": allocator_in_use(), "model": str(path), "smoke": args.smoke,
        "model_shape": {k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                     "num_attention_heads", "num_key_value_heads", "head_dim",
                                                     "vocab_size")},
        "kernels": pool.engine.runner.ops.__name__.rsplit(".", 1)[-1],
        "pooler": {"pooling_type": pool.engine.pooler_config.pooling_type,
                   "normalize": pool.engine.pooler_config.normalize},
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len, "dtype": "float32",
                     "prefix_caching": False, "max_num_batched_tokens": args.max_num_batched_tokens,
                     "reps": args.reps},
        "load_s": load_s, "reps": reps, "best": best,
        "ratio_embeddings_vs_prefill": best["embeddings"]["seqs_per_s"] / best["prefill"]["seqs_per_s"],
    }
    lines = [f"embeddings vs prefill: {args.num_prompts} prompts x {args.input_len} tokens, float32, "
             f"Qwen3-0.6B shape{' (SMOKE: tiny widths)' if args.smoke else ''} "
             f"(L{cfg.num_hidden_layers}, hidden {cfg.hidden_size}), kernels {result['kernels']}, best of {args.reps}",
             "",
             f"{'runner':<34}{'wall s':>9}{'seqs/s':>10}{'prompt tok/s':>15}{'steps':>7}{'forward':>9}",
             "-" * 84]
    names = {"prefill": "generate, max_tokens=1 (prefill)", "embeddings": "pooling (LAST, normalize)"}
    for k in ("prefill", "embeddings"):
        r = best[k]
        lines.append(f"{names[k]:<34}{r['wall_s']:>9.2f}{r['seqs_per_s']:>10.2f}{r['prompt_tok_per_s']:>15.1f}"
                     f"{r['steps']:>7}{r['forward_fraction']:>9.1%}")
    lines += [f"{'ratio embeddings / prefill':<34}{'':>9}{result['ratio_embeddings_vs_prefill']:>9.2f}x", "",
              f"machine: {result['machine']} | allocator: {result['allocator'].get('name')}",
              f"lscpu {result['lscpu_flags']}", f"command: {command}"]
    text = "\n".join(lines)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        Path(args.json).with_suffix(".txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
