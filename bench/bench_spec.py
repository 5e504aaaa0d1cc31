"""Speculative decoding: batch-1 (and concurrency-16) decode tok/s of the offline engine with and
without n-gram and draft-model speculation, on input-grounded prompts (edit a given text; code
completion) and open-ended chat; acceptance rate and mean accepted length per row. The default
model (SmolLM2-135M) is the target; the draft is the target's first 2 layers unless --draft is given.
The same as `appliance bench spec` (arguments pass through):

    .venv/bin/python bench/bench_spec.py --json bench/results/spec.json
    .venv/bin/python bench/bench_spec.py --output-len 16 --concurrency 1 --workloads edit   # quick check
"""
from __future__ import annotations

import sys

from appliance.cli import app

if __name__ == "__main__":
    sys.exit(app(["bench", "spec", *sys.argv[1:]]))
