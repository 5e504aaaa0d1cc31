"""A Q4_K_M GGUF in llama.cpp's own tools and in the appliance, side by side (issue 14, "Performance
it must show"): batch-1 prompt processing and decode tokens/s, load time, resident memory.

The model: random weights (transformers' init, std 0.02 like a real checkpoint, norms 1, biases 0)
at Qwen2.5-0.5B's shape (or ``--shape qwen2.5-1.5b``), with the default model's tokenizer (prompts
are token ids), written as an F16 GGUF by ``appliance.bench.gguf_export`` and quantized by
llama.cpp's ``llama-quantize`` to Q4_K_M (and ``--quants ... Q8_0``), cached under
``~/.cache/appliance/bench-models/``. Note: Qwen2.5-0.5B's 896-wide rows are not a multiple of
256, so llama-quantize stores those tensors in its fallback types (Q5_0 for Q4_K, Q8_0 for Q6_K)
exactly as in the published Qwen2.5-0.5B Q4_K_M files; the per-type tensor counts are in the JSON.
The 1.5B shape (1536/8960) is all K-quants.

llama.cpp: llama-bench, llama-server and llama-quantize built with cmake from the llama.cpp vendored
in the llama-cpp-python sdist of the version ``make peers`` pins (``appliance/bench/llamacpp.py``;
~10 min on 2 cores, cached in ``~/.cache/appliance/llamacpp/VERSION``). Same thread count as the
appliance (``--threads``, default 2).

- llama.cpp rows: ``llama-bench -m FILE -t T -p 512 -n 128 -r REPS -d 0,512 -o json``: pp512 and
  tg128 with an empty KV cache (depth 0: llama-bench's usual figure) and tg128 after 512 tokens
  (depth 512: what the appliance's decode figure is, a 512-token prompt then 128 tokens). Load time
  and RSS: ``llama-server -m FILE -t T -np 4 -c 4096`` from process start until ``/health``
  answers 200, its RSS then (psutil; mmap'd weights count once touched, and the server's warm-up
  touches them); ``--server`` also sends REPS requests of 512 random token ids / 128 tokens to
  its ``/completion`` and reports the server's own timings.
- appliance rows: ``appliance.LLM(model=FILE.gguf, dtype=float32, quantization=Q, num_threads=T)``
  for Q in none (today: the GGUF dequantized to float32), w4a8, w8a8, each in a fresh process.
  Load = constructor wall time (``import`` of appliance/torch reported apart). "cold" runs in a
  fresh APPLIANCE_CACHE_DIR (nothing cached: no converted model, no measured linear-backend
  choice; only the already-built native kernels are linked in), "warm" in a second process on the
  same cache dir, which then runs the timed requests: REPS times one request of PROMPT random token
  ids (seeded, different per rep), OUT tokens, greedy, ignore_eos, driven through
  ``engine.add_request``/``engine.step`` with a timestamp at each new token: pp = PROMPT / (first
  token time - add time), tg = (OUT - 1) / (last token time - first token time); medians over reps,
  after one short warm-up request. RSS (psutil) after load and after the runs.
  The KV cache gets ``--server-ctx`` (4096) tokens of float32 KV, the tokens llama-server gets (its KV
  is f16), so the RSS columns compare like for like.
- ratios: appliance / llama.cpp, pp against llama-bench pp512 and tg against llama-bench tg128 at
  depth 512 (the same context). Issue 14's targets: tg >= 1x, pp >= 2x.

The real run (nothing else on the machine; build llama.cpp first, it is not timed):

    .venv/bin/python bench/bench_gguf.py --build-llamacpp-only
    .venv/bin/python bench/bench_gguf.py --server --json bench/results/gguf_q4_k_m.json

A quick end-to-end check (2 layers, 1 rep, short lengths; minutes):

    .venv/bin/python bench/bench_gguf.py --layers 2 --reps 1 --prompt-len 64 --out-len 16 --server \\
        --json /tmp/gguf-smoke.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Qwen/Qwen2.5-0.5B and Qwen/Qwen2.5-1.5B config.json (max_position_embeddings capped at 32768)
SHAPES = {
    "qwen2.5-0.5b": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                     "bos_token_id": 151643, "eos_token_id": 151643},
    "qwen2.5-1.5b": {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                     "bos_token_id": 151643, "eos_token_id": 151643},
}
APPLIANCE_SETTINGS = {"float32": "none", "w4a8": "w4a8", "w8a8": "w8a8", "gguf": "gguf"}
MODELS_VERSION = 1  # bump when the written model changes


def log(msg: str) -> None:
    print(f"[bench_gguf] {msg}", file=sys.stderr, flush=True)


def mib(n: int | float | None) -> float | None:
    return None if n is None else n / 2 ** 20


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# -- the model ----------------------------------------------------------------------------------
from appliance.bench.random_models import models_root  # noqa: E402


def model_name(shape: str, layers: int | None, seed: int) -> str:
    n = layers or SHAPES[shape]["num_hidden_layers"]
    return f"{shape}-shape-L{n}-seed{seed}-v{MODELS_VERSION}"


def f16_gguf(shape: str, layers: int | None, seed: int) -> Path:
    """The random-weight model as an F16 GGUF (cached)."""
    out = models_root() / model_name(shape, layers, seed) / "F16.gguf"
    if out.is_file():
        return out
    from appliance.bench.gguf_export import write_gguf
    from appliance.bench.random_models import write_random_model

    cfg = dict(SHAPES[shape])
    if layers:
        cfg["num_hidden_layers"] = layers
    log(f"writing a random-weight {shape} model ({cfg['num_hidden_layers']} layers) as {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        hf = write_random_model(Path(tmp) / model_name(shape, layers, seed), "Qwen2", cfg, seed)
        write_gguf(hf, out, "float16")
    return out


def quantized_gguf(shape: str, layers: int | None, seed: int, qtype: str, threads: int) -> Path:
    from appliance.bench import llamacpp

    out = models_root() / model_name(shape, layers, seed) / f"{qtype}.gguf"
    if out.is_file():
        return out
    src = f16_gguf(shape, layers, seed)
    log(f"llama-quantize {src.name} -> {qtype}")
    return llamacpp.quantize(src, out, qtype, threads)


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type the file holds (Q4_K_M is a mix)."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


# -- llama.cpp ----------------------------------------------------------------------------------
def run_llamacpp(path: Path, args) -> dict:
    from appliance.bench import llamacpp

    depths = (0, args.prompt_len)
    rows, cmd = llamacpp.llama_bench(path, args.threads, args.prompt_len, args.out_len, args.reps, depths)
    out = {"llama_bench_command": cmd, "llama_bench": rows}
    for r in rows:
        d = r.get("n_depth", 0)
        if r["n_prompt"] == args.prompt_len and r["n_gen"] == 0 and d == 0:
            out["pp_tok_s"] = r["avg_ts"]
        elif r["n_prompt"] == 0 and r["n_gen"] == args.out_len:
            out[f"tg_tok_s_d{d}"] = r["avg_ts"]
    if rows:
        out["build"] = {k: rows[0].get(k) for k in ("build_commit", "build_number", "cpu_info", "backends",
                                                     "model_type", "model_size", "model_n_params", "n_batch",
                                                     "n_ubatch", "type_k", "type_v", "use_mmap")}
    prompts = random_prompts(args, 1000) if args.server else []
    srv = llamacpp.llama_server_run(path, args.threads, prompts, args.out_len, parallel=args.server_parallel,
                                    ctx=args.server_ctx)
    srv["pp_tok_s"] = median([r["prompt_per_second"] for r in srv["runs"]])
    srv["tg_tok_s"] = median([r["predicted_per_second"] for r in srv["runs"]])
    out["llama_server"] = srv
    return out


# -- the appliance ------------------------------------------------------------------------------
def random_prompts(args, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    # ids the borrowed tokenizer knows (it is smaller than the 151936-row embedding)
    return [[rng.randrange(100, 30000) for _ in range(args.prompt_len)] for _ in range(args.reps)]


def worker(spec: dict) -> dict:
    """In a fresh process: construct the LLM, optionally run the timed requests. One JSON line out."""
    import resource

    import psutil

    t0 = time.perf_counter()
    import torch  # noqa: F401

    from appliance import LLM, SamplingParams

    import_s = time.perf_counter() - t0
    proc = psutil.Process()
    t = time.perf_counter()
    llm = LLM(spec["model"], dtype="float32", quantization=spec["quantization"], num_threads=spec["threads"],
              max_model_len=spec["prompt_len"] + spec["out_len"] + 16, kv_cache_memory=spec["kv_cache_gib"],
              kv_cache_dtype=spec.get("kv_cache_dtype", "auto"), enable_prefix_caching=False)
    load_s = time.perf_counter() - t
    res = {"import_s": import_s, "load_s": load_s, "rss_after_load": proc.memory_info().rss}
    if not spec["measure"]:
        return res
    eng = llm.engine
    llm.generate([list(range(100, 164))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    runs = []
    for ids in spec["prompts"]:
        sp = SamplingParams(temperature=0, max_tokens=spec["out_len"], ignore_eos=True)
        t_add = time.monotonic()
        rid = eng.add_request(None, ids, sp)
        stamps, n, done = [], 0, False
        while not done:
            for o in eng.step():
                if o.request_id != rid:
                    continue
                now = time.monotonic()
                k = len(o.outputs[0].token_ids)
                stamps += [now] * (k - n)
                n = k
                done = o.finished
        if n != spec["out_len"]:
            raise RuntimeError(f"asked for {spec['out_len']} tokens, got {n}")
        first, last = stamps[0], stamps[-1]
        runs.append({"ttft_s": first - t_add, "pp_tok_s": len(ids) / (first - t_add),
                     "tg_tok_s": (n - 1) / (last - first) if n > 1 and last > first else None})
    res.update(runs=runs, pp_tok_s=median([r["pp_tok_s"] for r in runs]),
               tg_tok_s=median([r["tg_tok_s"] for r in runs]), rss_after_runs=proc.memory_info().rss,
               peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    try:
        res["linear_backends"] = {k: str(v) for k, v in (getattr(eng.runner, "linear_backends", None) or {}).items()}
    except Exception:
        pass
    return res


def run_worker(spec: dict, cache: Path, timeout: float) -> dict:
    env = dict(os.environ, APPLIANCE_CACHE_DIR=str(cache))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        r = subprocess.run([sys.executable, __file__, "--worker", f.name], env=env, capture_output=True, text=True,
                           timeout=timeout)
    finally:
        os.unlink(f.name)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"error": f"worker exited {r.returncode}: {(r.stderr or r.stdout)[-2000:]}"}
    return json.loads(lines[-1])


def run_appliance(path: Path, setting: str, args) -> dict:
    """Cold load in a fresh cache dir, then warm load + timed requests on the same cache."""
    real = Path(os.environ.get("APPLIANCE_CACHE_DIR", Path.home() / ".cache" / "appliance")).expanduser()
    cache = Path(tempfile.mkdtemp(prefix=f"bench-gguf-{setting}-", dir=args.scratch))
    try:
        if (real / "native").is_dir():  # the built kernels: an install step, not a model load
            (cache / "native").symlink_to(real / "native")
        spec = {"model": str(path), "quantization": APPLIANCE_SETTINGS[setting], "threads": args.threads,
                "prompt_len": args.prompt_len, "out_len": args.out_len, "kv_cache_gib": args.kv_cache_gib,
                "kv_cache_dtype": args.kv_cache_dtype,
                "measure": False, "prompts": []}
        cold = run_worker(spec, cache, args.worker_timeout)
        if "error" in cold:
            return cold
        warm = run_worker(dict(spec, measure=True, prompts=random_prompts(args, 2000)), cache, args.worker_timeout)
        if "error" in warm:
            return dict(warm, cold=cold)
        return dict(warm, cold_load_s=cold["load_s"], cold_rss_after_load=cold["rss_after_load"],
                    cold_import_s=cold["import_s"])
    finally:
        shutil.rmtree(cache, ignore_errors=True)


# -- report -------------------------------------------------------------------------------------
def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def table_text(record: dict) -> str:
    m = record["machine"]
    s = record["settings"]
    lines = [f"machine: {m.get('cpu')} ({m.get('arch')}), ISA {' '.join(m.get('isa', []))}, "
             f"{m.get('logical_cpus')} logical CPUs, torch {m.get('torch')}",
             f"command: {record['command']}",
             f"model: random-weight {s['shape']} shape, {s['layers'] or 'all'} layers; {s['threads']} threads; "
             f"prompt {s['prompt_len']}, output {s['out_len']}, {s['reps']} reps",
             f"llama.cpp: {record.get('llamacpp_version', '')}", ""]
    hdr = ["system", "file", "setting", "load s", f"pp{s['prompt_len']} tok/s", f"tg{s['out_len']} tok/s",
           "RSS MiB", "file MiB"]
    rows = []
    for fr in record["results"]["files"]:
        fname, fmib = fr["qtype"], mib(fr["file_bytes"])
        lc = fr.get("llamacpp") or {}
        if "error" in lc:
            rows.append(["llama.cpp", fname, "error: " + lc["error"][:60], "", "", "", "", fmt(fmib, ".0f")])
        elif lc:
            srv = lc.get("llama_server", {})
            rows.append(["llama.cpp", fname, "llama-bench d0", fmt(srv.get("load_s"), ".2f"), fmt(lc.get("pp_tok_s")),
                         fmt(lc.get("tg_tok_s_d0")), fmt(mib(srv.get("rss_after_load")), ".0f"), fmt(fmib, ".0f")])
            rows.append(["llama.cpp", fname, f"llama-bench d{s['prompt_len']}", "", "",
                         fmt(lc.get(f"tg_tok_s_d{s['prompt_len']}")), "", ""])
            if srv.get("runs"):
                rows.append(["llama.cpp", fname, f"llama-server -np {s['server_parallel']}", "",
                             fmt(srv.get("pp_tok_s")), fmt(srv.get("tg_tok_s")),
                             fmt(mib(srv.get("rss_after_runs")), ".0f"), ""])
        for name, a in (fr.get("appliance") or {}).items():
            if "error" in a:
                rows.append(["appliance", fname, f"{name}: error", "", "", "", "", ""])
                continue
            load = f"{fmt(a.get('cold_load_s'), '.2f')} / {fmt(a.get('load_s'), '.2f')}"
            rows.append(["appliance", fname, name, load, fmt(a.get("pp_tok_s")), fmt(a.get("tg_tok_s")),
                         fmt(mib(a.get("rss_after_load")), ".0f"), fmt(fmib, ".0f")])
    widths = [max(len(str(r[i])) for r in [hdr] + rows) for i in range(len(hdr))]
    lines.append("  ".join(str(h).ljust(w) for h, w in zip(hdr, widths)))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines += ["", "appliance load: cold / warm constructor seconds (cold: empty APPLIANCE_CACHE_DIR); llama.cpp "
              "load: llama-server start to /health 200. RSS: after load (psutil).",
              f"ratios appliance / llama.cpp (pp vs llama-bench pp{s['prompt_len']} d0, tg vs llama-bench "
              f"tg{s['out_len']} at depth {s['prompt_len']}; higher is faster); issue 14 targets: pp >= 2x, tg >= 1x:"]
    for fr in record["results"]["files"]:
        for name, r in (fr.get("ratios") or {}).items():
            lines.append(f"  {fr['qtype']} {name}: pp {fmt(r.get('pp'), '.2f')}x, tg {fmt(r.get('tg'), '.2f')}x, "
                         f"warm load time {fmt(r.get('load_warm'), '.2f')}x and RSS {fmt(r.get('rss'), '.2f')}x llama.cpp's")
    return "\n".join(lines) + "\n"


def ratios(fr: dict, prompt_len: int) -> dict:
    lc = fr.get("llamacpp") or {}
    if "error" in lc or not lc:
        return {}
    srv = lc.get("llama_server", {})
    tg_ref = lc.get(f"tg_tok_s_d{prompt_len}") or lc.get("tg_tok_s_d0")
    out = {}
    for name, a in (fr.get("appliance") or {}).items():
        if "error" in a:
            continue

        def div(x, y):
            return x / y if x is not None and y else None

        out[name] = {"pp": div(a.get("pp_tok_s"), lc.get("pp_tok_s")), "tg": div(a.get("tg_tok_s"), tg_ref),
                     "load_warm": div(a.get("load_s"), srv.get("load_s")),
                     "rss": div(a.get("rss_after_load"), srv.get("rss_after_load"))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (quick checks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quants", nargs="+", default=["Q4_K_M"], help="llama-quantize types (e.g. Q4_K_M Q8_0)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--settings", nargs="+", default=list(APPLIANCE_SETTINGS), choices=list(APPLIANCE_SETTINGS))
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="the appliance's KV cache budget (default: --server-ctx tokens of float32 KV, the "
                         "tokens llama-server gets)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"),
                    help="the appliance's KV cache type (auto: the model dtype, float32 here; llama.cpp's "
                         "default is f16: bfloat16 holds the same bytes)")
    ap.add_argument("--server", action="store_true", help="also time requests through llama-server")
    ap.add_argument("--server-parallel", type=int, default=4)
    ap.add_argument("--server-ctx", type=int, default=4096)
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--no-appliance", action="store_true")
    ap.add_argument("--worker-timeout", type=float, default=3600)
    ap.add_argument("--scratch", default=None, help="where the cold-cache dirs go (default: the temp dir)")
    ap.add_argument("--jobs", type=int, default=None, help="llama.cpp build parallelism")
    ap.add_argument("--build-llamacpp-only", action="store_true", help="build (or reuse) llama.cpp's tools and exit")
    ap.add_argument("--prepare-only", action="store_true", help="build llama.cpp and write the model files, then exit")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        print(json.dumps(worker(spec)), flush=True)
        return

    from appliance.bench import llamacpp

    if args.kv_cache_gib is None:
        c = SHAPES[args.shape]
        layers = args.layers or c["num_hidden_layers"]
        head_dim = c["hidden_size"] // c["num_attention_heads"]
        elt = {"auto": 4, "bfloat16": 2}.get(args.kv_cache_dtype, 1)
        args.kv_cache_gib = layers * 2 * c["num_key_value_heads"] * head_dim * elt * args.server_ctx / 2 ** 30
    t = time.perf_counter()
    bins = llamacpp.build(jobs=args.jobs)
    log(f"llama.cpp tools in {bins} ({time.perf_counter() - t:.0f}s)")
    if args.build_llamacpp_only:
        print(bins)
        return
    files = [quantized_gguf(args.shape, args.layers, args.seed, q, args.threads) for q in args.quants]
    if args.prepare_only:
        print("\n".join(str(f) for f in files))
        return

    from appliance.bench.common import machine_description

    results = {"files": []}
    for q, path in zip(args.quants, files):
        fr = {"qtype": q, "path": str(path), "file_bytes": path.stat().st_size, "tensor_types": tensor_types(path)}
        log(f"{path.name}: {mib(fr['file_bytes']):.0f} MiB, tensors {fr['tensor_types']}")
        if not args.no_llamacpp:
            log(f"llama.cpp on {path.name}")
            try:
                fr["llamacpp"] = run_llamacpp(path, args)
            except Exception as e:  # a failing peer is reported, never read as a fast one
                fr["llamacpp"] = {"error": str(e)}
        fr["appliance"] = {}
        if not args.no_appliance:
            for name in args.settings:
                log(f"appliance {name} on {path.name}")
                fr["appliance"][name] = run_appliance(path, name, args)
        fr["ratios"] = ratios(fr, args.prompt_len)
        results["files"].append(fr)

    record = {"bench": "gguf", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_description(),
              "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "llamacpp_version": f"llama-cpp-python {llamacpp.LLAMA_CPP_PYTHON_VERSION} sdist, "
                                  + llamacpp.version_info().replace("\n", "; "),
              "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "json")},
              "results": results}
    text = table_text(record)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1, default=str) + "\n")
        args.json.with_suffix(".txt").write_text(text)


if __name__ == "__main__":
    main()
