#!/usr/bin/env bash
# The CUDA backend's one GPU run (issue 18, "On a GPU"), about 8 minutes on one H200:
#   1. tests/cuda on the device: the Triton kernels against the reference in fp32, fp16 and bf16,
#      tiny models generating through the CUDA op set with real decode CUDA graphs, the graph
#      padding path, --device handling (~2 min, Triton compiles per shape);
#   2. bench/cuda_check.py: graph replay vs eager for every captured size, kernel GB/s against the
#      copy bandwidth, nano-vllm's workload and batch-1 TPOT on random-weight Qwen2.5-0.5B and
#      Llama-3.2-1B shapes in bf16 (~5 min).
# Results go to $OUT when set (the device runner's return folder), else bench/results/.
# Needs: torch with CUDA, triton, and this project's Python dependencies (transformers, tokenizers,
# safetensors, psutil, numpy, typer, fastapi, pytest). WHEELHOUSE=dir installs missing ones offline.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
RESULTS=${OUT:-bench/results}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
if [ -n "${WHEELHOUSE:-}" ]; then
  "$PY" -m pip install -q --no-index --find-links "$WHEELHOUSE" transformers tokenizers safetensors psutil \
    numpy typer rich fastapi uvicorn gguf pytest httpx 2>&1 | tail -3
fi
"$PY" - <<'PY' || { echo "cuda_check: a dependency is missing (see above)"; exit 2; }
import importlib, sys
missing = [m for m in ("torch", "triton", "transformers", "tokenizers", "safetensors", "psutil", "numpy", "typer",
                       "fastapi", "pytest") if importlib.util.find_spec(m) is None]
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if missing or not torch.cuda.is_available():
    print("missing:", ", ".join(missing) or "-", "| cuda available:", torch.cuda.is_available())
    sys.exit(1)
import triton
print("triton", triton.__version__)
PY

start=$(date +%s)
timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/cuda -rs 2>&1 | tee "$RESULTS/cuda_check_tests.txt" | tail -40
tests_rc=${PIPESTATUS[0]}
echo "tests/cuda: exit $tests_rc in $(( $(date +%s) - start )) s"

start=$(date +%s)
timeout 330 "$PY" bench/cuda_check.py --json "$RESULTS/cuda_check.json" 2>&1 | tee "$RESULTS/cuda_check.log" | tail -30
bench_rc=${PIPESTATUS[0]}
echo "bench/cuda_check.py: exit $bench_rc in $(( $(date +%s) - start )) s"
[ -f "$RESULTS/cuda_check.json" ] && cat "$RESULTS/cuda_check.json"
exit $(( tests_rc != 0 || bench_rc != 0 ))
