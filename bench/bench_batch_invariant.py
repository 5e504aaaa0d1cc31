"""What --batch-invariant costs: the same model loaded with and without it in one process, measured in
alternating rounds (the host's drift falls on both): prefill (prompt tokens/s: prompts of --input-len
tokens, one output token each, prefix caching off), batch-1 decode and batch-16 decode (tok/s per
request and aggregate, greedy, --output-len tokens). Also says whether the greedy texts of the two
engines are the same (they may not be: the mode changes which kernels sum the rows; what it
guarantees is that a request's text does not depend on the batch, tests/spec_decode/test_batch_invariant.py).

    PYTHONPATH=. .venv/bin/python bench/bench_batch_invariant.py --json bench/results/batch_invariant.json
    PYTHONPATH=. .venv/bin/python bench/bench_batch_invariant.py -e quantization=gguf   # the GGUF's own Q4_1
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def prefill_tok_s(llm, prompts: list[list[int]]) -> float:
    from appliance import SamplingParams

    t = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return sum(map(len, prompts)) / (time.perf_counter() - t)


def main() -> None:
    from appliance import LLM
    from appliance.bench.common import new_record, parse_engine_args
    from appliance.bench.spec import run_requests

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-e", "--engine-arg", action="append", default=[], help="EngineConfig field NAME=VALUE")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    kw = parse_engine_args(a.engine_arg)  # typed as EngineConfig declares them
    engines = {mode: LLM(a.model, enable_prefix_caching=False, batch_invariant=mode == "invariant", **kw)
               for mode in ("default", "invariant")}
    vocab = engines["default"].engine.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, vocab, (a.input_len,), generator=g).tolist() for _ in range(a.num_prompts)]
    short = prompts[0][:32]
    res = {m: {"prefill_tok_s": [], "decode_b1_tok_s": [], "decode_b16_tok_s": [], "aggregate_b16_tok_s": []}
           for m in engines}
    texts = {}
    for m, llm in engines.items():  # warm-up: first calls of each shape are slow
        prefill_tok_s(llm, prompts[:2])
        run_requests(llm, [short], 4, ignore_eos=True)
    for r in range(a.rounds):
        for m, llm in engines.items():
            res[m]["prefill_tok_s"].append(prefill_tok_s(llm, prompts))
            b1 = run_requests(llm, [short], a.output_len, ignore_eos=True)
            res[m]["decode_b1_tok_s"].append(b1["decode_tok_s"])
            texts[m] = b1["token_ids"][0]
            b16 = run_requests(llm, [p[:64] for p in prompts] * 2, a.output_len, ignore_eos=True)
            res[m]["decode_b16_tok_s"].append(b16["decode_tok_s"])
            res[m]["aggregate_b16_tok_s"].append(b16["output_tok_s"])
            print(f"round {r} {m:9s} prefill {res[m]['prefill_tok_s'][-1]:8.1f} tok/s  b1 decode "
                  f"{b1['decode_tok_s']:7.1f} tok/s  b16 decode {b16['decode_tok_s']:6.1f} tok/s/req "
                  f"(aggregate {b16['output_tok_s']:7.1f})", flush=True)
    print(f"\n{a.input_len}-token prompts x {a.num_prompts}, {a.output_len} output tokens, {torch.get_num_threads()} "
          f"threads, engine args {kw or '-'}; median of {a.rounds} rounds; invariant / default")
    print(f"{'measure':22s} {'default':>10s} {'invariant':>10s} {'ratio':>7s}")
    rows = {}
    for key in res["default"]:
        d, i = statistics.median(res["default"][key]), statistics.median(res["invariant"][key])
        rows[key] = {"default": d, "invariant": i, "ratio": i / d}
        print(f"{key:22s} {d:10.1f} {i:10.1f} {i / d:7.2f}x")
    same = texts["default"] == texts["invariant"]
    print(f"batch-1 greedy text of the two engines: {'the same' if same else 'different'}")
    print("linear methods:", {m: llm.engine.runner.linear_backends for m, llm in engines.items()})
    if a.json:
        rec = new_record("batch_invariant", {"model": a.model, "input_len": a.input_len, "num_prompts": a.num_prompts,
                                             "output_len": a.output_len, "rounds": a.rounds, "engine": kw},
                         {"medians": rows, "rounds": res, "same_text": same,
                          "linear_backends": {m: llm.engine.runner.linear_backends for m, llm in engines.items()}})
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
