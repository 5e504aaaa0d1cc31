"""Data parallel against one engine: the same serving workload on `appliance serve` with
--data-parallel-size 1 (every core in one engine) and --data-parallel-size N (the cores split
evenly, one replica each share), optionally also N replicas as Ray actors. One server at a time,
so they never share the CPU. The lead runs the real numbers; --smoke checks the script in seconds.

    python bench/bench_dp.py [MODEL] [--dp 2] [--ray] [--concurrency 1,16] [--input-len 128 --output-len 128]
    python bench/bench_dp.py tests-tiny-model-dir --smoke

Prints output tok/s and median TTFT / ITL per row and concurrency, and the DP=N / DP=1 ratios;
writes a JSON record (--out, default bench/results/dp-<time>.json).
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from appliance.bench.common import parse_engine_args, parse_int_list, random_text_prompts
from appliance.bench.compare import run_system
from appliance.bench.servers import appliance_command

REPO = Path(__file__).resolve().parents[1]


def _p50(stat) -> float | None:
    return stat.get("p50") if isinstance(stat, dict) else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="model directory or GGUF (default: the embedded model)")
    ap.add_argument("--dp", type=int, default=2, help="replicas of the data-parallel row")
    ap.add_argument("--ray", action="store_true", help="also the same replicas as Ray actors")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--engine-arg", action="append", default=[], help="NAME=VALUE for every row (EngineConfig)")
    ap.add_argument("--smoke", action="store_true", help="tiny workload: concurrency 1,2, 8 in / 8 out")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    levels = [1, 2] if a.smoke else parse_int_list(a.concurrency)
    in_len, out_len = (8, 8) if a.smoke else (a.input_len, a.output_len)
    base = {"dtype": "float32", "linear_backend": "torch", **parse_engine_args(a.engine_arg)}
    tokenizer = None
    if a.model and Path(a.model).is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.model)
    prompts = random_text_prompts(a.num_prompts or max(8, 4 * max(levels)), in_len, 0, tokenizer)
    rows = [("dp1", {**base, "data_parallel_size": 1}), (f"dp{a.dp}", {**base, "data_parallel_size": a.dp})]
    if a.ray:
        rows.append((f"dp{a.dp}-ray", {**base, "data_parallel_size": a.dp, "distributed_executor_backend": "ray"}))
    systems = []
    for name, eng in rows:
        cmd = appliance_command(a.model, eng)
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        systems.append(run_system(name, cmd, prompts, levels, out_len, a.num_prompts, "completions",
                                  warmup=1 if a.smoke else 2, env={"RAY_USAGE_STATS_ENABLED": "0"}))
    print(f"{'row':>10} {'conc':>5} {'out tok/s':>10} {'TTFT p50':>9} {'ITL p50':>9}")
    for s in systems:
        if s["status"] != "ran":
            print(f"{s['name']:>10} {s['status']}: {s['reason']}")
            continue
        for lv in s["levels"]:
            print(f"{s['name']:>10} {lv['concurrency']:>5} {lv['output_throughput']:>10.1f} "
                  f"{_p50(lv.get('ttft_s')) or 0:>9.4f} {_p50(lv.get('itl_s')) or 0:>9.4f}")
    ran = {s["name"]: s for s in systems if s["status"] == "ran"}
    ratios = []
    if "dp1" in ran:
        for name, s in ran.items():
            if name == "dp1":
                continue
            for lv, ref in zip(s["levels"], ran["dp1"]["levels"]):
                r = lv["output_throughput"] / ref["output_throughput"] if ref["output_throughput"] else None
                ratios.append({"row": name, "concurrency": lv["concurrency"], "output_tok_s_vs_dp1": r})
                print(f"{name} / dp1 at {lv['concurrency']}: {r:.2f}x output tok/s" if r else "")
    out = Path(a.out or REPO / "bench" / "results" / f"dp-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"host": platform.node(), "machine": platform.machine(), "input_len": in_len,
                               "output_len": out_len, "systems": systems, "ratios": ratios}, indent=1, default=str))
    print(f"wrote {out}")
    return 0 if all(s["status"] == "ran" for s in systems) else 1


if __name__ == "__main__":
    raise SystemExit(main())
