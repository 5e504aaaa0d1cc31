"""One MoE layer's experts at Qwen3-30B-A3B's shape (hidden 2048, 128 experts of width 768, top-8) through
``ops.native.moe_experts`` on quantized methods: time per call at 1 and 16 tokens and the bytes of the
experts the routing touched (weights and their scales, as the plan holds them), so that a method's
time can be read per byte streamed. Random weights ~N(0, 0.02), random distinct routing per token.

With ``--threads 1`` the time is the calling thread's CPU time (``time.thread_time``: the native call
runs on that thread, and time the OS gives to other processes is not counted), which keeps A/B runs
comparable on a shared host; with more threads it is wall time.

    PYTHONPATH=. .venv/bin/python bench/bench_moe_experts.py --threads 1 --schemes w8a8 w4a8
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from appliance.layers import quant  # noqa: E402
from appliance.layers.fused_moe import native_plan  # noqa: E402
from appliance.models.moe import ARCHS, MoeConfig, SparseMoeBlock  # noqa: E402
from appliance.ops import native  # noqa: E402


def build_plan(scheme: str, hidden: int, width: int, experts: int, top_k: int, group: int):
    hf = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=32, hidden_size=hidden, intermediate_size=64,
              moe_intermediate_size=width, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True)
    cfg = MoeConfig.from_hf(hf, ARCHS["Qwen3MoeForCausalLM"], "Qwen3MoeForCausalLM")
    torch.manual_seed(0)
    block = SparseMoeBlock(cfg)
    with torch.no_grad():
        for e in block.experts:
            e.gate_up_proj.weight.normal_(0, 0.02)
            e.down_proj.weight.normal_(0, 0.02)
    quant.quantize_model(block, scheme, group)
    for e in block.experts:
        e.gate_up_proj.set_backend(scheme + "_native")
        e.down_proj.set_backend(scheme + "_native")
    plan = native_plan(block.experts)
    if plan is None:
        raise SystemExit(f"{scheme}: the experts have no native plan on this host")
    return plan


def touched_mb(plan, experts: int, ids: torch.Tensor) -> float:
    flat, _ = plan
    per = len(flat) // experts
    return sum(t.numel() * t.element_size() for e in set(ids.reshape(-1).tolist())
               for t in flat[e * per:(e + 1) * per]) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", nargs="+", default=["w8a8", "w4a8"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--calls", type=int, default=5, help="calls timed per rep")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--group", type=int, default=32, help="W4 group size (W8 is per channel)")
    a = ap.parse_args()
    hidden, width, top_k = 2048, 768, 8
    torch.set_num_threads(a.threads)
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    plans = {s: build_plan(s, hidden, width, a.experts, top_k, a.group) for s in a.schemes}
    g = torch.Generator().manual_seed(0)
    times: dict[tuple[str, int], list[float]] = {}
    mb: dict[tuple[str, int], list[float]] = {}
    for _ in range(a.reps):
        for t in (1, 16):  # schemes interleaved within each rep, on the same routing
            x = torch.randn(t, hidden, generator=g)
            ids = torch.stack([torch.randperm(a.experts, generator=g)[:top_k] for _ in range(t)])
            w = torch.rand(t, top_k, generator=g)
            for s in a.schemes:
                flat, kinds = plans[s]
                native.moe_experts(x, ids, w, flat, kinds, width)
                t0 = clock()
                for _ in range(a.calls):
                    native.moe_experts(x, ids, w, flat, kinds, width)
                times.setdefault((s, t), []).append((clock() - t0) / a.calls * 1e3)
                mb.setdefault((s, t), []).append(touched_mb(plans[s], a.experts, ids))
    print(f"threads {a.threads} ({'thread CPU time' if a.threads == 1 else 'wall time'}), {a.experts} experts, "
          f"top-{top_k}, hidden {hidden}, width {width}; {a.reps} reps of {a.calls} calls")
    print(f"{'scheme':8s} {'tokens':>6s} {'ms median':>10s} {'ms min':>8s} {'touched MB':>11s} {'GB/s (median)':>14s}  all ms")
    for (s, t), v in sorted(times.items()):
        m = statistics.median(v)
        mbm = statistics.median(mb[(s, t)])
        print(f"{s:8s} {t:6d} {m:10.2f} {min(v):8.2f} {mbm:11.1f} {mbm / m:14.1f}  " + " ".join(f"{x:.1f}" for x in v))


if __name__ == "__main__":
    main()
