"""Streaming users behind prefill: the same concurrent workload against `appliance serve` with the
step-latency cap off and on (``--itl-target off`` vs ``auto`` or a value), side by side in one run.

At high concurrency new prompts keep arriving while others decode; without a cap a step fills its
whole token budget with prompts and every running stream freezes for that step. The table shows,
per setting, output tokens/s, TTFT and the inter-token latency (p50, p99, p99/p50), and the ratios
capped/uncapped (target: p99 ITL at most 3x its median, output tok/s within 10%).

    .venv/bin/python bench/bench_itl.py [--model PATH] [--concurrency 64] [--input-len 128] \\
        [--output-len 128] [--targets off,auto] [--json bench/results/itl.json]
    .venv/bin/python bench/bench_itl.py --smoke     # seconds: tiny workload
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import launch, make_prompts, run_level  # noqa: E402


def run_setting(model: str | None, target: str, args, prompts: list[list[int]]) -> dict:
    flags = {"itl_target": target}
    if args.max_num_batched_tokens:
        flags["max_num_batched_tokens"] = args.max_num_batched_tokens
    log_path = Path(tempfile.gettempdir()) / f"appliance-bench-itl-{target}-{time.strftime('%H%M%S')}.log"
    proc, url = launch(model, flags, log_path)
    try:
        import httpx

        name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        asyncio.run(run_level(url, name, prompts[:4], 4, 4, None))  # warm-up
        lv = asyncio.run(run_level(url, name, prompts, args.output_len, args.concurrency, None))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    lv["itl_target"] = target
    return lv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model to serve (default: the embedded default model)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=None, help="default: 2 x concurrency")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--targets", default="off,auto", help="comma-separated --itl-target values; the first is the base")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.smoke:
        args.concurrency, args.input_len, args.output_len, args.num_prompts = 4, 32, 8, 8
    n = args.num_prompts or 2 * args.concurrency
    from transformers import AutoTokenizer

    from appliance.bench.common import machine_description
    from appliance.models.default_model import resolve_model_source, tokenizer_path

    src = resolve_model_source(args.model)
    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_path(src))))
    prompts = make_prompts(n, args.input_len, vocab, 0)
    results = [run_setting(args.model, t, args, prompts) for t in args.targets.split(",")]

    host = machine_description()
    print(f"machine: {host['cpu']} ({host['arch']}), {host['physical_cores']} cores, ISA {' '.join(host['isa'])}")
    print(f"workload: {n} requests, concurrency {args.concurrency}, {args.input_len} in / {args.output_len} out")
    ms = 1e3
    head = (f"{'itl_target':>10} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'ITL p50 ms':>11} "
            f"{'ITL p99 ms':>11} {'p99/p50':>8}")
    print(head)
    print("-" * len(head))
    for r in results:
        itl, ttft = r["itl_s"], r["ttft_s"]
        print(f"{r['itl_target']:>10} {r['output_tok_s']:>10.1f} {ttft['p50'] * ms:>12.1f} {ttft['p99'] * ms:>12.1f} "
              f"{itl['p50'] * ms:>11.1f} {itl['p99'] * ms:>11.1f} {itl['p99'] / itl['p50']:>8.2f}")
    base = results[0]
    for r in results[1:]:
        print(f"{r['itl_target']} / {base['itl_target']}: output tok/s {r['output_tok_s'] / base['output_tok_s']:.2f}x, "
              f"p99 ITL {r['itl_s']['p99'] / base['itl_s']['p99']:.2f}x, "
              f"p50 TTFT {r['ttft_s']['p50'] / base['ttft_s']['p50']:.2f}x")
    record = {"bench": "itl", "time": time.strftime("%Y%m%d-%H%M%S"), "host": host, "model": str(src),
              "concurrency": args.concurrency, "num_requests": n, "input_len": args.input_len,
              "output_len": args.output_len, "command": " ".join(sys.argv), "results": results}
    if args.json:
        args.json.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
