"""Decode attention per KV cache dtype (--kv-cache-dtype): the native paged kernel over a float32,
bfloat16, int8, fp8_e4m3 and fp8_e5m2 cache of the same context, time per decode step (one new token
per sequence) and KV read rate, and the speedup over the float32 cache (issue 19's target: int8/fp8
at least 1.8x float32 at 8k and 32k).

    python bench/bench_attention_kv_dtype.py [--batch 1] [--context 8192 32768] [--json FILE]

Shape: the default model's attention (9 query heads, 3 KV heads, head size 64; --num-heads etc.),
float32 query, block size 16, blocks scattered through the cache. GB/s = bytes of K+V (and the
quantized caches' float32 per-row scales) read / time. Times are medians.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from appliance.ops import native, reference  # noqa: E402
from bench_attention import timeit  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def bench_case(batch, ctx, num_heads, num_kv_heads, head_size, block_size, min_time, dtypes, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = (ctx + block_size - 1) // block_size
    num_blocks = batch * nb
    shape = reference.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    k = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    block_table = torch.randperm(num_blocks, generator=g).to(torch.int32).view(batch, nb)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    query = torch.randn(batch, num_heads, head_size, generator=g)
    scale = reference.softmax_scale(head_size)
    rows = []
    base_ms = None
    for name in dtypes:
        dt = DTYPES[name]
        kw = {}
        if reference.kv_cache_is_quantized(dt):
            kc, ks = reference.quantize_kv(k, dt)
            vc, vs = reference.quantize_kv(v, dt)
            kw = {"k_scale": ks.contiguous(), "v_scale": vs.contiguous()}
        else:
            kc, vc = k.to(dt), v.to(dt)

        def run():
            return native.paged_attention(query, kc, vc, block_table, seq_lens, qsl, scale, 1, **kw)

        out = run()
        ref = reference.paged_attention(query, kc, vc, block_table, seq_lens, qsl, scale, 1, **kw)
        diff = float((out - ref).abs().max())
        t = timeit(run, min_time)
        rows_read = 2 * batch * num_kv_heads * ctx
        nbytes = rows_read * head_size * kc.element_size() + (rows_read * 4 if kw else 0)
        if name == "float32":
            base_ms = t * 1e3
        rows.append({"batch": batch, "context": ctx, "kv_cache_dtype": name, "ms_per_step": t * 1e3,
                     "ms_per_token": t * 1e3 / batch, "kv_bytes": nbytes, "gbps": nbytes / t / 1e9,
                     "speedup_vs_float32": (base_ms / (t * 1e3)) if base_ms else None,
                     "max_abs_diff_vs_reference": diff})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--context", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--num-heads", type=int, default=9)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES),
                   help="float32 first: the others' speedup is against it")
    p.add_argument("--min-time", type=float, default=0.5, help="seconds of timing per case and dtype")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=str, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not native.is_available():
        print(f"native kernels unavailable: {native.unavailable_reason()}", file=sys.stderr)
        return 1
    from appliance.bench.common import machine_description

    host = machine_description()
    print(f"machine: {host['cpu']} ({host['arch']}), {host['physical_cores']} cores, ISA {' '.join(host['isa'])}")
    print(f"kernels: {native.kernel_variant()}, threads: {torch.get_num_threads()}")
    hdr = f"{'batch':>5} {'ctx':>6} {'kv dtype':>9} | {'ms/step':>8} {'ms/token':>8} {'GB/s':>6} | {'x fp32':>6} | {'maxdiff':>8}"
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for b in args.batch:
        for c in args.context:
            for r in bench_case(b, c, args.num_heads, args.num_kv_heads, args.head_size, args.block_size,
                                args.min_time, args.kv_cache_dtype):
                rows.append(r)
                x = f"{r['speedup_vs_float32']:>6.2f}" if r["speedup_vs_float32"] else f"{'-':>6}"
                print(f"{b:>5} {c:>6} {r['kv_cache_dtype']:>9} | {r['ms_per_step']:>8.3f} {r['ms_per_token']:>8.3f}"
                      f" {r['gbps']:>6.1f} | {x} | {r['max_abs_diff_vs_reference']:>8.1e}")
    record = {"benchmark": "decode_attention_kv_dtype",
              "shape": {"num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads, "head_size": args.head_size,
                        "block_size": args.block_size, "query_dtype": "float32"},
              "kernel_variant": native.kernel_variant(), "host": host, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "results": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
