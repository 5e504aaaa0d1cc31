"""Interleaved A/B of the native paged attention between source trees (e.g. a worktree of main and
the working tree): decode at batch 1 over contexts to 32k, batched decode, and prefill tiles, on
random K/V with shuffled block tables. Each round runs every tree once, in turn, in its own process
(PYTHONPATH=<tree>, so each tree imports its own build; build each first with
``APPLIANCE_NATIVE_BUILD=1 python -m appliance.ops.native --build``); a case's figure per tree is its
fastest call over all rounds, which a shared host's drift moves least.

    python bench/bench_attention_ab.py --tree A=/work/wt-base --tree B=. [--rounds 4] [--threads 2]
        [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

# (label, heads, kv heads, sequences, new tokens per sequence, context per sequence); head size 64
CASES = [
    ("decode", 9, 3, 1, 1, 200), ("decode", 9, 3, 1, 1, 300), ("decode", 9, 3, 1, 1, 600),
    ("decode", 9, 3, 1, 1, 1000), ("decode", 9, 3, 1, 1, 4000), ("decode", 9, 3, 1, 1, 8000),
    ("decode", 9, 3, 1, 1, 32000), ("decode", 9, 3, 64, 1, 190), ("decode", 9, 3, 16, 1, 1000),
    ("decode", 9, 3, 4, 1, 600), ("decode", 32, 8, 1, 1, 8192), ("decode", 32, 8, 8, 1, 2048),
    ("decode", 32, 8, 32, 1, 512), ("verify", 9, 3, 1, 4, 1000),
    ("prefill", 9, 3, 1, 512, 512), ("prefill", 9, 3, 1, 256, 2048), ("prefill", 9, 3, 1, 2048, 2048),
    ("prefill", 32, 8, 1, 512, 4096),
]

WORKER = r"""
import json, sys, time, torch
from appliance.ops import native
cases, min_time = json.loads(sys.argv[1]), float(sys.argv[2])
out = []
for label, H, KVH, B, q_len, ctx in cases:
    torch.manual_seed(0)
    D, BS = 64, 16
    nb = (ctx + BS - 1) // BS
    k, v = torch.randn(B * nb, KVH, BS, D), torch.randn(B * nb, KVH, BS, D)
    bt = torch.randperm(B * nb).to(torch.int32).view(B, nb)
    q = torch.randn(B * q_len, H, D)
    sl = torch.full((B,), ctx, dtype=torch.int32)
    qsl = torch.arange(0, (B + 1) * q_len, q_len, dtype=torch.int32)
    f = lambda: native.paged_attention(q, k, v, bt, sl, qsl, 0.125, q_len)
    for _ in range(3):
        f()
    best, n, t0 = float("inf"), 0, time.perf_counter()
    while n < 10 or time.perf_counter() - t0 < min_time:
        a = time.perf_counter(); f(); best = min(best, time.perf_counter() - a); n += 1
    out.append(best)
print(json.dumps({"times": out}))
"""


def case_name(c) -> str:
    label, h, kvh, b, q, ctx = c
    return f"{label} {h}/{kvh} b{b}" + (f" q{q}" if q > 1 else "") + f" ctx{ctx}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True, help="NAME=DIR, a source tree; give two or more")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the workers")
    p.add_argument("--min-time", type=float, default=1.5, help="seconds of timing per case, tree and round")
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    best = {name: [float("inf")] * len(CASES) for name in trees}
    per_round = {name: [] for name in trees}
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(list(trees)))
        for name in order:
            env["PYTHONPATH"] = str(Path(trees[name]).resolve())
            res = subprocess.run([sys.executable, "-c", WORKER, json.dumps(CASES), str(args.min_time)],
                                 env=env, capture_output=True, text=True, check=True)
            times = json.loads(res.stdout.strip().splitlines()[-1])["times"]
            per_round[name].append(times)
            best[name] = [min(a, b) for a, b in zip(best[name], times)]
            print(f"round {r + 1} {name} done", file=sys.stderr)
    names = list(trees)
    first = names[0]
    head = f"{'case':28s}" + "".join(f"{n + ' us':>11s}" for n in names) + "".join(
        f"{n + '/' + first:>10s}" for n in names[1:])
    print(head)
    for i, c in enumerate(CASES):
        row = f"{case_name(c):28s}" + "".join(f"{best[n][i] * 1e6:11.1f}" for n in names)
        row += "".join(f"{best[n][i] / best[first][i]:10.3f}" for n in names[1:])
        print(row)
    if args.json:
        rec = {"started": started, "host": platform.node(), "machine": platform.machine(),
               "threads": args.threads, "rounds": args.rounds, "trees": trees,
               "cases": [case_name(c) for c in CASES],
               "best_us": {n: [t * 1e6 for t in best[n]] for n in names},
               "per_round_us": {n: [[t * 1e6 for t in rt] for rt in per_round[n]] for n in names}}
        Path(args.json).write_text(json.dumps(rec, indent=2) + "\n")


if __name__ == "__main__":
    main()
