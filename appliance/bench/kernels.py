"""Kernel rates against this machine's limits (a roofline): GEMM GFLOP/s of every linear layer shape
of a model at decode and prefill row counts for each linear backend, paged-attention KV read GB/s,
and the two limits they are held against, both measured here: peak GEMM GFLOP/s (a large square
GEMM) and memory bandwidth (a large multi-threaded copy, bytes read + written).

A GEMM's roofline is ``min(peak, bandwidth x arithmetic intensity)`` with the intensity counted over
the bytes of A, B and C once each; decode shapes (few rows) sit on the bandwidth slope. The peak
is the best of the square GEMM and every GEMM measured, so no fraction of it passes 1. The bandwidth
is DRAM's (a copy far larger than the caches): a small model's decode GEMM whose weight stays in
cache can beat its roofline (a fraction above 1 says exactly that).
"""
from __future__ import annotations

import time

import torch


def timeit(fn, min_time: float, min_iters: int = 3, max_iters: int = 1000) -> float:
    """Best seconds of ``fn()`` over at least ``min_iters`` calls and ``min_time`` seconds: a kernel's
    capability, not its luck with the OS scheduler (a shared host preempts for whole 4-8 ms ticks)."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_iters or (time.perf_counter() - start < min_time and len(times) < max_iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def peak_gemm_gflops(dtype: torch.dtype, n: int = 2048, reps: int = 3) -> float:
    """Best-of-``reps`` GFLOP/s of an ``n`` x ``n`` x ``n`` GEMM with torch's threads, the faster of
    ``torch.mm`` and oneDNN with a prepacked weight (on AMD CPUs torch's BLAS may take a narrower
    code path than oneDNN, so ``torch.mm`` alone can understate the machine)."""
    from appliance.layers.linear import onednn_available

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    candidates = [lambda: torch.mm(a, b)]
    if onednn_available(dtype, torch.device("cpu")):
        packed = torch.ops.mkldnn._reorder_linear_weight(b, n)
        candidates.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    best = float("inf")
    for fn in candidates:
        fn()
        best = min(best, min(_once(fn) for _ in range(reps)))
    return 2 * n ** 3 / best / 1e9


def _once(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def memory_bandwidth_gbps(nbytes: int = 256 << 20, min_time: float = 0.3) -> float:
    """GB/s of torch's multi-threaded copy, counting bytes read + bytes written."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), min_time)
    return 2 * nbytes / t / 1e9


def linear_shapes(hf: dict) -> dict[str, tuple[int, int]]:
    """Layer name -> (N out features, K in features) of a Llama-family model's linear layers."""
    h, i = hf["hidden_size"], hf["intermediate_size"]
    hq = hf["num_attention_heads"]
    hkv = hf.get("num_key_value_heads") or hq
    d = hf.get("head_dim") or h // hq
    return {"qkv_proj": ((hq + 2 * hkv) * d, h), "o_proj": (h, hq * d), "gate_up_proj": (2 * i, h),
            "down_proj": (h, i), "lm_head": (hf["vocab_size"], h)}


def roofline(m: int, n: int, k: int, dtype: torch.dtype, peak: float, bw: float) -> float:
    """GFLOP/s bound of an (m x k) @ (k x n) GEMM: peak, or bandwidth x FLOP per byte of A, B, C."""
    elt = torch.empty(0, dtype=dtype).element_size()
    return min(peak, bw * 2 * m * n * k / ((m * k + n * k + m * n) * elt))


def linear_backends(dtype: torch.dtype) -> list[str]:
    from appliance.layers.linear import float_candidates

    return float_candidates(dtype, torch.device("cpu"))


def _linear_fn(backend: str, w: torch.Tensor):
    from appliance.layers import methods

    m = methods.get(backend)
    p = m.pack(w, None)
    return lambda x: m.apply(p, x)


