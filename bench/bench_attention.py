"""Decode attention benchmark: native paged kernel vs the torch reference vs torch SDPA on the
same K/V stored contiguously (what paging costs), with the KV read rate against this machine's
measured copy bandwidth.

    python bench/bench_attention.py [--batch 1 8 32] [--context 512 2048] [--json FILE]

Shape (the issue's): 32 query heads, 8 KV heads, head size 64, float32 (--dtype), block size 16, one new
token per sequence, block tables shuffled (blocks scattered through the cache as in a long-running
server). Times are medians; GB/s = K+V bytes read / time.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.ops import native, reference  # noqa: E402


def call_times(fn, min_time: float, min_iters: int = 5) -> list[float]:
    """Call times of ``fn`` repeated on the same (hot) data, after two untimed calls."""
    for _ in range(2):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_iters or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 1000:
            break
    return times


def timeit(fn, min_time: float, min_iters: int = 5) -> float:
    return statistics.median(call_times(fn, min_time, min_iters))


def copy_bandwidth(nbytes: int = 512 << 20) -> float:
    """GB/s of torch's multi-threaded copy, counting bytes read + bytes written."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), 0.5)
    return 2 * nbytes / t / 1e9


def bench_case(batch, ctx, num_heads, num_kv_heads, head_size, block_size, min_time, seed=0,
               dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    nb = (ctx + block_size - 1) // block_size
    num_blocks = batch * nb
    shape = reference.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=g).to(dtype)
    value_cache = torch.randn(shape, generator=g).to(dtype)
    block_table = torch.randperm(num_blocks, generator=g).to(torch.int32).view(batch, nb)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    query = torch.randn(batch, num_heads, head_size, generator=g).to(dtype)
    scale = reference.softmax_scale(head_size)

    # The same context, contiguous: [B, Hkv, ctx, D].
    def contiguous(cache):
        return cache[block_table.long()].permute(0, 2, 1, 3, 4).reshape(
            batch, num_kv_heads, nb * block_size, head_size)[:, :, :ctx].contiguous()

    k, v = contiguous(key_cache), contiguous(value_cache)
    q4 = query.view(batch, num_heads, 1, head_size)

    def run_native():
        return native.paged_attention(query, key_cache, value_cache, block_table, seq_lens, qsl, scale, 1)

    def run_ref():
        return reference.paged_attention(query, key_cache, value_cache, block_table, seq_lens, qsl, scale, 1)

    def run_sdpa():
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    out_n, out_r = run_native(), run_ref()
    out_s = run_sdpa().view(batch, num_heads, head_size)
    err = max((out_n.float() - out_r.float()).abs().max().item(),
              (out_n.float() - out_s.float()).abs().max().item())
    kv_bytes = 2 * batch * num_kv_heads * ctx * head_size * key_cache.element_size()
    res = {"batch": batch, "context": ctx, "kv_bytes": kv_bytes, "max_abs_diff": err}
    for name, fn in (("native", run_native), ("reference", run_ref), ("sdpa_contiguous", run_sdpa)):
        t = timeit(fn, min_time)
        res[f"{name}_ms"] = t * 1e3
        res[f"{name}_gbps"] = kv_bytes / t / 1e9
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="query, KV cache and output dtype")
    p.add_argument("--min-time", type=float, default=0.5, help="seconds of timing per case and kernel")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=str, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not native.is_available():
        print(f"native kernels unavailable: {native.unavailable_reason()}", file=sys.stderr)
        return 1
    bw = copy_bandwidth()
    rows = []
    from appliance.bench.common import machine_description

    host = machine_description()
    print(f"machine: {host['cpu']} ({host['arch']}), {host['physical_cores']} cores, ISA {' '.join(host['isa'])}, "
          f"torch {host['torch']}")
    print(f"kernels: {native.kernel_variant()} ({native.cpu_features()}), threads: {torch.get_num_threads()}")
    print(f"copy bandwidth (read+write): {bw:.1f} GB/s")
    hdr = (f"{'batch':>5} {'ctx':>5} | {'native ms':>9} {'GB/s':>6} {'%bw':>4} | {'ref ms':>8} {'x ref':>6} |"
           f" {'sdpa ms':>8} {'x sdpa':>6} | {'maxdiff':>8}")
    print(hdr)
    print("-" * len(hdr))
    for b in args.batch:
        for c in args.context:
            r = bench_case(b, c, args.num_heads, args.num_kv_heads, args.head_size, args.block_size,
                           args.min_time, dtype=getattr(torch, args.dtype))
            r["native_pct_of_copy_bw"] = 100 * r["native_gbps"] / bw
            r["speedup_vs_reference"] = r["reference_ms"] / r["native_ms"]
            r["speedup_vs_sdpa"] = r["sdpa_contiguous_ms"] / r["native_ms"]
            rows.append(r)
            print(f"{b:>5} {c:>5} | {r['native_ms']:>9.3f} {r['native_gbps']:>6.1f} {r['native_pct_of_copy_bw']:>4.0f} |"
                  f" {r['reference_ms']:>8.3f} {r['speedup_vs_reference']:>6.2f} |"
                  f" {r['sdpa_contiguous_ms']:>8.3f} {r['speedup_vs_sdpa']:>6.2f} | {r['max_abs_diff']:>8.1e}")
    record = {
        "benchmark": "decode_attention",
        "shape": {"num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads, "head_size": args.head_size,
                  "block_size": args.block_size, "dtype": args.dtype},
        "kernel_variant": native.kernel_variant(),
        "cpu_features": native.cpu_features(),
        "machine": platform.machine(),
        "host": host,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "copy_bandwidth_gbps": bw,
        "results": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
