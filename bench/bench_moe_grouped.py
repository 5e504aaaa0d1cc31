"""A/B of the mixture-of-experts expert pass at Qwen3-30B-A3B's per-layer shape (hidden 2048, 128
experts of width 768, top-8; random weights, float32 experts on the ``native`` method, or with
``--quantization w8a8 --backend w8a8_native`` / ``w4a8`` ``w4a8_native`` quantized ones): the per-expert
path (``fused_moe.grouped_experts``: a Python loop over the touched experts, each a native GEMM call),
the one native call's per-expert loop (``per_expert=True``) and the one native call as it chooses
(``ops.native.moe_experts``: one parallel region for float32 or quantized experts), interleaved in one process over
``--layers`` layers (each its own weights, so a step streams them from DRAM as a model's would).

Per configuration: a decode step of ``--batch`` tokens and a ``--prompt``-token prefill, each timed as
the median of ``--reps`` interleaved repetitions of (old, new); also the router's own time and the
rows per expert. Prints one table (ratios new / old); machine-specific numbers belong in bench/results.

    PYTHONPATH=. python bench/bench_moe_grouped.py --layers 2 --reps 5
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def build_layers(n: int, hidden: int, width: int, experts: int, top_k: int, backend: str, scheme: str = "none",
                 group: int = 32):
    from appliance.models.moe import ARCHS, MoeConfig, SparseMoeBlock

    hf = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=32, hidden_size=hidden, intermediate_size=6144,
              moe_intermediate_size=width, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4,
              head_dim=128, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True)
    cfg = MoeConfig.from_hf(hf, ARCHS["Qwen3MoeForCausalLM"], "Qwen3MoeForCausalLM")
    layers = []
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        block = SparseMoeBlock(cfg)
        with torch.no_grad():
            block.gate.weight.normal_(0, 0.02, generator=g)
            for e in block.experts:
                for lin in (e.gate_up_proj, e.down_proj):
                    lin.weight.normal_(0, 0.02, generator=g)
        if scheme != "none":
            from appliance.layers import quant

            quant.quantize_model(block, scheme, group)
        for e in block.experts:
            for lin in (e.gate_up_proj, e.down_proj):
                lin.set_backend(backend)
        layers.append(block)
    return layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--backend", default="native", help="the experts' linear method (w8a8_native, w4a8_native "
                   "with --quantization)")
    p.add_argument("--quantization", default="none", choices=["none", "w8a8", "w4a8"],
                   help="quantize the experts first (appliance's quantize_model)")
    p.add_argument("--group", type=int, default=32, help="W4 group size (W8 is per channel)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--threads", default="", help="comma-separated thread counts to run in turn (default: torch's)")
    a = p.parse_args()

    from appliance.layers.forward_context import ForwardContext, set_forward_context
    from appliance.ops import native

    t = time.perf_counter()
    layers = build_layers(a.layers, a.hidden, a.width, a.experts, a.top_k, a.backend, a.quantization, a.group)
    print(f"built {a.layers} layers in {time.perf_counter() - t:.0f} s; kernels {native.kernel_variant()}, "
          f"threads {torch.get_num_threads()}")
    g = torch.Generator().manual_seed(1)

    real = native.moe_experts

    def step(x, fused: bool, loop: bool = False) -> float:
        """fused False: the Python per-expert path; True: the one native call (loop: its per-expert loop,
        each touched expert's kernels in turn, as before the one-region paths)."""
        native.FUSED_LAYERS = fused
        native.moe_experts = (lambda *args: real(*args, per_expert=True)) if loop else real
        t0 = time.perf_counter()
        try:
            for block in layers:
                block(x)
        finally:
            native.moe_experts = real
        return time.perf_counter() - t0

    def router_only(x) -> float:
        t0 = time.perf_counter()
        for block in layers:
            block.gate(x)
        return time.perf_counter() - t0

    rows = []
    for threads in [int(v) for v in a.threads.split(",") if v] or [torch.get_num_threads()]:
        torch.set_num_threads(threads)  # the extension's OpenMP regions share torch's runtime
        rows += measure(a, layers, step, router_only, g, threads)
    native.FUSED_LAYERS = True
    print(f"experts: {a.quantization} on {a.backend}; per-expert: the Python loop; native loop: one call, each "
          "touched expert's kernels in turn; one call: as the call chooses (one region where it can)")
    print(f"{'threads':>7} {'step':8} {'tokens':>6} {'experts hit':>11} {'per-expert ms':>14} {'native loop ms':>15} "
          f"{'one call ms':>12} {'one/per-exp':>11} {'one/loop':>9} {'router ms':>10} {'max |diff|':>10}")
    for threads, name, tokens, touched, o, lp, n, r, d in rows:
        print(f"{threads:7d} {name:8} {tokens:6d} {touched:11d} {o:14.1f} {lp:15.1f} {n:12.1f} {n / o:11.2f} "
              f"{n / lp:9.2f} {r:10.2f} {d:10.2g}")


def measure(a, layers, step, router_only, g, threads):
    from appliance.layers.forward_context import ForwardContext, set_forward_context
    from appliance.ops import native

    rows = []
    with set_forward_context(ForwardContext(None, [], native)), torch.inference_mode():
        for name, tokens in (("decode", a.batch), ("prefill", a.prompt)):
            xs = [torch.randn(tokens, a.hidden, generator=g) for _ in range(a.reps + 1)]
            step(xs[0], False), step(xs[0], True)  # warm-up
            # the same inputs give the same result either way (the same micro-kernel over the same rows)
            native.FUSED_LAYERS = False
            old_out = layers[0](xs[0])
            native.FUSED_LAYERS = True
            new = layers[0](xs[0])
            diff = (new - old_out).abs().max().item()
            old, loop, one, rt = [], [], [], []
            runs = ((old, lambda x: step(x, False)), (loop, lambda x: step(x, True, loop=True)),
                    (one, lambda x: step(x, True)))
            for i, x in enumerate(xs[1:]):  # rotating which runs first
                for j in range(3):
                    out, fn = runs[(i + j) % 3]
                    out.append(fn(x))
                rt.append(router_only(x))
            touched = len(torch.unique(layers[0].gate(xs[1])[2]))
            rows.append((threads, name, tokens, touched, statistics.median(old) * 1e3, statistics.median(loop) * 1e3,
                         statistics.median(one) * 1e3, statistics.median(rt) * 1e3, diff))
    return rows


if __name__ == "__main__":
    main()
