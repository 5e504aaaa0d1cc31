"""Gemma on the one-call native decoder stack against its per-op path, A/B in one process (issue 15's Gemma
on the fused stack): Gemma 3 1B's layer shape (bench_families' gemma3-1b: 26 layers, hidden 1152, MLP 6912,
4 heads / 1 KV head of 256, windows 512 on 5 of every 6 layers) with the vocabulary cut to 32768 so the
logits projection, the same on both paths, does not dilute the layers' difference (``--vocab`` sets it).

One model, loaded once with the native GEMM (no backend timing); ``ops.native.FUSED_LAYERS`` toggled
between rounds, A and B interleaved: batch-1 requests of PROMPT random ids, OUT greedy tokens, TPOT =
(last - first token time) / (OUT - 1); medians over the rounds; ratio = fused / per-op (lower is better).
On a shared host only the ratio means anything.

    .venv/bin/python bench/bench_gemma_fused.py [--layers 26] [--rounds 6] [--batch 1]
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

from bench.bench_families import PAIRS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--out-len", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from appliance import LLM, SamplingParams
    from appliance.bench.random_models import cached_random_model
    from appliance.ops import native

    family, cfg = PAIRS["gemma3-1b"][0]
    cfg = dict(cfg, num_hidden_layers=args.layers, vocab_size=args.vocab)
    path = cached_random_model(f"gemma3-1b-{family.lower()}-L{args.layers}-V{args.vocab}-v1", family, cfg, seed=0)
    llm = LLM(str(path), dtype="float32", linear_backend="native", attention_backend="native",
              num_threads=args.threads, enable_prefix_caching=False, max_num_seqs=max(16, args.batch),
              max_model_len=args.prompt_len + args.out_len + 16)
    eng, model = llm.engine, llm.engine.runner.model
    rng = random.Random(7)
    sp = SamplingParams(temperature=0, max_tokens=args.out_len, ignore_eos=True)

    def run() -> list[float]:
        stamps = {eng.add_request(None, [rng.randrange(100, args.vocab) for _ in range(args.prompt_len)], sp): []
                  for _ in range(args.batch)}
        live = set(stamps)
        while live:
            for o in eng.step():
                now = time.perf_counter()
                s = stamps[o.request_id]
                s += [now] * (len(o.outputs[0].token_ids) - len(s))
                if o.finished:
                    live.discard(o.request_id)
        return [(s[-1] - s[0]) / (len(s) - 1) * 1e3 for s in stamps.values()]

    tpot = {"fused": [], "per_op": []}
    run()  # warm-up (first touch of the packed weights)
    for r in range(args.rounds):
        for which in (("fused", "per_op") if r % 2 == 0 else ("per_op", "fused")):
            native.FUSED_LAYERS = which == "fused"
            before = model.fused_calls
            tpot[which] += run()
            assert (model.fused_calls > before) == (which == "fused"), which
    med = {k: statistics.median(v) for k, v in tpot.items()}
    print(json.dumps({"layers": args.layers, "vocab": args.vocab, "batch": args.batch, "rounds": args.rounds,
                      "tpot_ms_median": med, "ratio_fused_over_per_op": med["fused"] / med["per_op"],
                      "tpot_ms": tpot}, indent=1))


if __name__ == "__main__":
    main()
