"""Tensor parallel: the one-call native decoder stack (each rank one ``llama_layers`` call per step,
the all-reduce called from C++) against the per-op path (``APPLIANCE_FUSED_LAYERS=0``, every rank),
with TP=1 (fused, all threads) for reference: decode step time (TPOT) and TTFT at batch 1 and 16,
through ``appliance bench latency`` (one child process per setting, so each starts clean).

    .venv/bin/python bench/bench_tp_fused.py --json bench/results/tp_fused.json    # quiet host, minutes
    .venv/bin/python bench/bench_tp_fused.py --smoke                             # 2-layer model: checks it runs

The default model is the one of bench/results/tp_latency.txt (random-weight Qwen2.5-0.5B shape, 24
layers); ``--tp-backend ray`` runs the TP=2 ranks as Ray actors instead of spawned processes.
Not a timed test.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = Path.home() / ".cache" / "appliance" / "bench-models"
FULL = MODELS / "qwen2.5-0.5b-shape-L24-seed0-v1" / "F16.gguf"
SMOKE = MODELS / "qwen2.5-0.5b-shape-L2-seed0-v1" / "F16.gguf"
# (label, tensor_parallel_size, fused)
SETTINGS = (("TP=1 fused", 1, True), ("TP=2 fused", 2, True), ("TP=2 per-op", 2, False))


def run_one(args, tp: int, fused: bool, batch: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "lat.json"
        cmd = [sys.executable, "-m", "appliance.cli", "bench", "latency", "--model", str(args.model),
               "--dtype", "float32", "--batch-size", str(batch), "--input-len", str(args.input_len),
               "--output-len", str(args.output_len), "--repeats", str(args.repeats),
               "--tensor-parallel-size", str(tp), "--json", str(out)]
        if tp > 1 and args.tp_backend != "mp":
            cmd += ["--engine-arg", f"distributed_executor_backend={args.tp_backend}"]
        env = {**os.environ, "PYTHONPATH": str(REPO), "APPLIANCE_FUSED_LAYERS": "1" if fused else "0",
               "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
        r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return json.loads(out.read_text())["results"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=FULL)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tp-backend", choices=("mp", "ray"), default="mp")
    p.add_argument("--smoke", action="store_true", help="2-layer model, batch 1, short: checks that it runs")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.smoke:
        args.model, args.batch_sizes, args.input_len, args.output_len, args.repeats = SMOKE, "1", 16, 8, 1
    if not args.model.exists():
        raise SystemExit(f"--model {args.model} does not exist (the bench models are made by "
                         f"appliance.bench.random_models; see bench/results/tp_latency.txt)")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for b in batches:
        for label, tp, fused in SETTINGS:
            res = run_one(args, tp, fused, b)
            rows.append({"setting": label, "tp": tp, "fused": fused, "batch": b,
                         "tpot_ms": res["tpot_s"]["p50"] * 1e3, "ttft_ms": res["ttft_s"]["p50"] * 1e3})
            print(f"batch {b:>3}  {label:<12} decode step {rows[-1]['tpot_ms']:8.2f} ms  TTFT {rows[-1]['ttft_ms']:9.1f} ms",
                  flush=True)
    lines = [f"machine: {platform.machine()}, {os.cpu_count()} CPUs; model {args.model}; float32; "
             f"input {args.input_len}, output {args.output_len}, {args.repeats} repeats; TP ranks: {args.tp_backend}",
             f"{'batch':>5}  {'setting':<12} {'decode step (p50)':>18} {'TTFT (p50)':>12} {'vs TP=2 per-op':>15}"]
    for b in batches:
        ref = next(r for r in rows if r["batch"] == b and r["setting"] == "TP=2 per-op")
        for r in (r for r in rows if r["batch"] == b):
            lines.append(f"{b:>5}  {r['setting']:<12} {r['tpot_ms']:>15.2f} ms {r['ttft_ms']:>9.1f} ms "
                         f"{r['tpot_ms'] / ref['tpot_ms']:>14.2f}x")
    print("\n".join(lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"benchmark": "tp_fused", "model": str(args.model), "rows": rows,
                                         "tp_backend": args.tp_backend}, indent=2) + "\n")
        args.json.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
