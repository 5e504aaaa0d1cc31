"""Decode attention per KV cache dtype (--kv-cache-dtype): the native paged kernel over a float32,
bfloat16, int8, fp8_e4m3 and fp8_e5m2 cache of the same context, time per decode step (one new token
per sequence) and KV read rate, and the speedup over the float32 cache (issue 19's target: int8/fp8
at least 1.8x float32 at 8k and 32k).

    python bench/bench_attention_kv_dtype.py [--batch 1] [--context 8192 32768] [--json FILE]
    python bench/bench_attention_kv_dtype.py --layers [30] [--weights-mb 14.2] [--rounds 3] [--threads 1]

Shape: the default model's attention (9 query heads, 3 KV heads, head size 64; --num-heads etc.),
float32 query, block size 16, blocks scattered through the cache. GB/s = bytes of K+V (and the
quantized caches' float32 per-row scales) read / time. Times are medians.

Without --layers (single-layer hot mode): one layer's call timed over and over on the same cache, which
stays in the last-level cache between calls when it fits (an 8k float32 layer is 12.6 MB).

With --layers N (per-token mode; N defaults to the default model's 30 layers): N layer caches of the
same shape (their own random contents and block tables); one token = the N layers' calls in sequence,
so each layer's cache is cold again when its next token reads it, as in a real decode step. Optionally
--weights-mb M of a scratch buffer (N distinct slices, like each layer's weights) is read between two
layers' calls, untimed. Both modes are reported side by side: the hot mode on layer 0 of the same
caches. One KV dtype is built (from the float32 master caches) at a time and freed; --rounds R repeats
the whole dtype sweep R times, interleaved, alternating the order after float32, and the table gives
the median over rounds (of each round's median) with the rounds' range; x fp32 is per round.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from appliance.ops import native, reference  # noqa: E402
from bench_attention import call_times as time_hot, timeit  # noqa: E402

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


def make_layer_caches(layers, batch, ctx, num_kv_heads, head_size, block_size, seed=0):
    """The float32 master caches: per layer (k, v, block_table), each layer its own random contents and
    block table."""
    nb = (ctx + block_size - 1) // block_size
    num_blocks = batch * nb
    shape = reference.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    out = []
    for layer in range(layers):
        g = torch.Generator().manual_seed(seed * 1000003 + 7919 * (layer + 1))
        k = torch.randn(shape, generator=g)
        v = torch.randn(shape, generator=g)
        bt = torch.randperm(num_blocks, generator=g).to(torch.int32).view(batch, nb)
        out.append((k, v, bt))
    return out


def convert_layers(master, name):
    """Each layer's (k cache, v cache, block table, scale kwargs) in KV dtype ``name``."""
    dt = DTYPES[name]
    out = []
    for k, v, bt in master:
        if reference.kv_cache_is_quantized(dt):
            kc, ks = reference.quantize_kv(k, dt)
            vc, vs = reference.quantize_kv(v, dt)
            out.append((kc, vc, bt, {"k_scale": ks.contiguous(), "v_scale": vs.contiguous()}))
        elif dt == torch.float32:
            out.append((k, v, bt, {}))
        else:
            out.append((k.to(dt), v.to(dt), bt, {}))
    return out


def layer_bytes(kc, batch, ctx, num_kv_heads, head_size, quantized):
    rows_read = 2 * batch * num_kv_heads * ctx
    return rows_read * head_size * kc.element_size() + (rows_read * 4 if quantized else 0)


def time_per_token(layers, query, seq_lens, qsl, scale, tokens, scratch=None, slice_elems=0):
    """``tokens`` timed tokens (after one untimed): each the sum of the layers' attention call times;
    with ``scratch``, layer i's slice of it is read (untimed) before layer i's call."""
    times = []
    for t in range(tokens + 1):
        total = 0.0
        for i, (kc, vc, bt, kw) in enumerate(layers):
            if scratch is not None:
                float(scratch[i * slice_elems:(i + 1) * slice_elems].sum())
            t0 = time.perf_counter()
            native.paged_attention(query, kc, vc, bt, seq_lens, qsl, scale, 1, **kw)
            total += time.perf_counter() - t0
        if t:
            times.append(total)
    return times


