"""The process the engine runs in: system malloc vs mimalloc preloaded, OpenMP pinned vs unpinned,
at 1 and 16 concurrent requests, through the offline engine (``appliance.LLM``) on the default model.

Each configuration runs in its own child process, started the way `appliance serve` starts its
engine process (``appliance.runtime.worker.worker_env``: LD_PRELOAD / OMP_* set before exec). The child
warms up, then generates ``--max-tokens`` tokens for each of N requests at once and reports the
throughput and the minor page faults it took per generated token (psutil's view of the process:
/proc/self/stat minflt). Prints a table and writes a JSON record (and a markdown table beside it):

    .venv/bin/python bench/bench_runtime.py --json bench/results/runtime.json
    .venv/bin/python bench/bench_runtime.py --smoke          # seconds: tiny settings, checks it runs

Not a timed test. On a 2-core x86 host expect small differences; see the issue for what they mean
on a 64-core Neoverse host (allocator faults scale with step size, LL/SC contention with cores).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _minor_faults() -> int:
    import psutil

    p = psutil.Process()
    if hasattr(p, "page_faults"):  # psutil >= 7.1
        return int(p.page_faults()[0])
    with open("/proc/self/stat") as f:  # field 10: minflt (after the ')' of comm)
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _process_cpus() -> str:
    """The CPUs the engine's threads are on (union over threads: libgomp pins each to one)."""
    from appliance.runtime.threads import format_cpu_list, parse_cpu_list, thread_affinities

    return format_cpu_list(sorted({c for v in thread_affinities().values() for c in parse_cpu_list(v)}))


def worker(args) -> dict:
    """Runs inside the child: one configuration, one JSON line on stdout."""
    from appliance.runtime import threads
    from appliance.runtime.worker import worker_startup

    # Resolved by the parent: here libgomp may already have bound this thread to one CPU.
    placement = (threads.Placement(args.num_threads, tuple(threads.parse_cpu_list(args.bind)), spec=args.bind)
                 if args.bind != "nobind" else None)
    report = worker_startup(placement)
    import random

    import torch

    from appliance import LLM, SamplingParams

    n_threads = args.num_threads or torch.get_num_threads()
    torch.set_num_threads(n_threads)
    llm = LLM(model=args.model, dtype="float32", num_threads=n_threads, max_num_seqs=max(args.concurrency, 1))
    rng = random.Random(0)
    vocab = 1000  # ids well inside every vocabulary; content does not matter for throughput
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.concurrency)]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(temperature=0, max_tokens=4,
                                                                                ignore_eos=True))
    f0, t0 = _minor_faults(), time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    dt, faults = time.perf_counter() - t0, _minor_faults() - f0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": n_out, "seconds": dt, "tok_per_s": n_out / dt, "minor_faults": faults,
            "faults_per_token": faults / max(n_out, 1), "threads": n_threads,
            "allocator": report["allocator"]["name"], "mimalloc_version": report["allocator"]["mimalloc_version"],
            "cpus_allowed": _process_cpus(), "omp_places": report["omp"]["OMP_PLACES"],
            "libgomp": report["libgomp"]["mapped"]}


def run_config(alloc: str, pinned: bool, conc: int, args) -> dict:
    from appliance.runtime import threads
    from appliance.runtime.worker import worker_env

    placement = threads.resolve(args.bind_spec, args.num_threads) if pinned else None
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_")) and k != "LD_PRELOAD"}
    env = dict(base, **worker_env(alloc, libgomp="auto", placement=placement, base=base))
    if not pinned:
        env["OMP_NUM_THREADS"] = str(args.num_threads or threads.resolve(args.bind_spec).num_threads)  # no binding
    n = placement.num_threads if placement else (args.num_threads or threads.resolve(args.bind_spec).num_threads)
    bind = threads.format_cpu_list(list(placement.cpus)) if placement else "nobind"
    cmd = [sys.executable, __file__, "--worker", "--concurrency", str(conc), "--max-tokens", str(args.max_tokens),
           "--prompt-len", str(args.prompt_len), "--bind", bind, "--num-threads", str(n)]
    if args.model:
        cmd += ["--model", args.model]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        raise SystemExit(f"{alloc}/{'pinned' if pinned else 'unpinned'}/{conc}: child failed:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res.update({"allocator_requested": alloc, "pinned": pinned, "concurrency": conc})
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bind", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--bind-spec", default="auto", help="--omp-threads-bind for the pinned runs")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--allocators", nargs="+", default=["system", "mimalloc"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", default=None, help="write the record here (and a .md table beside it)")
    ap.add_argument("--smoke", action="store_true", help="tiny settings: 1 and 2 requests, 4 tokens")
    args = ap.parse_args(argv)
    if args.worker:
        args.concurrency = args.concurrency[0]
        print(json.dumps(worker(args)), flush=True)
        return 0
    if args.smoke:
        args.concurrency, args.max_tokens, args.prompt_len = [1, 2], 4, 8
    rows = []
    for conc, alloc, pinned in itertools.product(args.concurrency, args.allocators, (False, True)):
        res = run_config(alloc, pinned, conc, args)
        rows.append(res)
        print(f"  {alloc:9s} {'pinned' if pinned else 'unpinned':8s} c={conc:<3d} {res['tok_per_s']:8.1f} tok/s "
              f"{res['faults_per_token']:9.1f} faults/token  [{res['allocator']}, CPUs {res['cpus_allowed']}]",
              file=sys.stderr)
    base = {(r["concurrency"]): r for r in rows if r["allocator_requested"] == "system" and not r["pinned"]}
    lines = ["| requests | allocator | OpenMP | tok/s | x vs system/unpinned | page faults / token |",
             "|---:|---|---|---:|---:|---:|"]
    for r in rows:
        b = base.get(r["concurrency"])
        ratio = r["tok_per_s"] / b["tok_per_s"] if b else float("nan")
        lines.append(f"| {r['concurrency']} | {r['allocator']} | {'pinned' if r['pinned'] else 'unpinned'} | "
                     f"{r['tok_per_s']:.1f} | {ratio:.2f} | {r['faults_per_token']:.1f} |")
    table = "\n".join(lines)
    print(table)
    from appliance.runtime.cpu_features import detect

    f = detect()
    record = {"benchmark": "runtime", "machine": {"cpu": f.model_name, "arch": f.arch, "cpus": os.cpu_count(),
                                                  "python": platform.python_version()},
              "settings": {"max_tokens": args.max_tokens, "prompt_len": args.prompt_len, "model": args.model or "default",
                           "bind": args.bind_spec, "num_threads": args.num_threads},
              "results": rows}
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
