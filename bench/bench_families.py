"""Model families against the dense Llama-style model of the same cost, side by side (issue 15,
"Performance it must show"): what a family's own structure costs on this host.

Pairs (random weights, transformers' init, written once under ~/.cache/appliance/bench-models/):
- ``gemma3-1b``: Gemma 3 1B's text shape (google/gemma-3-1b-it config.json: 26 layers, hidden 1152,
  MLP 6912, 4 heads / 1 KV head of 256, vocab 262144, sliding window 512 on 5 of every 6 layers)
  against a Llama with exactly the same dimensions (full attention, SiLU MLP, no extra norms).
  Target: throughput and batch-1 decode within 15% of the Llama.
- ``qwen3-30b-a3b``: Qwen3-30B-A3B's per-layer shape (hidden 2048, 128 experts of width 768, top-8,
  32 heads / 4 KV heads of 128) with fewer layers (``--layers``, default 2: one layer's experts are
  2.4 GB in float32) against a dense Qwen3 whose MLP has the same active width (8 x 768 = 6144). The
  vocabulary is cut to 32768 (from 151936) so that with two layers the logits projection, the same in
  both models, does not hide the layers' difference.
  Target: time per output token within 1.5x of the dense model.

Load: ``load s (warm)`` is the engine's load with the files in the page cache; ``of it timing s`` the part
spent timing linear-backend candidates, a one-off per host and shape kept in linear_backends.json, so the
model of a pair that loads first pays for the shapes both share (the qkv, o, down and 262144-row logits
projections of the Gemma pair: the 4.5x "load" of session 10 was that, not Gemma); ``load s, no timing``
is the load without it, the column to compare.

Each model runs in a fresh process: ``appliance.LLM(dir, dtype=float32, num_threads=T)``, one
warm-up request, then (a) batch 1: REPS requests of PROMPT random token ids, OUT tokens, greedy,
one at a time: prefill tok/s = PROMPT / time to first token, TPOT = (last - first token time) /
(OUT - 1), medians; (b) batch B: B such requests added at once: output tok/s = B * OUT / wall time,
and TPOT (median over requests). Ratio = family / dense for each column (TPOT: lower is better, so a
ratio of 1.15 is 15% slower). Weights MB: the weight bytes one decode step reads at batch 1 and B
(``WeightReads``: the experts the routers chose, counted per step); their ratio is the floor of the TPOT
ratio where decode streams its weights from DRAM (an MoE at batch 16 reads ~10x the expert bytes of
its dense twin).

``--quantization w8a8 --linear-backend w8a8_native`` (or ``w4a8`` / ``w4a8_native``) quantizes both models
of a pair at load onto the same method: each system at its native quantized setting.

Run with nothing else on the machine (prints a table, writes JSON next to a .txt copy):

    .venv/bin/python bench/bench_families.py --pairs gemma3-1b qwen3-30b-a3b --json bench/results/families.json
    .venv/bin/python bench/bench_families.py --smoke      # seconds: tiny widths, 2 layers, short lengths
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

_GEMMA3_1B = {"vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1}
_QWEN3_30B_A3B_ATTN = {"vocab_size": 32768, "hidden_size": 2048, "num_attention_heads": 32,
                       "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 32768,
                       "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
                       "num_hidden_layers": 48, "bos_token_id": 1, "eos_token_id": 2}
# pair -> (family model, dense model, default layer count or None for the real one, --smoke dimensions);
# each model is (transformers family name, config)
PAIRS = {
    "gemma3-1b": (
        ("Gemma3Text", dict(_GEMMA3_1B, query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
                            rope_theta=1000000.0, rope_local_base_freq=10000.0)),
        ("Llama", dict(_GEMMA3_1B, rope_theta=1000000.0)),
        None,
        dict(vocab_size=32768, hidden_size=128, intermediate_size=256, head_dim=32, sliding_window=8),
    ),
    "qwen3-30b-a3b": (
        ("Qwen3Moe", dict(_QWEN3_30B_A3B_ATTN, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          intermediate_size=6144, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
        ("Qwen3", dict(_QWEN3_30B_A3B_ATTN, intermediate_size=8 * 768)),
        2,
        dict(hidden_size=128, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, intermediate_size=256,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    ),
}
MODELS_VERSION = 1  # bump when the written models change


def log(msg: str) -> None:
    print(f"[bench_families] {msg}", file=sys.stderr, flush=True)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def model_config(pair: str, which: int, layers: int | None, smoke: bool) -> tuple[str, dict]:
    family, cfg = PAIRS[pair][which]
    cfg = dict(cfg)
    if smoke:
        cfg.update({k: v for k, v in PAIRS[pair][3].items() if k in cfg or which == 0})
    if layers:
        cfg["num_hidden_layers"] = layers
    return family, cfg


def model_dir(pair: str, which: int, layers: int | None, smoke: bool) -> Path:
    from appliance.bench.random_models import cached_random_model

    family, cfg = model_config(pair, which, layers, smoke)
    name = f"{pair}{'-smoke' if smoke else ''}-{family.lower()}-L{cfg['num_hidden_layers']}-v{MODELS_VERSION}"
    log(f"model {name}")
    return cached_random_model(name, family, cfg, seed=0)


def worker(spec: dict) -> dict:
    """In a fresh process: load, warm up, time batch 1 and batch B. One JSON line out."""
    loaded = _load(spec)
    res, run, reads = loaded["res"], loaded["run"], loaded["reads"]
    b1 = [run(1)[1][0] for _ in range(spec["reps"])]
    bb = [run(spec["batch"]) for _ in range(spec["reps"])]
    res.update(_decode_columns(spec, b1, bb, reads))
    return res


def worker_interleaved(spec: dict) -> dict:
    """In one fresh process: both models of a pair loaded side by side, then REPS rounds, each timing
    batch 1 and batch B of both models, which one goes first alternating by round, so a shared host's
    load falls on both alike. One JSON line out: {"family": ..., "dense": ...}."""
    models = {key: _load(dict(spec, model=spec[f"{key}_model"], vocab=spec[f"{key}_vocab"]))
              for key in ("family", "dense")}
    b1 = {key: [] for key in models}
    bb = {key: [] for key in models}
    order = list(models)
    for i in range(spec["reps"]):
        for key in (order if i % 2 == 0 else order[::-1]):
            run = models[key]["run"]
            b1[key].append(run(1)[1][0])
            bb[key].append(run(spec["batch"]))
    out = {}
    for key, m in models.items():
        out[key] = dict(m["res"], **_decode_columns(spec, b1[key], bb[key], m["reads"]))
    return out


def _decode_columns(spec: dict, b1: list[dict], bb: list[tuple[float, list[dict]]], reads) -> dict:
    res = {"b1_prefill_tok_s": median([spec["prompt_len"] / r["ttft_s"] for r in b1]),
           "b1_tpot_ms": median([r["tpot_s"] * 1e3 for r in b1 if r["tpot_s"]])}
    walls = [w for w, _ in bb]
    tpots = [r["tpot_s"] * 1e3 for _, rs in bb for r in rs if r["tpot_s"]]
    res["bB_out_tok_s"] = median([spec["batch"] * spec["out_len"] / w for w in walls])
    res["bB_tpot_ms"] = median(tpots)
    res["b1_weights_mb"], res["bB_weights_mb"] = reads.mb_per_step(1), reads.mb_per_step(spec["batch"])
    return res


def _load(spec: dict) -> dict:
    """Load spec["model"], warm up; returns its load columns, a run(n) timing n requests, and its
    WeightReads."""
    import random

    import psutil

    from appliance import LLM, SamplingParams

    # Read the files once first, so load_s is the engine's work and not whether the page cache
    # happened to hold this model (a cold 4 GB read made Gemma's load look 4x a warm Llama's).
    t = time.perf_counter()
    for f in sorted(Path(spec["model"]).glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    read_s = time.perf_counter() - t
    timing = _count_choice_timing()
    t = time.perf_counter()
    llm = LLM(spec["model"], dtype="float32", num_threads=spec["threads"], enable_prefix_caching=False,
              quantization=spec.get("quantization", "none"), linear_backend=spec.get("linear_backend", "auto"),
              max_model_len=spec["prompt_len"] + spec["out_len"] + 16, max_num_seqs=max(16, spec["batch"]))
    res = {"load_s": time.perf_counter() - t, "read_s": read_s, "rss_after_load": psutil.Process().memory_info().rss}
    # the linear-backend timing is a one-off per host and shape (cached in linear_backends.json): whichever
    # model of a pair loads first times the shapes the two share, so the load is compared without it
    res["choice_s"] = timing[0]
    res["load_cached_s"] = res["load_s"] - timing[0]
    eng = llm.engine
    rng = random.Random(7)
    vocab = min(30000, spec["vocab"])

    def prompt():
        return [rng.randrange(100, vocab) for _ in range(spec["prompt_len"])]

    def run(n: int) -> tuple[float, list[dict]]:
        sp = SamplingParams(temperature=0, max_tokens=spec["out_len"], ignore_eos=True)
        t0 = time.monotonic()
        ids = {eng.add_request(None, prompt(), sp): t0 for _ in range(n)}
        stamps = {r: [] for r in ids}
        live = set(ids)
        while live:
            for o in eng.step():
                if o.request_id not in stamps:
                    continue
                now = time.monotonic()
                k = len(o.outputs[0].token_ids)
                stamps[o.request_id] += [now] * (k - len(stamps[o.request_id]))
                if o.finished:
                    live.discard(o.request_id)
        wall = time.monotonic() - t0
        out = []
        for r, s in stamps.items():
            if len(s) != spec["out_len"]:
                raise RuntimeError(f"asked for {spec['out_len']} tokens, got {len(s)}")
            out.append({"ttft_s": s[0] - ids[r], "tpot_s": (s[-1] - s[0]) / (len(s) - 1) if len(s) > 1 else None})
        return wall, out

    run(1)  # warm-up: measured backend choices, first-touch of the weights
    return {"res": res, "run": run, "reads": WeightReads(eng.runner.model)}


def _count_choice_timing() -> list[float]:
    """Seconds spent timing linear-backend candidates (every layer kind's ``measure``), accumulated into
    the returned one-element list from now on."""
    from appliance.layers.linear import LinearBase

    total = [0.0]

    def wrap(fn):
        def measure(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                total[0] += time.perf_counter() - t0
        return measure

    todo, seen = [LinearBase], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        if "measure" in cls.__dict__:
            cls.measure = wrap(cls.__dict__["measure"])
        todo += cls.__subclasses__()
    return total


class WeightReads:
    """The weight bytes a decode step of n tokens reads: every linear layer's (as packed, the logits
    projection included), but of a mixture-of-experts layer's experts only those the step's tokens chose
    (recorded by a hook on each router, per step). At batch 16 with top-8 of 128 experts ~80 experts
    are chosen per layer, 10x the bytes of the 8 a dense model of the same active width reads: the ratio
    of these columns is the floor of the TPOT ratio where the step streams its weights from DRAM."""

    def __init__(self, model):
        from appliance.layers.linear import LinearBase

        blocks = [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
        expert_layers = {id(lin) for b in blocks for e in b.experts for lin in e.modules() if isinstance(lin, LinearBase)}
        self.fixed = sum(int(m.weight_bytes()) for m in model.modules()
                         if isinstance(m, LinearBase) and id(m) not in expert_layers)
        self.per_tokens: dict[int, list[int]] = {}  # tokens in the step -> expert bytes read, per router call
        for b in blocks:
            sizes = [sum(int(lin.weight_bytes()) for lin in e.modules() if isinstance(lin, LinearBase)) for e in b.experts]
            b.gate.register_forward_hook(lambda mod, args, out, sizes=sizes: self.per_tokens.setdefault(
                args[0].shape[0], []).append(sum(sizes[e] for e in out[2].unique().tolist())))
        self.layers = max(1, len(blocks))

    def mb_per_step(self, n: int) -> float:
        calls = self.per_tokens.get(n, [])  # one per sparse layer per step
        experts = sum(calls) / len(calls) * self.layers if calls else 0.0
        return (self.fixed + experts) / 1e6


def run_worker(spec: dict, timeout: float, mode: str = "--worker") -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        r = subprocess.run([sys.executable, __file__, mode, f.name], capture_output=True, text=True,
                           timeout=timeout)
    finally:
        os.unlink(f.name)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"error": f"worker exited {r.returncode}: {(r.stderr or r.stdout)[-2000:]}"}
    return json.loads(lines[-1])


COLUMNS = [("read_s", "file read s", ".1f"), ("load_s", "load s (warm)", ".1f"), ("choice_s", "of it timing s", ".1f"),
           ("load_cached_s", "load s, no timing", ".1f"), ("b1_prefill_tok_s", "b1 prefill tok/s", ".1f"),
           ("b1_tpot_ms", "b1 TPOT ms", ".1f"), ("bB_out_tok_s", "bB out tok/s", ".2f"),
           ("bB_tpot_ms", "bB TPOT ms", ".1f"), ("b1_weights_mb", "b1 weights MB", ".0f"),
           ("bB_weights_mb", "bB weights MB", ".0f")]


def table_text(record: dict) -> str:
    s = record["settings"]
    lines = [f"machine: {record['machine'].get('cpu')} | flags: {' '.join(record['machine'].get('isa') or [])} | "
             f"threads {s['threads']} | quantization {s.get('quantization', 'none')}, linear backend "
             f"{s.get('linear_backend', 'auto')}{' | interleaved' if s.get('interleave') else ''}",
             f"batch 1 and batch {s['batch']} (B); prompt {s['prompt_len']}, out {s['out_len']}, reps {s['reps']}; "
             "ratio = family / dense", ""]
    head = f"{'pair':<15}{'model':<12}" + "".join(f"{c[1]:>18}" for c in COLUMNS)
    for pair, r in record["results"].items():
        lines += [head, "-" * len(head)]
        for which in ("family", "dense"):
            m = r[which]
            if "error" in m:
                lines.append(f"{pair:<15}{which:<12}  error: {m['error'][-300:]}")
                continue
            lines.append(f"{pair:<15}{which:<12}" + "".join(
                f"{('-' if m.get(k) is None else format(m[k], f)):>18}" for k, _, f in COLUMNS))
        lines.append(f"{pair:<15}{'ratio':<12}" + "".join(
            f"{('-' if r['ratio'].get(k) is None else format(r['ratio'][k], '.2f')):>18}" for k, _, _ in COLUMNS))
        lines.append(f"  family: {r['family_model']}\n  dense:  {r['dense_model']}\n")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", nargs="+", choices=list(PAIRS), default=list(PAIRS))
    ap.add_argument("--layers", type=int, default=None, help="layer count for every model (default: the pair's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quantization", default="none",
                    help="quantize both models of a pair at load (appliance's quantization: none, w8a8, w4a8)")
    ap.add_argument("--linear-backend", default="auto",
                    help="both models' linear method (e.g. w8a8_native, w4a8_native; default: chosen per shape)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny widths (each pair's smoke dimensions), 2 layers, prompt 16, out 4, batch 2, 1 rep")
    ap.add_argument("--worker-timeout", type=float, default=3600)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--interleave", action="store_true",
                    help="both models of a pair in one process, their timings alternating rep by rep (a shared "
                         "host's load falls on both alike; the load columns then include the other model's memory)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-interleaved", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(Path(args.worker).read_text()))), flush=True)
        return
    if args.worker_interleaved:
        print(json.dumps(worker_interleaved(json.loads(Path(args.worker_interleaved).read_text()))), flush=True)
        return
    if args.smoke:
        args.layers, args.prompt_len, args.out_len, args.batch, args.reps = 2, 16, 4, 2, 1

    from appliance.bench.common import machine_description

    results = {}
    for pair in args.pairs:
        layers = args.layers or PAIRS[pair][2]
        r = {}
        common = {"threads": args.threads, "prompt_len": args.prompt_len, "out_len": args.out_len,
                  "batch": args.batch, "reps": args.reps, "quantization": args.quantization,
                  "linear_backend": args.linear_backend}
        if args.interleave:
            spec = dict(common)
            for which, key in ((0, "family"), (1, "dense")):
                spec[f"{key}_model"] = r[f"{key}_model"] = str(model_dir(pair, which, layers, args.smoke))
                spec[f"{key}_vocab"] = model_config(pair, which, layers, args.smoke)[1]["vocab_size"]
            log(f"{pair}: running both models interleaved")
            both = run_worker(spec, args.worker_timeout, "--worker-interleaved")
            r["family"], r["dense"] = (both, both) if "error" in both else (both["family"], both["dense"])
        for which, key in () if args.interleave else ((0, "family"), (1, "dense")):
            path = model_dir(pair, which, layers, args.smoke)
            r[f"{key}_model"] = str(path)
            log(f"{pair} {key}: running {path.name}")
            r[key] = run_worker(dict(common, model=str(path),
                                     vocab=model_config(pair, which, layers, args.smoke)[1]["vocab_size"]),
                                args.worker_timeout)
        f, d = r["family"], r["dense"]
        r["ratio"] = {k: (f[k] / d[k] if f.get(k) and d.get(k) else None) for k, _, _ in COLUMNS}
        results[pair] = r
    record = {"bench": "families", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_description(),
              "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "json")}, "results": results}
    text = table_text(record)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1, default=str) + "\n")
        args.json.with_suffix(".txt").write_text(text)


if __name__ == "__main__":
    main()
