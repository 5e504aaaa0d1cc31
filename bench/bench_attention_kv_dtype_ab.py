"""Interleaved A/B of two native builds (e.g. main's and a branch's) on bench_attention_kv_dtype's
decode case: each round times float32 and the chosen KV dtypes with build A, then with build B
(alternating which goes first; one short worker process per build and round, as Python keeps one
copy of an extension module per name), and prints each build's x-float32 ratios per round. For a
shared, loaded host, where back-to-back runs of the whole benchmark drift more than the effect.

    python bench/bench_attention_kv_dtype_ab.py --build-a DIR --build-b DIR [--context 8192 32768]
        [--kv-cache-dtype int8] [--rounds 6] [--threads 1]

DIR: a native build directory (appliance.ops.native.build_dir() of each source tree)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from appliance.ops import native, reference  # noqa: E402
from bench_attention import timeit  # noqa: E402
import time  # noqa: E402


def fastest(fn, min_time: float) -> float:
    for _ in range(2):
        fn()
    best, start, n = float("inf"), time.perf_counter(), 0
    while n < 5 or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best
from bench_attention_kv_dtype import DTYPES  # noqa: E402


def load_build(d: str):
    spec = importlib.util.spec_from_file_location(native.EXTENSION_NAME, Path(d) / f"{native.EXTENSION_NAME}.so")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build-a", required=True)
    p.add_argument("--build-b", required=True)
    p.add_argument("--context", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--kv-cache-dtype", nargs="+", default=["int8"], choices=[d for d in DTYPES if d != "float32"])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--min-time", type=float, default=0.3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="per case: the median call time, or the fastest (least disturbed on a loaded host)")
    p.add_argument("--json", type=str, default=None, help="write every round's times here")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # context; build in --build-a
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker is not None:
        native._ext = load_build(args.build_a)
        print(json.dumps(worker(args, args.worker)))
        return 0
    ratios, runs = {}, []
    for ctx in args.context:
        for rnd in range(args.rounds):
            for b in (["A", "B"] if rnd % 2 == 0 else ["B", "A"]):
                d = args.build_a if b == "A" else args.build_b
                cmd = [sys.executable, __file__, "--build-a", d, "--build-b", d, "--worker", str(ctx),
                       "--kv-cache-dtype", *args.kv_cache_dtype, "--min-time", str(args.min_time), "--stat", args.stat]
                if args.threads:
                    cmd += ["--threads", str(args.threads)]
                t = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
                line = "  ".join(f"{n} {t[n] * 1e3:.3f} ms x{t['float32'] / t[n]:.2f}" for n in args.kv_cache_dtype)
                print(f"ctx {ctx:6d} round {rnd} {b}: float32 {t['float32'] * 1e3:.3f} ms  {line}", flush=True)
                runs.append({"context": ctx, "round": rnd, "build": b, "build_dir": d,
                             "ms_per_step": {n: x * 1e3 for n, x in t.items()}})
                for n in args.kv_cache_dtype:
                    ratios.setdefault((ctx, n, b), []).append(t["float32"] / t[n])
    for (ctx, n, b), r in sorted(ratios.items()):
        print(f"ctx {ctx} {n} build {b}: x float32 min {min(r):.2f} median {statistics.median(r):.2f} max {max(r):.2f}")
    if args.json:
        record = {"benchmark": "decode_attention_kv_dtype_ab", "shape": {"num_heads": 9, "num_kv_heads": 3,
                  "head_size": 64, "block_size": 16, "batch": 1}, "threads": args.threads, "stat": args.stat,
                  "argv": sys.argv[1:], "runs": runs}
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


def worker(args, ctx: int) -> dict:
    H, HKV, D, BS = 9, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    nb = (ctx + BS - 1) // BS
    shape = reference.kv_cache_shape(nb, BS, HKV, D)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    bt = torch.randperm(nb, generator=g).to(torch.int32).view(1, nb)
    sl, qsl = torch.tensor([ctx], dtype=torch.int32), torch.arange(2, dtype=torch.int32)
    q = torch.randn(1, H, D, generator=g)
    scale = reference.softmax_scale(D)
    cases = {"float32": (k, v, {})}
    for name in args.kv_cache_dtype:
        kc, ks = reference.quantize_kv(k, DTYPES[name])
        vc, vs = reference.quantize_kv(v, DTYPES[name])
        cases[name] = (kc, vc, {"k_scale": ks.contiguous(), "v_scale": vs.contiguous()})
    tf = fastest if args.stat == "min" else timeit
    return {n: tf(lambda: native.paged_attention(q, kc, vc, bt, sl, qsl, scale, 1, **kw), args.min_time)
            for n, (kc, vc, kw) in cases.items()}

if __name__ == "__main__":
    raise SystemExit(main())
