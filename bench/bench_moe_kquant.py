"""Interleaved A/B on one GGUF K-quant MoE layer at Qwen3-30B-A3B shape (hidden 2048, moe_intermediate
768, 128 experts, top-8, random blocks): ops.native.moe_experts expert by expert (per_expert=True, what
K-quant experts ran before moe_q took them) against the one-region moe_q, after checking both give the
same result bit for bit. Gate/up Q4_K; down Q6_K (a Q4_K_M file's usual layer) or Q4_K.

    python bench/bench_moe_kquant.py [--down Q6_K|Q4_K] [--json FILE]   (threads: OMP_NUM_THREADS)
"""
import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # gguf_files: the block writer
from gguf_files import random_blocks  # noqa: E402

from appliance.layers.methods.lowbit import pack_kquant  # noqa: E402
from appliance.layers.quant import _kquant_tables  # noqa: E402
from appliance.models.gguf_quants import canonical  # noqa: E402
from appliance.ops import native  # noqa: E402

H, I, E, K_TOP = 2048, 768, 128, 8
ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--down", choices=("Q6_K", "Q4_K"), default="Q6_K")
ap.add_argument("--json", help="write the results here")
args = ap.parse_args()
down_type = args.down
rng = np.random.default_rng(0)


def packed(qtype, n, k):
    cw = canonical(qtype, random_blocks(qtype, n, k, rng), n, k)
    t = _kquant_tables({None: cw.kquant}, {}, n, k, cw.group)
    bits = 4 if cw.scheme == "w4a8" else 6
    return pack_kquant(cw.qweight, t, bits)


gu, dn = packed("Q4_K", 2 * I, H), packed(down_type, H, I)
empty = torch.empty(0)
flat, kinds = [], []
for e in range(E):  # each expert its own copy (DRAM traffic as with distinct weights)
    for p in (gu, dn):
        flat += [p["lo"].clone(), empty, p["hi"].clone(), p["kf"].clone(), p["k8"].clone()]
        kinds += [8, p["group"], p["bits"], p["super"] | p["flags"] << 16]
print(f"machine: {platform.machine()}, kernels {native.kernel_variant()}, torch {torch.__version__}, "
      f"{torch.get_num_threads()} threads; gate/up Q4_K, down {down_type}")
print(f"{'T':>3}  {'per-expert / moe_q (median)':>28}  {'quartiles':>13}  {'pairs':>5}  {'best / best':>11}")
rows = []
for T in (1, 16):
    g = torch.Generator().manual_seed(T)
    xs = [torch.randn(T, H, generator=g) for _ in range(8)]
    idss = [torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(T)]) for _ in range(8)]
    w = torch.rand(T, K_TOP, generator=g)
    # same result (bit for bit) first
    a = native.moe_experts(xs[0], idss[0], w, flat, kinds, I, per_expert=True)
    c0 = native.moe_q_calls()
    b = native.moe_experts(xs[0], idss[0], w, flat, kinds, I)
    assert native.moe_q_calls() == c0 + 1 and torch.equal(a, b)
    ratios, ta, tb = [], [], []
    reps = 80 if T == 1 else 24
    for r in range(reps):
        x, ids = xs[r % 8], idss[r % 8]
        order = (True, False) if r % 2 == 0 else (False, True)
        t = {}
        for pe in order:
            t0 = time.perf_counter()
            native.moe_experts(x, ids, w, flat, kinds, I, per_expert=pe)
            t[pe] = time.perf_counter() - t0
        ta.append(t[True]), tb.append(t[False]), ratios.append(t[True] / t[False])
    row = {"T": T, "median_ratio": statistics.median(ratios), "q25": float(np.percentile(ratios, 25)),
           "q75": float(np.percentile(ratios, 75)), "pairs": reps, "best_ratio": min(ta) / min(tb),
           "per_expert_best_ms": 1e3 * min(ta), "moe_q_best_ms": 1e3 * min(tb)}
    rows.append(row)
    print(f"{T:>3}  {row['median_ratio']:>28.3f}  {row['q25']:.3f}-{row['q75']:.3f}  {reps:>5}  {row['best_ratio']:>11.3f}")
if args.json:
    Path(args.json).write_text(json.dumps({"down": down_type, "threads": torch.get_num_threads(),
                                           "kernels": native.kernel_variant(), "rows": rows}, indent=1))