def bench_per_token(batch, ctx, num_heads, num_kv_heads, head_size, block_size, dtypes, layers, rounds,
                    tokens, hot_min_time, weights_mb, stat, seed=0, log=print):
    """Per-token and hot single-layer timings, ``rounds`` interleaved sweeps over ``dtypes`` (float32
    first). Returns one row per dtype with per-round values and their median / range."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, num_heads, head_size, generator=g)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    scale = reference.softmax_scale(head_size)
    master = make_layer_caches(layers, batch, ctx, num_kv_heads, head_size, block_size, seed)
    scratch, slice_elems = None, 0
    if weights_mb > 0:
        slice_elems = int(weights_mb * 1e6) // 4
        scratch = torch.ones(layers * slice_elems)
    reduce = min if stat == "min" else statistics.median
    per = {n: {"tok": [], "hot": [], "diff": 0.0} for n in dtypes}
    for rnd in range(rounds):
        rest = [n for n in dtypes if n != "float32"]
        order = (["float32"] if "float32" in dtypes else []) + (rest if rnd % 2 == 0 else rest[::-1])
        for name in order:
            lay = convert_layers(master, name)
            if rnd == 0:  # reference check on the first and last layer
                for kc, vc, bt, kw in (lay[0], lay[-1]):
                    out = native.paged_attention(query, kc, vc, bt, seq_lens, qsl, scale, 1, **kw)
                    ref = reference.paged_attention(query, kc, vc, bt, seq_lens, qsl, scale, 1, **kw)
                    per[name]["diff"] = max(per[name]["diff"], float((out - ref).abs().max()))
            kc0, vc0, bt0, kw0 = lay[0]
            tok = reduce(time_per_token(lay, query, seq_lens, qsl, scale, tokens, scratch, slice_elems))
            hot = reduce(time_hot(lambda: native.paged_attention(query, kc0, vc0, bt0, seq_lens, qsl, scale, 1,
                                                                 **kw0), hot_min_time))
            per[name]["tok"].append(tok)
            per[name]["hot"].append(hot)
            per[name]["bytes"] = layer_bytes(kc0, batch, ctx, num_kv_heads, head_size, bool(kw0))
            del lay, kc0, vc0, kw0
            gc.collect()
            log(f"  ctx {ctx} round {rnd} {name}: token {tok * 1e3:.3f} ms, hot layer {hot * 1e3:.4f} ms", flush=True)
    rows = []
    for name in dtypes:
        d = per[name]
        row = {"batch": batch, "context": ctx, "kv_cache_dtype": name, "layers": layers,
               "layer_kv_bytes": d["bytes"], "token_kv_bytes": d["bytes"] * layers,
               "max_abs_diff_vs_reference": d["diff"]}
        for mode, key, nbytes in (("per_token", "tok", d["bytes"] * layers), ("hot_layer", "hot", d["bytes"])):
            ms = [x * 1e3 for x in d[key]]
            m = {"ms_rounds": ms, "ms": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
                 "gbps": nbytes / (statistics.median(ms) / 1e3) / 1e9}
            if "float32" in per:
                xs = [a / b for a, b in zip(per["float32"][key], d[key])]
                m.update({"x_fp32_rounds": xs, "x_fp32": statistics.median(xs), "x_fp32_min": min(xs),
                          "x_fp32_max": max(xs)})
            if mode == "per_token":
                m["ms_per_token"] = m["ms"] / batch
            row[mode] = m
        rows.append(row)
    del master, scratch
    gc.collect()
    return rows


def run_per_token(args, host) -> int:
    layers = args.layers
    print(f"per-token mode: {layers} layers, weights stream {args.weights_mb} MB per layer (untimed), "
          f"{args.rounds} interleaved rounds x {args.tokens} tokens, stat per round: {args.stat} (token times "
          f"and hot-layer call times), then the median over rounds [range]")
    rows = []
    for b in args.batch:
        for c in args.context:
            rows += bench_per_token(b, c, args.num_heads, args.num_kv_heads, args.head_size, args.block_size,
                                    args.kv_cache_dtype, layers, args.rounds, args.tokens, args.min_time,
                                    args.weights_mb, args.stat)
    hdr = (f"{'batch':>5} {'ctx':>6} {'kv dtype':>9} | {'hot 1-layer ms':>14} {'GB/s':>5} {'x fp32 [range]':>17} | "
           f"{'ms/token':>8} {'[range]':>15} {'GB/s':>5} {'x fp32 [range]':>17} | {'maxdiff':>7}")
    print()
    print(hdr)
    print("-" * len(hdr))

    def x(m):
        return f"{m['x_fp32']:5.2f} [{m['x_fp32_min']:4.2f}-{m['x_fp32_max']:4.2f}]" if "x_fp32" in m else "-"

    for r in rows:
        h, t = r["hot_layer"], r["per_token"]
        print(f"{r['batch']:>5} {r['context']:>6} {r['kv_cache_dtype']:>9} | {h['ms']:>14.4f} {h['gbps']:>5.1f} "
              f"{x(h):>17} | {t['ms_per_token']:>8.3f} {'[' + format(t['ms_min'], '.3f') + '-' + format(t['ms_max'], '.3f') + ']':>15} "
              f"{t['gbps']:>5.1f} {x(t):>17} | {r['max_abs_diff_vs_reference']:>7.1e}")
    record = {"benchmark": "decode_attention_kv_dtype_per_token",
              "shape": {"num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads, "head_size": args.head_size,
                        "block_size": args.block_size, "query_dtype": "float32"},
              "layers": layers, "weights_mb_per_layer": args.weights_mb, "rounds": args.rounds,
              "tokens_per_round": args.tokens, "hot_min_time_s": args.min_time, "stat_per_round": args.stat,
              "stat_over_rounds": "median", "argv": sys.argv[1:],
              "kernel_variant": native.kernel_variant(), "host": host, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "results": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


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
    p.add_argument("--layers", type=int, nargs="?", const=30, default=None,
                   help="per-token mode over this many layer caches (bare --layers: the default model's 30)")
    p.add_argument("--weights-mb", type=float, default=0.0,
                   help="per-token mode: MB of scratch read between two layers' calls (untimed), modelling the "
                        "layer's weights passing through the caches (default model, float32: 14.2)")
    p.add_argument("--rounds", type=int, default=3, help="per-token mode: interleaved sweeps over the dtypes")
    p.add_argument("--tokens", type=int, default=5, help="per-token mode: timed tokens per dtype and round")
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="per-token mode: per round, the median or the fastest token / hot call")
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
    if args.layers is not None:
        if args.layers < 1:
            p.error(f"--layers must be at least 1, got {args.layers}")
        return run_per_token(args, host)
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
