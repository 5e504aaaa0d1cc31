"""Serving benchmark: concurrent streaming requests against `appliance serve`, and the offline
engine on the same workload in the same run.

For each concurrency level (default 1, 4, 16, 64) it sends ``--num-prompts`` requests (default
4 x concurrency, at least 8) of ``--input-len`` random prompt tokens and exactly ``--output-len``
generated tokens (ignore_eos, greedy), at most ``concurrency`` in flight, and reports TTFT, time per
output token (TPOT), inter-token latency (ITL) as mean / p50 / p99, and output tokens/s. Then the
offline engine (``LLMEngine``, same flags, same prompts, same concurrency cap) runs the same
workload, after the server is stopped so the two never share the CPU.

    # start a server itself (recommended: the offline run then gets the CPU to itself)
    python bench/bench_serve.py --launch [MODEL] [--dtype bfloat16 ...]
    # or drive a running server (offline run needs --model-path then)
    python bench/bench_serve.py --url http://127.0.0.1:8000 --model-path PATH
    # smoke test: tiny workload, seconds
    python bench/bench_serve.py --launch tests-tiny-model-dir --smoke

Prints a table and writes a JSON record (``--out``, default bench/results/serve-<time>.json).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from appliance.bench.loadgen import LoadConfig, run_level_async
from appliance.bench.servers import free_port

REPO = Path(__file__).resolve().parents[1]
ENGINE_FLAGS = ("dtype", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "kv_cache_memory", "itl_target",
                "num_threads", "block_size", "max_model_len")


def make_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo = min(16, vocab // 4)  # skip the low ids, where tokenizers keep their special tokens
    return [[rng.randrange(lo, vocab) for _ in range(input_len)] for _ in range(n)]


# -- HTTP (the load generator of `appliance bench serve`) -----------------------------------------
async def run_level(url: str, model: str, prompts: list[list[int]], output_len: int, concurrency: int,
                    api_key: str | None) -> dict:
    cfg = LoadConfig(url, model, output_len=output_len, api_key=api_key)
    lv = await run_level_async(cfg, prompts, concurrency=concurrency)
    if lv["failed"]:
        raise RuntimeError(f"{lv['failed']} of {lv['num_requests']} requests failed: {lv['errors']}")
    return {"concurrency": concurrency, "num_requests": lv["num_requests"], "wall_s": lv["duration_s"],
            "output_tokens": lv["output_tokens"], "output_tok_s": lv["output_throughput"],
            "ttft_s": lv["ttft_s"], "tpot_s": lv["tpot_s"], "itl_s": lv["itl_s"]}


# -- offline ------------------------------------------------------------------------------------
def run_offline(model_path: str, engine_kwargs: dict, prompts: list[list[int]], output_len: int,
                counts: dict[int, int]) -> dict:
    """Output tokens/s of the engine alone: for each concurrency c, counts[c] prompts, at most c in flight."""
    from appliance.config import EngineConfig
    from appliance.engine.llm_engine import LLMEngine
    from appliance.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig.from_kwargs(model=model_path, **engine_kwargs))
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    # warm-up at the real prompt length (first calls of each shape are slow), as the server gets
    for i, p in enumerate(prompts[:4]):
        engine.add_request(f"warmup-{i}", p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    out = {}
    for c, n in counts.items():
        todo = list(enumerate(prompts[:n]))
        in_flight, tokens = 0, 0
        t0 = time.perf_counter()
        while todo or in_flight:
            while todo and in_flight < c:
                i, p = todo.pop(0)
                engine.add_request(f"{c}-{i}", p, sp)
                in_flight += 1
            for o in engine.step():
                if o.finished:
                    in_flight -= 1
                    tokens += len(o.outputs[0].token_ids)
        wall = time.perf_counter() - t0
        out[c] = {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall}
    return out


# -- server process -----------------------------------------------------------------------------
def launch(model: str | None, engine_kwargs: dict, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "appliance.cli", "serve", *([model] if model else []), "--port", str(port),
           "--log-level", "warning"]
    for k, v in engine_kwargs.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); log: {log_path}\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"server not healthy after 600 s; log: {log_path}")


def print_table(levels: list[dict], offline: dict) -> None:
    ms = 1e3
    head = (f"{'conc':>4} {'reqs':>5} {'out tok/s':>10} {'offline':>9} {'ratio':>6} | {'TTFT ms mean/p50/p99':>22} | "
            f"{'TPOT ms mean/p50/p99':>22} | {'ITL ms mean/p50/p99':>22} {'p99/p50':>7}")
    print(head)
    print("-" * len(head))
    for lv in levels:
        off = offline.get(lv["concurrency"], {}).get("output_tok_s")
        ratio = lv["output_tok_s"] / off if off else float("nan")
        f = lambda s: f"{s['mean'] * ms:6.1f}/{s['p50'] * ms:6.1f}/{s['p99'] * ms:6.1f}"  # noqa: E731
        itl = lv["itl_s"]
        print(f"{lv['concurrency']:>4} {lv['num_requests']:>5} {lv['output_tok_s']:>10.1f} "
              f"{off if off else float('nan'):>9.1f} {ratio:>6.2f} | {f(lv['ttft_s']):>22} | {f(lv['tpot_s']):>22} | "
              f"{f(itl):>22} {itl['p99'] / itl['p50'] if itl['p50'] else float('nan'):>7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--launch", nargs="?", const="", metavar="MODEL", help="start `appliance serve [MODEL]` here")
    src.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model-path", help="model for the offline run (default: the launched one / the default)")
    ap.add_argument("--served-model-name", help="the server's model name (default: from /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("APPLIANCE_API_KEY"))
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=None, help="per level (default: max(8, 4 x concurrency))")
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="concurrency 1,2; 16 in / 8 out; 4 prompts per level")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    for k in ENGINE_FLAGS:
        kind = float if k == "kv_cache_memory" else (str if k in ("dtype", "itl_target") else int)
        ap.add_argument(f"--{k.replace('_', '-')}", type=kind)
    args = ap.parse_args()
    if args.smoke:
        args.concurrency, args.input_len, args.output_len, args.num_prompts = "1,2", 16, 8, 4
    levels = [int(c) for c in args.concurrency.split(",")]
    engine_kwargs = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    results_dir = REPO / "bench" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")

    proc = None
    if args.launch is not None:
        log_path = Path(tempfile.gettempdir()) / f"appliance-bench-serve-{stamp}.log"
        proc, url = launch(args.launch or None, engine_kwargs, log_path)
    else:
        url = args.url.rstrip("/")
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()["data"]
        name = args.served_model_name or models[0]["id"]
        model_path = args.model_path or models[0].get("root")
        from transformers import AutoTokenizer  # the vocabulary size is not in the API

        vocab = len(AutoTokenizer.from_pretrained(model_path)) if model_path else 256
        counts = {c: args.num_prompts or max(8, 4 * c) for c in levels}
        prompts = make_prompts(max(counts.values()), args.input_len, vocab, args.seed)
        server_levels = []
        for c, n in counts.items():
            asyncio.run(run_level(url, name, prompts[:4], 4, 4, args.api_key))  # warm-up, as the offline run
            lv = asyncio.run(run_level(url, name, prompts[:n], args.output_len, c, args.api_key))
            server_levels.append(lv)
            print(f"concurrency {c}: {lv['output_tok_s']:.1f} output tok/s", file=sys.stderr)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)

    offline = {}
    if not args.no_offline:
        if proc is None:
            print("note: the server is still running during the offline run; both share the CPU", file=sys.stderr)
        offline = run_offline(model_path, engine_kwargs, prompts, args.output_len, counts)
    from appliance.bench.common import machine_description

    host = machine_description()
    print(f"machine: {host['cpu']} ({host['arch']}), {host['physical_cores']} cores, ISA {' '.join(host['isa'])}, "
          f"torch {host['torch']}")
    print_table(server_levels, offline)
    record = {"bench": "serve", "time": stamp, "url": url, "model": name, "model_path": model_path,
              "input_len": args.input_len, "output_len": args.output_len, "engine_flags": engine_kwargs,
              "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                       **host},
              "server": server_levels, "offline": {str(k): v for k, v in offline.items()}}
    out = args.out or results_dir / f"serve-{stamp}.json"
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