def bench_gemm(shapes: dict[str, tuple[int, int]], rows: dict[str, list[int]], dtype: torch.dtype,
               backends: list[str], peak: float, bw: float, min_time: float) -> list[dict]:
    """``rows``: phase -> row counts (``{"decode": [1, 16], "prefill": [512]}``)."""
    out = []
    with torch.inference_mode():
        for layer, (n, k) in shapes.items():
            w = (torch.randn(n, k) * 0.02).to(dtype)
            for backend in backends:
                f = _linear_fn(backend, w)
                for phase, ms in rows.items():
                    for m in ms:
                        x = torch.randn(m, k).to(dtype)
                        t = timeit(lambda: f(x), min_time)
                        g = 2 * m * n * k / t / 1e9
                        roof = roofline(m, n, k, dtype, peak, bw)
                        out.append({"backend": backend, "layer": layer, "phase": phase, "m": m, "n": n, "k": k,
                                    "seconds": t, "gflops": g, "roofline_gflops": roof,
                                    "fraction_of_peak": g / peak, "fraction_of_roofline": g / roof})
    return out


def bench_attention(hf: dict, batches: list[int], contexts: list[int], dtype: torch.dtype, bw: float,
                    min_time: float, block_size: int = 16) -> list[dict]:
    """Decode paged attention (one new token per sequence, scattered blocks) per ops backend."""
    from appliance.ops import reference

    backends = [("reference", reference)]
    try:
        from appliance.ops import native

        if native.is_available():
            backends.insert(0, ("native", native))
    except ImportError:
        pass
    hq = hf["num_attention_heads"]
    hkv = hf.get("num_key_value_heads") or hq
    d = hf.get("head_dim") or hf["hidden_size"] // hq
    out = []
    g = torch.Generator().manual_seed(0)
    for batch in batches:
        for ctx in contexts:
            nb = -(-ctx // block_size)
            num_blocks = batch * nb
            shape = reference.kv_cache_shape(num_blocks, block_size, hkv, d)
            kc, vc = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
            table = torch.randperm(num_blocks, generator=g).to(torch.int32).view(batch, nb)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
            qsl = torch.arange(batch + 1, dtype=torch.int32)
            q = torch.randn(batch, hq, d, generator=g).to(dtype)
            scale = d ** -0.5
            kv_bytes = 2 * batch * hkv * ctx * d * kc.element_size()
            for name, ops in backends:
                t = timeit(lambda: ops.paged_attention(q, kc, vc, table, seq_lens, qsl, scale, 1), min_time)
                gbps = kv_bytes / t / 1e9
                out.append({"backend": name, "batch": batch, "context": ctx, "seconds": t, "gbps": gbps,
                            "fraction_of_bandwidth": gbps / bw})
    return out


def run_kernels(hf: dict, dtype: torch.dtype, decode_rows: list[int], prefill_rows: list[int],
                contexts: list[int], min_time: float, peak_n: int, bandwidth_mb: int) -> dict:
    """Keys fixed by ``schema.RESULTS['kernels']``."""
    peak = peak_gemm_gflops(dtype, peak_n)
    bw = memory_bandwidth_gbps(bandwidth_mb << 20)
    gemm = bench_gemm(linear_shapes(hf), {"decode": decode_rows, "prefill": prefill_rows}, dtype,
                      linear_backends(dtype), peak, bw, min_time)
    peak = max([peak] + [g["gflops"] for g in gemm])  # a layer beating the square GEMM raises the bar
    for g in gemm:
        g["roofline_gflops"] = roofline(g["m"], g["n"], g["k"], dtype, peak, bw)
        g["fraction_of_peak"], g["fraction_of_roofline"] = g["gflops"] / peak, g["gflops"] / g["roofline_gflops"]
    attn = bench_attention(hf, decode_rows, contexts, dtype, bw, min_time)
    return {"peak_gemm_gflops": peak, "memory_bandwidth_gbps": bw, "dtype": str(dtype).replace("torch.", ""),
            "gemm": gemm, "attention": attn}
