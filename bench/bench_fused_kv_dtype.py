"""Batch-1 decode on the one-call native decoder stack with a quantized KV cache (issue 19): TPOT of
fused + int8 (or another --kv-cache-dtype) KV against per-op + the same KV and against fused + the model's
own (float) KV, A/B/C interleaved in one process.

Model: the default model (SmolLM2-135M-Instruct, 30 layers, 9 query / 3 KV heads of 64) unless --model.
Two engines are loaded once (the quantized-KV one and the float-KV one, same weights and linear backends);
the per-op rounds toggle ``ops.native.FUSED_LAYERS`` on the quantized one. Each context length: one prompt
of that many random ids, prefilled once per engine (prefix caching keeps it; later rounds decode straight
from the cached blocks), then per round and setting a greedy request of OUT tokens; TPOT = (last - first
token time) / (OUT - 1); medians and minima over the rounds; ratios against per-op + quantized KV. On a shared
host only the ratios mean anything (and the minima's more than the medians' when other work comes and goes).

    .venv/bin/python bench/bench_fused_kv_dtype.py [--kv-cache-dtype int8] [--context 256 2048] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--kv-cache-dtype", default="int8", choices=["int8", "fp8_e4m3", "fp8_e5m2", "bfloat16"])
    ap.add_argument("--context", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args()

    from appliance import LLM, SamplingParams
    from appliance.ops import native

    assert native.is_available(), native.unavailable_reason()
    max_len = max(args.context) + args.out_len + 16
    blocks = 2 * (max_len // 16 + 2) * len(args.context) + 64
    common = dict(attention_backend="native", num_threads=args.threads, enable_prefix_caching=True,
                  max_model_len=max_len, num_kv_blocks=blocks)
    engines = {"quant": LLM(args.model, kv_cache_dtype=args.kv_cache_dtype, **common).engine,
               "float": LLM(args.model, **common).engine}
    print(json.dumps({k: str(e.runner.kv_cache.dtype) for k, e in engines.items()}), file=sys.stderr)
    # setting -> (engine, FUSED_LAYERS)
    settings = {f"fused_{args.kv_cache_dtype}": ("quant", True), f"per_op_{args.kv_cache_dtype}": ("quant", False),
                "fused_float": ("float", True)}
    vocab = engines["quant"].vocab_size
    sp = SamplingParams(temperature=0, max_tokens=args.out_len, ignore_eos=True)

    def run(eng, prompt) -> float:
        rid = eng.add_request(None, prompt, sp)
        stamps: list[float] = []
        done = False
        while not done:
            for o in eng.step():
                if o.request_id != rid:
                    continue
                stamps += [time.perf_counter()] * (len(o.outputs[0].token_ids) - len(stamps))
                done = o.finished
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3

    result = {"model": args.model or "default", "kv_cache_dtype": args.kv_cache_dtype, "rounds": args.rounds,
              "out_len": args.out_len, "contexts": {}}
    for ctx in args.context:
        rng = random.Random(ctx)
        prompt = [rng.randrange(100, vocab) for _ in range(ctx)]
        tpot: dict[str, list[float]] = {s: [] for s in settings}
        names = list(settings)
        for s in names:  # prefill into each engine's prefix cache, warm up both paths
            native.FUSED_LAYERS = settings[s][1]
            run(engines[settings[s][0]], prompt)
        for r in range(args.rounds):
            for s in names[r % 3:] + names[:r % 3]:  # rotate the order each round
                which, fused = settings[s]
                native.FUSED_LAYERS = fused
                model = engines[which].runner.model
                before = model.fused_calls
                tpot[s].append(run(engines[which], prompt))
                assert (model.fused_calls > before) == fused, s  # the path that was meant ran
        native.FUSED_LAYERS = True
        med = {s: statistics.median(v) for s, v in tpot.items()}
        low = {s: min(v) for s, v in tpot.items()}
        base, base_low = med[f"per_op_{args.kv_cache_dtype}"], low[f"per_op_{args.kv_cache_dtype}"]
        result["contexts"][ctx] = {"tpot_ms_median": med, "tpot_ms_min": low,
                                   "speedup_vs_per_op_quant": {s: base / m for s, m in med.items()},
                                   # under contention the minima are the least disturbed rounds
                                   "speedup_vs_per_op_quant_min": {s: base_low / m for s, m in low.items()},
                                   "tpot_ms": tpot}
        print(json.dumps({ctx: {k: result["contexts"][ctx][k] for k in
                                ("speedup_vs_per_op_quant", "speedup_vs_per_op_quant_min")}}), file=sys.stderr)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
