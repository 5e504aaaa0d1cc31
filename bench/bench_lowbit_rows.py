"""Quantized GEMMs as a decode step and a speculative verify meet them: the default model's 30 layers of
q/k/v, o, gate/up and down projections as its Q4_1 GGUF holds them (4-bit groups of 32 with offsets,
``w4a8_native`` on ``gemm_wlow_a8``; 86 MB, far past the last-level cache, so every weight streams from
DRAM once per pass) and its int8 lm_head (``w8a8_native`` on ``gemm_w8g_a8``, 49152 x 576, Q8_0's groups
of 32), on distinct random weights in model order, at several row counts. ``x 1 row``: a pass over its
1-row time (a verify of rows - 1 drafts against a 1-token step). Median of ``--repeats`` passes, the row
counts taking turns within each repeat. Run it alone:

    .venv/bin/python bench/bench_lowbit_rows.py --json bench/results/lowbit_rows.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from appliance.layers.methods.int8 import W8A8Native
from appliance.layers.methods.lowbit import W4A8Native

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}
LM_HEAD = (49152, 576)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,3,4,5,8")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    w4, w8 = W4A8Native(), W8A8Native()

    def q4(n, k):  # Q4_1's form: codes in [-8, 7], a scale and an offset per group of 32
        return w4.pack(torch.randint(-8, 8, (n, k), dtype=torch.int8), torch.rand(n, k // 32) * 0.01 + 1e-3,
                       torch.randint(-8, 8, (n, k // 32)).float())

    layers = {name: [q4(n, k) for _ in range(args.layers)] for name, (n, k) in SHAPES.items()}
    head = w8.pack(torch.randint(-127, 128, LM_HEAD, dtype=torch.int8), torch.rand(LM_HEAD[0], LM_HEAD[1] // 32) * 0.01)
    rows = [int(r) for r in args.rows.split(",")]
    xs = {m: {k: torch.randn(m, k) for k in (576, 1536)} for m in rows}

    def layers_pass(m):
        t = time.perf_counter()
        for i in range(args.layers):
            for name, (n, k) in SHAPES.items():
                w4.apply(layers[name][i], xs[m][k])
        return time.perf_counter() - t

    def head_pass(m):
        t = time.perf_counter()
        w8.apply(head, xs[m][576])
        return time.perf_counter() - t

    times = {m: {"layers": [], "lm_head": []} for m in rows}
    with torch.inference_mode():
        for m in rows:  # warm-up: first calls of each shape
            layers_pass(m), head_pass(m)
        for _ in range(args.repeats):
            for m in rows:
                times[m]["layers"].append(layers_pass(m))
                times[m]["lm_head"].append(head_pass(m))
    out = []
    print(f"{'rows':>4}  {'layers ms':>9}  {'x 1 row':>7}  {'lm_head ms':>10}  {'x 1 row':>7}  {'step ms':>7}  {'x 1 row':>7}")
    base = None
    for m in rows:
        lay, hd = statistics.median(times[m]["layers"]) * 1e3, statistics.median(times[m]["lm_head"]) * 1e3
        if m == 1:
            base = (lay, hd)
        r = {"rows": m, "layers_ms": lay, "lm_head_ms": hd, "step_ms": lay + hd}
        if base:
            r.update(layers_x=lay / base[0], lm_head_x=hd / base[1], step_x=(lay + hd) / sum(base))
        out.append(r)
        x = (lambda k: f"{r[k]:7.2f}" if k in r else f"{'-':>7}")
        print(f"{m:4d}  {lay:9.2f}  {x('layers_x')}  {hd:10.2f}  {x('lm_head_x')}  {lay + hd:7.2f}  {x('step_x')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "lowbit_rows", "layers": args.layers, "repeats": args.repeats,
                       "threads": torch.get_num_threads(), "rows": out}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
