"""Where a GGUF's start-up time goes (issue 14, "a start-up of seconds"): ``LLM(FILE, quantization=gguf)``
cold (a fresh APPLIANCE_CACHE_DIR: tokenizer built, every linear backend choice timed; the built
native kernels are linked in) and warm (a second process on that cache), each in a fresh process
under cProfile, with the cumulative seconds of each phase:

- ``tokenizer``: ``gguf_loader.tokenizer_dir`` (built from the file's vocabulary once, then cached);
- ``load``: ``models.loader.load`` (GGUF parse, model build, ``load_weights``: decoding the blocks
  into the canonical form and copying them into the layers);
- ``measure``: the timing of linear backend candidates (``LinearBase.measure``; cold only);
- ``pack``: packing every layer for its chosen method (``set_backend``);
- ``total``: the constructor's wall time without the profiler (a separate run).

cProfile adds a little to Python-heavy phases; the kernels and numpy dominate these. Usage (the
model files are bench_gguf.py's, written with llama.cpp's llama-quantize):

    .venv/bin/python bench/bench_gguf_load.py ~/.cache/appliance/bench-models/qwen2.5-0.5b-shape-L24-seed0-v1/Q4_K_M.gguf
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = r"""
import cProfile, json, pstats, sys, time
import torch
from appliance import LLM
spec = json.loads(sys.argv[1])
kw = dict(dtype="float32", quantization="gguf", num_threads=spec["threads"], max_model_len=64,
          kv_cache_memory=0.25, enable_prefix_caching=False)
if spec["profile"]:
    pr = cProfile.Profile()
    pr.enable()
t = time.perf_counter()
LLM(spec["model"], **kw)
total = time.perf_counter() - t
out = {"total": total}
if spec["profile"]:
    pr.disable()
    st = pstats.Stats(pr).stats
    def cum(file_end, func):
        return sum(v[3] for (f, _, fn), v in st.items() if f.endswith(file_end) and fn == func)
    out = {"profiled_total": total, "tokenizer": cum("models/gguf_loader.py", "tokenizer_dir"),
           "load": cum("models/loader.py", "load"), "measure": cum("layers/quant.py", "measure")
           + cum("layers/linear.py", "measure"), "pack": cum("layers/quant.py", "set_backend")
           + cum("layers/linear.py", "set_backend")}
print("RESULT " + json.dumps(out), flush=True)
"""


def run(model: str, cache: Path, threads: int, profile: bool) -> dict:
    env = dict(os.environ, APPLIANCE_CACHE_DIR=str(cache), PYTHONPATH=str(REPO))
    spec = json.dumps({"model": model, "threads": threads, "profile": profile})
    r = subprocess.run([sys.executable, "-c", _CHILD, spec], env=env, capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or not lines:
        raise SystemExit(f"worker exited {r.returncode}: {r.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a .gguf file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-profile", action="store_true", help="wall times only")
    args = ap.parse_args()
    real = Path(os.environ.get("APPLIANCE_CACHE_DIR", Path.home() / ".cache" / "appliance")).expanduser()
    rows = []
    for profile in ([False] if args.no_profile else [False, True]):
        cache = Path(tempfile.mkdtemp(prefix="gguf-load-"))
        try:
            if (real / "native").is_dir():  # the built kernels: an install step, not a model load
                (cache / "native").symlink_to(real / "native")
            for what in ("cold", "warm"):
                rows.append((what, run(args.model, cache, args.threads, profile)))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    for what, r in rows:
        print(what, "  ".join(f"{k} {v:.2f} s" for k, v in r.items()))


if __name__ == "__main__":
    main()
