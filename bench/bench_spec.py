"""Speculative decoding: batch-1 (and concurrency-16) decode tok/s of the offline engine with and
without n-gram and draft-model speculation, on input-grounded prompts (edit a given text; code
completion) and open-ended chat; acceptance rate and mean accepted length per row. The default
model (SmolLM2-135M) is the target; the draft is the target's first 2 layers unless --draft is given.
The same as `appliance bench spec` (arguments pass through):

    .venv/bin/python bench/bench_spec.py --json bench/results/spec.json
    .venv/bin/python bench/bench_spec.py --output-len 16 --concurrency 1 --workloads edit   # quick check

The 0.5B shape (issue 19 asks for one): ``--target expanded-0.5b`` is the default model widened
function-preservingly to 481M parameters (appliance/bench/expanded_model.py: a 0.5B model's cost per
token, SmolLM2-135M's text), drafted by the default model's Q4_1 GGUF run quantized
(bench/results/spec_0.5b.txt):

    .venv/bin/python bench/bench_spec.py --target expanded-0.5b --draft self-gguf --draft-quantization gguf \
        --llamacpp --output-len 64 --json bench/results/spec_0.5b.json
"""
from __future__ import annotations

import sys

from appliance.cli import app

if __name__ == "__main__":
    # As `appliance bench spec`: argv[1] must be "bench" for the bench callback to re-execute this
    # process under the engine's worker environment (mimalloc preloaded, OpenMP threads pinned,
    # static schedule), as `appliance serve` runs its engine. Calling the app in-process with this
    # script's own argv skipped that, and the first spec.json ran on glibc malloc with unpinned
    # threads, which is not the engine the serve benchmarks measure.
    sys.argv[1:] = ["bench", "spec", *sys.argv[1:]]
    sys.exit(app(sys.argv[1:]))
