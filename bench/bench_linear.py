"""Dense and quantized linear backends end to end: decode tokens/s, TTFT and weight memory for
float (F.linear), prepacked float (oneDNN), W8A8 and W4A8 (backends chosen by measurement, `auto`),
at 1 and 16 concurrent requests, on the default model (SmolLM2-135M) and on a random-weight model of
Qwen2.5-0.5B's shape (transformers Qwen2Config with its dimensions, saved to a temp dir).

Run it with nothing else on the machine (prints a table, writes a JSON record):

    .venv/bin/python bench/bench_linear.py --json bench/results/linear.json
    .venv/bin/python bench/bench_linear.py --smoke          # seconds: tiny lengths, default model only

TTFT is the wall time until every one of the concurrent requests has its first token (their prompts
prefill together); decode tokens/s is concurrency * (out_len - 1) over the extra time a run of
out_len tokens takes (medians of 3 runs each). Weight memory is what the forward pass reads: the
linear layers as packed plus embeddings and norms (the float lm_head/embedding dominates small models),
and the linear layers alone (the decoder projections, which W8/W4 quantize; lm_head stays float).

W4 runs at group size 32 (the default): its fp32/bf16 group scales and zero points cost 4-8 bytes per
32 weights, so its linear layers come out ~6.4x smaller than fp32, not 8x. For the w4a8 rows the
bench also measures the same layers channel-wise (group size = in_features), packed by each W4
backend from random weights of every layer's shape, and in the canonical form (4-bit integers, one
fp32 scale and zero point per output row: the checkpoint layout, and within a few bytes per row
what KleidiAI packs on aarch64). The x86 fallback of ``w4a8_dynquant`` packs fp32 weights, so its
figure on x86 is not the Arm one.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from appliance import LLM, SamplingParams
from appliance.layers.linear import LinearBase, weight_bytes

CONFIGS = {
    "float": {"linear_backend": "torch"},
    "prepacked": {"linear_backend": "onednn"},
    "w8a8": {"quantization": "w8a8"},
    "w4a8": {"quantization": "w4a8"},
}
# Qwen2.5-0.5B (Qwen/Qwen2.5-0.5B config.json)
QWEN05 = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
              "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
              "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "bos_token_id": 151643,
              "eos_token_id": 151643}


def qwen05_dir(tmp: Path) -> Path:
    from appliance.bench.random_models import write_random_model

    return write_random_model(tmp / "qwen2.5-0.5b-shape", "Qwen2", QWEN05, seed=0)


def w4_channelwise_linear_bytes(model: torch.nn.Module, linear_bytes: int) -> dict[str, int]:
    """``linear_bytes`` (the linear layers as run) with the W4 layers re-measured channel-wise: per W4
    backend that takes every layer's shape (packing random weights of that shape), and "canonical"
    (n * in / 2 bytes of integers plus an fp32 scale and zero point per output row)."""
    from appliance.layers import quant

    layers = [m for m in model.modules() if isinstance(m, quant.QuantLinear) and m.scheme == "w4a8"]
    others = linear_bytes - sum(m.weight_bytes() for m in layers)
    out: dict[str, int | None] = {"canonical": others, **{b: others for b in quant.BACKENDS["w4a8"]}}
    packed: dict[tuple, int] = {}
    for m in layers:
        n, k = m.out_features, m.in_features
        bias = m.bias.numel() * m.bias.element_size() if m.bias is not None else 0
        out["canonical"] += n * k // 2 + 8 * n + bias
        for b in quant.BACKENDS["w4a8"]:
            if out[b] is None:
                continue
            if not quant.backend_valid(b, "w4a8", n, k, k):
                out[b] = None
                continue
            if (b, n, k) not in packed:
                q, s, zp = quant.quantize_int4(torch.randn(n, k) * 0.02, k)
                packed[b, n, k] = quant.packed_bytes(quant.pack(b, q, s, zp))
            out[b] += packed[b, n, k] + bias
    return {b: v for b, v in out.items() if v is not None}


def measure(model: str | None, kw: dict, prompt_len: int, out_len: int, concurrency: int, dtype: str,
            reps: int = 3) -> dict:
    llm = LLM(model, dtype=dtype, max_model_len=prompt_len + out_len + 8, kv_cache_memory=0.5,
              enable_prefix_caching=False, **kw)
    runner = llm.engine.runner
    vocab = runner.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, min(vocab, 30000), (prompt_len,), generator=g).tolist() for _ in range(concurrency)]
    warm = [p[: max(8, prompt_len // 4)] for p in prompts[:2]]
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True))

    def timed(n: int) -> float:
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return time.perf_counter() - t

    ttft = statistics.median(timed(1) for _ in range(reps))
    total = statistics.median(timed(out_len) for _ in range(reps))
    linear = sum(m.weight_bytes() for m in runner.model.modules()
                 if isinstance(m, LinearBase) and not getattr(m, "keep_weight", False))
    res = {"ttft_s": ttft, "decode_tok_s": concurrency * (out_len - 1) / max(total - ttft, 1e-6),
           "weight_bytes": weight_bytes(runner.model), "linear_weight_bytes": linear,
           "backends": sorted(set(runner.linear_backends.values()))}
    if kw.get("quantization") == "w4a8":
        res["w4_channelwise_linear_weight_bytes"] = w4_channelwise_linear_bytes(runner.model, linear)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--models", nargs="+", default=["default", "qwen2.5-0.5b-shape"])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--smoke", action="store_true", help="tiny lengths, default model only")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.smoke:
        args.prompt_len, args.out_len, args.models = 16, 6, ["default"]
    arm = platform.machine().lower() in ("aarch64", "arm64")
    tmp = Path(tempfile.mkdtemp(prefix="bench-linear-"))
    rows = []
    try:
        for name in args.models:
            path = None if name == "default" else str(qwen05_dir(tmp))
            for c in args.concurrency:
                base = None
                for cfg in args.configs:
                    r = measure(path, CONFIGS[cfg], args.prompt_len, args.out_len, c, args.dtype)
                    gc.collect()  # the engine of the previous configuration
                    base = base or r
                    r.update(model=name, config=cfg, concurrency=c,
                             decode_x_float=r["decode_tok_s"] / base["decode_tok_s"],
                             ttft_x_float=base["ttft_s"] / r["ttft_s"],
                             memory_x_smaller=base["weight_bytes"] / r["weight_bytes"],
                             linear_memory_x_smaller=base["linear_weight_bytes"] / r["linear_weight_bytes"])
                    channelwise = ""
                    if "w4_channelwise_linear_weight_bytes" in r:
                        r["w4_channelwise_linear_memory_x_smaller"] = {
                            b: base["linear_weight_bytes"] / v for b, v in r["w4_channelwise_linear_weight_bytes"].items()}
                        channelwise = "  channel-wise W4: linear layers " + ", ".join(
                            f"/{x:.2f} {b}" + (" (x86 fallback: fp32)" if b == "w4a8_dynquant" and not arm else "")
                            for b, x in r["w4_channelwise_linear_memory_x_smaller"].items())
                    rows.append(r)
                    print(f"{name:20s} c={c:<3d} {cfg:10s} decode {r['decode_tok_s']:8.1f} tok/s "
                          f"(x{r['decode_x_float']:.2f})  TTFT {r['ttft_s'] * 1e3:8.1f} ms (x{r['ttft_x_float']:.2f})  "
                          f"weights {r['weight_bytes'] / 2**20:7.1f} MiB (/{r['memory_x_smaller']:.2f}; "
                          f"linear layers /{r['linear_memory_x_smaller']:.2f})  "
                          f"{','.join(r['backends'])}{channelwise}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    from appliance.runtime.cpu_features import detect

    record = {"bench": "linear", "cpu": detect().model_name, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "prompt_len": args.prompt_len, "out_len": args.out_len,
              "dtype": args.dtype, "rows": rows}
    print(json.dumps(record))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
