"""Float GEMM as a decode step meets it: the default model's 30 layers of q/k/v, o, gate/up and down
projections run in model order on distinct weights (424 MB, far past the last-level cache), so every
weight streams from DRAM once per pass, at several row counts; oneDNN's prepacked path against the
native panel GEMM (``gemm_f32``), side by side with the ratio, and the same packed panels through torch's
batched GEMM (``panels``: what the ``native`` method runs above ``NATIVE_F32_MAX_ROWS`` rows). ``x 1 row``:
the native pass over its 1-row time (a decode step of that many requests, a speculative verify of
rows - 1 drafts, against a 1-token step; shown when ``--rows`` starts at 1). The backends take turns
within each repeat and the median is kept (``--repeats``; the least time moved by up to 20% between
runs at 1-8 rows here). Run it alone:

    .venv/bin/python bench/bench_gemm_cold.py --json bench/results/gemm_cold.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from appliance.layers.methods.floating import _panels_matmul
from appliance.layers.methods.floating import pack_onednn as _pack_onednn
from appliance.ops import native

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,3,4,5,8,16,32,64,96,128,256,2048")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=9, help="timed passes per backend and row count (2 above 256 rows)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not native.is_available():
        raise SystemExit(f"native kernels unavailable: {native.unavailable_reason()}")
    torch.manual_seed(0)
    L = args.layers
    weights = {k: [torch.randn(n, kk) * 0.02 for _ in range(L)] for k, (n, kk) in SHAPES.items()}
    packed = {"onednn": {k: [_pack_onednn(w) for w in ws] for k, ws in weights.items()},
              "native": {k: [native.pack_f32(w) for w in ws] for k, ws in weights.items()}}
    del weights
    run = {"onednn": lambda x, p, n: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
           "native": lambda x, p, n: native.gemm_f32(x, p, None, n),
           "panels": lambda x, p, n: _panels_matmul({"w": p, "n": n, "bias": None}, x)}
    packed["panels"] = packed["native"]
    backends = ("onednn", "native", "panels")
    flop_per_row = 2 * L * sum(n * k for n, k in SHAPES.values())
    rows_out = []
    with torch.inference_mode():
        for m in [int(r) for r in args.rows.split(",")]:
            xs = {k: torch.randn(m, kk) for k, (n, kk) in SHAPES.items()}
            def chain(b):
                for layer in range(L):
                    for k, (n, _) in SHAPES.items():
                        run[b](xs[k], packed[b][k][layer], n)
            times = {b: [] for b in backends}
            for b in backends:
                chain(b)
            for _ in range(args.repeats if m <= 256 else 2):
                for b in backends:
                    t = time.perf_counter()
                    chain(b)
                    times[b].append(time.perf_counter() - t)
            res = {b: statistics.median(v) for b, v in times.items()}
            one = res["native"] if m == 1 and not rows_out else (
                rows_out[0]["native_ms"] / 1e3 if rows_out and rows_out[0]["rows"] == 1 else None)
            rows_out.append({"rows": m, **{f"{b}_ms": 1e3 * t for b, t in res.items()},
                             **{f"{b}_gflops": flop_per_row * m / t / 1e9 for b, t in res.items()},
                             "native_speedup": res["onednn"] / res["native"],
                             "native_vs_panels": res["panels"] / res["native"],
                             "native_x_one_row": None if one is None else res["native"] / one})
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{L} layers of the default model in model order, weights cold (ms per pass)")
    for c in ("rows", "oneDNN ms", "oneDNN GFLOP/s", "native ms", "native GFLOP/s", "native speedup",
              "native x 1 row", "panels ms", "native vs panels"):
        t.add_column(c, justify="right")
    for r in rows_out:
        t.add_row(str(r["rows"]), f"{r['onednn_ms']:.2f}", f"{r['onednn_gflops']:.0f}", f"{r['native_ms']:.2f}",
                  f"{r['native_gflops']:.0f}", f"{r['native_speedup']:.2f}x", "-" if r["native_x_one_row"] is None else f"{r['native_x_one_row']:.2f}",
                  f"{r['panels_ms']:.2f}", f"{r['native_vs_panels']:.2f}x")
    Console(width=160).print(t)
    from appliance.runtime.cpu_features import detect

    f = detect()
    mach = {"cpu": f.model_name, "arch": f.arch, "isa": [x for x in ("avx2", "avx512f", "avx512_bf16", "asimd", "sve", "bf16", "i8mm")
                                                         if f.has(x)], "threads": torch.get_num_threads(),
            "torch": torch.__version__}
    Console(width=160).print(f"kernels: {native.kernel_variant()} | {mach}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "gemm_cold", "machine": mach, "layers": L, "shapes": SHAPES,
                       "variant": native.kernel_variant(), "results": rows_out}, f, indent=2)


if __name__ == "__main__":
    main()
