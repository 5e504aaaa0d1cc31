"""Mixture of experts against a dense model with the same active parameters: decode time per output
token at batch 1 and 16, side by side, with the ratio (issue 15's target: MoE within 1.5x of dense).

Models (random weights, transformers' init, written once under ~/.cache/appliance/bench-models):
- MoE: Qwen3-MoE at Qwen3-30B-A3B's per-layer shape (hidden 2048, 128 experts, top-8, expert width
  768, 32 heads, 4 KV heads, head_dim 128, norm_topk_prob) with few layers (default 4) and a small
  vocabulary (default 4096);
- dense: Qwen3 with the same attention and intermediate_size = top_k * expert width (8 * 768 = 6144),
  i.e. the MLP parameters each token reads in the MoE model.

Per batch size B: B random-token prompts of --prompt-len tokens, greedy, ignore_eos. A run of 1 output
token (prefill only) and one of --out-len tokens: decode step time = (t_out - t_1) / (out_len - 1);
each step gives one token per sequence, so that is the time per output token a sequence sees (vLLM's
TPOT), and B / it the throughput. Best of --reps. At batch 16 the MoE reads the weights of every
expert any of the 16 tokens picked (about 80 of 128 at random routing): more than the dense model's,
which is the cost the ratio shows.

Smoke (tiny shapes, seconds):
    .venv/bin/python bench/bench_moe.py --tiny --json /tmp/moe-smoke.json
The real run (alone on the machine; writes ~10 GB of float32 weights the first time at 4 layers):
    .venv/bin/python bench/bench_moe.py --json bench/results/moe_qwen3_30b_a3b_shape.json
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import time

SHAPE = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
             num_attention_heads=32, num_key_value_heads=4, head_dim=128)
TINY = dict(hidden_size=128, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def configs(shape: dict, layers: int, vocab: int) -> tuple[dict, dict]:
    """(Qwen3-MoE config, dense Qwen3 config with the same active MLP width)."""
    common = dict(vocab_size=vocab, hidden_size=shape["hidden_size"], num_hidden_layers=layers,
                  num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
                  head_dim=shape["head_dim"], max_position_embeddings=4096, tie_word_embeddings=False,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    moe = dict(common, num_experts=shape["num_experts"], num_experts_per_tok=shape["num_experts_per_tok"],
               moe_intermediate_size=shape["moe_intermediate_size"], norm_topk_prob=True,
               intermediate_size=shape["num_experts_per_tok"] * shape["moe_intermediate_size"])
    dense = dict(common, intermediate_size=shape["num_experts_per_tok"] * shape["moe_intermediate_size"])
    return moe, dense


def machine() -> dict:
    import torch

    from appliance.runtime.cpu_features import detect

    f = detect()
    return {"cpu": f.model_name, "arch": f.arch, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}


def decode_times(llm, batch: int, prompt_len: int, out_len: int, vocab: int, reps: int) -> dict:
    from appliance import SamplingParams

    rng = random.Random(batch)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]

    def run(n: int) -> float:
        llm.engine.kv.pool.reset_prefix_cache()  # every run prefills from scratch
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        return time.perf_counter() - t

    run(2)  # warm-up (first-call allocations, backend packing caches)
    prefill = min(run(1) for _ in range(reps))
    full = min(run(out_len) for _ in range(reps))
    step = max(full - prefill, 1e-9) / (out_len - 1)
    return {"batch": batch, "prefill_s": prefill, "decode_step_s": step, "tpot_ms": 1e3 * step,
            "output_tok_s": batch / step}


def bench_model(path, args) -> list[dict]:
    from appliance import LLM

    llm = LLM(str(path), dtype="float32", quantization=args.quantization,
              num_kv_blocks=max(64, (args.prompt_len + args.out_len) * max(args.batches) // 16 + 16),
              max_model_len=args.prompt_len + args.out_len + 8)
    out = [decode_times(llm, b, args.prompt_len, args.out_len, args.vocab, args.reps) for b in args.batches]
    from appliance.layers.linear import weight_bytes

    for r in out:
        r["weight_bytes"] = weight_bytes(llm.engine.runner.model)
        r["linear_backends"] = dict(llm.engine.runner.linear_groups)
    del llm
    return out


def table(record: dict) -> str:
    lines = [f"MoE (Qwen3-MoE, {record['shape']}) vs dense (same active MLP width), {record['layers']} layers, "
             f"vocab {record['vocab']}, prompt {record['prompt_len']}, {record['out_len']} output tokens, "
             f"quantization {record['quantization']}, {record['machine']['threads']} threads",
             f"{'batch':>5} | {'MoE TPOT ms':>11} | {'dense TPOT ms':>13} | {'MoE/dense':>9} | "
             f"{'MoE tok/s':>9} | {'dense tok/s':>11}"]
    for r in record["rows"]:
        lines.append(f"{r['batch']:>5} | {r['moe_tpot_ms']:>11.2f} | {r['dense_tpot_ms']:>13.2f} | "
                     f"{r['ratio']:>9.2f} | {r['moe_tok_s']:>9.1f} | {r['dense_tok_s']:>11.1f}")
    lines.append("MoE/dense: decode time per output token, MoE over dense (lower is better; target <= 1.5)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--out-len", type=int, default=33)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quantization", default="none", choices=["none", "w8a8", "w4a8"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run of the script itself")
    ap.add_argument("--json", help="write the record here")
    args = ap.parse_args()

    from appliance.bench.random_models import cached_random_model

    shape = TINY if args.tiny else SHAPE
    moe_cfg, dense_cfg = configs(shape, args.layers, args.vocab)
    tag = f"{'tiny' if args.tiny else 'a3b'}-L{args.layers}-V{args.vocab}"
    moe_path = cached_random_model(f"qwen3moe-{tag}", "Qwen3Moe", moe_cfg)
    dense_path = cached_random_model(f"qwen3dense-{tag}", "Qwen3", dense_cfg)
    moe, dense = bench_model(moe_path, args), bench_model(dense_path, args)
    rows = [{"batch": m["batch"], "moe_tpot_ms": m["tpot_ms"], "dense_tpot_ms": d["tpot_ms"],
             "ratio": m["tpot_ms"] / d["tpot_ms"], "moe_tok_s": m["output_tok_s"], "dense_tok_s": d["output_tok_s"],
             "moe": m, "dense": d} for m, d in zip(moe, dense)]
    record = {"bench": "moe", "shape": "tiny" if args.tiny else "Qwen3-30B-A3B per layer", "shape_dims": shape,
              "layers": args.layers, "vocab": args.vocab, "prompt_len": args.prompt_len, "out_len": args.out_len,
              "reps": args.reps, "quantization": args.quantization, "machine": machine(), "rows": rows,
              "target_ratio": 1.5}
    print(table(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
