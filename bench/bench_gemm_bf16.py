"""bf16 decode GEMMs as a decode step meets them: a model's linear layers (q/k/v, o, gate/up, down) run
in model order on distinct weights, each layer once per pass, so the weights stream from DRAM (the
default model's 30 layers: 424 MB in fp32; the 0.5B shape's 24 layers: 1.4 GB), at decode row counts.
Side by side, through the linear methods the engine would pick among (appliance/layers/methods):

- ``fp32 panel``: ``native`` over float32 weights and activations (``gemm_f32``);
- ``bf16 panel``: ``native_bf16`` over bf16 weights, bf16 activations (``gemm_bf16``: half the bytes);
- ``oneDNN bf16``: ``onednn`` over bf16 (only where oneDNN computes bf16: AVX512-BF16/AMX, Arm BF16);
- ``torch bf16``: ``F.linear`` over bf16.

Prints ms per pass, weight GB/s (bytes of the packed weights / time) and the bf16 panel's speedup over
each other one. Run it alone (the lead runs the real numbers; a quick check: ``--layers 2``):

    .venv/bin/python bench/bench_gemm_bf16.py --json bench/results/gemm_bf16.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from appliance.layers import methods
from appliance.ops import native

# (N, K) per layer and layer count: the default model, and Qwen2.5-0.5B's shape (hidden 896, 14 heads,
# 2 KV heads of 64, intermediate 4864)
MODELS = {
    "default": ({"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576),
                 "down_proj": (576, 1536)}, 30),
    "0.5b": ({"qkv_proj": (1152, 896), "o_proj": (896, 896), "gate_up_proj": (9728, 896),
              "down_proj": (896, 4864)}, 24),
}
# column -> (linear method, dtype)
CANDIDATES = {"fp32 panel": ("native", torch.float32), "bf16 panel": ("native_bf16", torch.bfloat16),
              "oneDNN bf16": ("onednn", torch.bfloat16), "torch bf16": ("torch", torch.bfloat16)}


def bench_model(shapes: dict, layers: int, rows: list[int], reps: int) -> list[dict]:
    cands = {c: (name, dt) for c, (name, dt) in CANDIDATES.items()
             if methods.get(name).host_problem(dt, torch.device("cpu")) is None}
    out = []
    flop_per_row = 2 * layers * sum(n * k for n, k in shapes.values())
    for c, (name, dt) in cands.items():
        m = methods.get(name)
        packed = {k: [m.pack((torch.randn(n, kk) * 0.02).to(dt), None) for _ in range(layers)]
                  for k, (n, kk) in shapes.items()}
        wbytes = sum(p["w"].numel() * p["w"].element_size() for ps in packed.values() for p in ps)
        with torch.inference_mode():
            for r in rows:
                xs = {k: torch.randn(r, kk).to(dt) for k, (_, kk) in shapes.items()}

                def chain():
                    for layer in range(layers):
                        for k in shapes:
                            m.apply(packed[k][layer], xs[k])

                chain()
                best = float("inf")
                for _ in range(reps):
                    t = time.perf_counter()
                    chain()
                    best = min(best, time.perf_counter() - t)
                out.append({"candidate": c, "method": name, "dtype": str(dt).replace("torch.", ""), "rows": r,
                            "ms": 1e3 * best, "gflops": flop_per_row * r / best / 1e9,
                            "weight_gbps": wbytes / best / 1e9, "weight_bytes": wbytes})
        del packed
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="default,0.5b", help=f"comma-separated: {', '.join(MODELS)}")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--layers", type=int, default=0, help="layers per pass (0: the model's own count)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not native.is_available():
        raise SystemExit(f"native kernels unavailable: {native.unavailable_reason()}")
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {', '.join(unknown)} (choose from {', '.join(MODELS)})")
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    from rich.console import Console
    from rich.table import Table

    results = {}
    for model in args.models.split(","):
        shapes, layers = MODELS[model]
        layers = args.layers or layers
        res = bench_model(shapes, layers, rows, args.reps)
        results[model] = {"layers": layers, "shapes": shapes, "results": res}
        t = Table(title=f"{model}: {layers} layers in model order, weights cold (ms per pass)")
        cands = list(dict.fromkeys(r["candidate"] for r in res))
        t.add_column("rows", justify="right")
        for c in cands:
            t.add_column(f"{c} ms", justify="right")
            t.add_column(f"{c} weight GB/s", justify="right")
        others = [c for c in cands if c != "bf16 panel"]
        for c in others:
            t.add_column(f"bf16 panel vs {c}", justify="right")
        for r in rows:
            by = {x["candidate"]: x for x in res if x["rows"] == r}
            cells = [str(r)]
            for c in cands:
                cells += [f"{by[c]['ms']:.2f}", f"{by[c]['weight_gbps']:.1f}"]
            cells += [f"{by[c]['ms'] / by['bf16 panel']['ms']:.2f}x" for c in others]
            t.add_row(*cells)
        Console().print(t)
    from appliance.runtime.cpu_features import detect

    f = detect()
    mach = {"cpu": f.model_name, "arch": f.arch, "isa": [x for x in ("avx2", "avx512f", "avx512_bf16", "asimd", "sve", "bf16", "i8mm")
                                                         if f.has(x)], "threads": torch.get_num_threads(),
            "torch": torch.__version__}
    Console().print(f"kernels: {native.kernel_variant()} | {mach}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"benchmark": "gemm_bf16", "machine": mach, "variant": native.kernel_variant(),
                       "models": results}, fh, indent=2)


if __name__ == "__main__":
    main()
