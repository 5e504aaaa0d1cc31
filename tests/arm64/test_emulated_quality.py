"""W8A8 quality on emulated Arm: the default model's perplexity through each Arm W8A8 route stays
within +3% of float's, as tests/quant/test_default_model_quality.py requires on x86.

In the Debian arm64 root under qemu (see tests/arm_tools.py), as Neoverse V2 (SVE, BF16, I8MM: the
native kernel's SMMLA route) and Neoverse N1 (dotprod only: SDOT), oneDNN's int8 GEMM (ACL) on both,
one process per profile scores the first WINDOW tokens of the held-out text with float32 (the
native GEMM) and with each W8A8 backend. Under qemu torch runs at ~0.1-0.2 GFLOP/s, so the window is
short (one 64-token prefill per configuration, ~2-4 min each); a 63-prediction perplexity is noisier
than the x86 test's 2000+, so the same window is scored on this host too, and the Arm float
perplexity must equal it (the emulated float path is right), with each W8A8 ratio within the bound.

Opt-in like every emulated-Arm test: APPLIANCE_ARM64_ROOTFS (``make test`` sets it)."""
from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from arm_tools import arm64_root, run_in_root

WINDOW = 64
BOUND = 1.03  # W8A8 perplexity at most 3% above float's (issue 13; the x86 test's bound)
TEXT = Path(__file__).resolve().parents[1] / "quant" / "data" / "heldout_en.txt"
ROUTES = {"v2": {"float": {"linear_backend": "native"},
                 "w8a8_onednn": {"quantization": "w8a8", "linear_backend": "w8a8_onednn"},
                 "w8a8_native": {"quantization": "w8a8", "linear_backend": "w8a8_native"}},
          "n1": {"float": {"linear_backend": "native"},
                 "w8a8_onednn": {"quantization": "w8a8", "linear_backend": "w8a8_onednn"},
                 "w8a8_native": {"quantization": "w8a8", "linear_backend": "w8a8_native"}}}

# Scores the window once per configuration. The quantized models' float lm_head is left to `auto`,
# whose timing (GEMMs of 1/32/256 rows, minutes under qemu) is replaced by a fixed preference.
SCRIPT = """
import json, math, sys
import torch
from appliance import LLM, SamplingParams
from appliance.layers import linear
torch.set_num_threads(1)
linear.Linear.measure = lambda self, cands, rows, timer: {c: 0.0 if c == "native" else 1.0 for c in cands}
ids, configs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
res = {}
for name, kw in configs.items():
    llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory=0.05, enable_prefix_caching=False, **kw)
    o = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    lps = [getattr(lp[t], "logprob", lp[t]) for t, lp in zip(ids[1:], o.prompt_logprobs[1:])]
    res[name] = math.exp(-sum(lps) / len(lps))
    del llm
print("RESULT " + json.dumps(res))
"""


def _perplexity(llm, ids: list[int]) -> float:
    from appliance import SamplingParams

    o = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    lps = [getattr(lp[t], "logprob", lp[t]) for t, lp in zip(ids[1:], o.prompt_logprobs[1:])]
    return math.exp(-sum(lps) / len(lps))


_done: dict = {}


@pytest.fixture(scope="module")
def scores():
    root = arm64_root()
    if "error" in _done:
        pytest.fail(_done["error"])
    if "scores" in _done:
        return _done["scores"]
    from appliance import LLM

    llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory=0.05, enable_prefix_caching=False,
              linear_backend="native")
    ids = llm.get_tokenizer().encode(TEXT.read_text())[:WINDOW]
    host = _perplexity(llm, ids)
    del llm
    (root / "tmp").mkdir(exist_ok=True)

    def run(profile):
        r = run_in_root(profile, "/opt/venv/bin/python", "-c", SCRIPT, json.dumps(ids), json.dumps(ROUTES[profile]),
                        timeout=3600)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if r.returncode != 0 or line is None:
            raise AssertionError(f"{profile}: scoring failed (rc {r.returncode}):\n{r.stdout[-3000:]}")
        return json.loads(line[len("RESULT "):]) | {"seconds": r.seconds}

    try:
        with ThreadPoolExecutor(len(ROUTES)) as pool:
            got = dict(zip(ROUTES, pool.map(run, ROUTES)))
    except Exception as e:
        _done["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        raise
    _done["scores"] = {"host_float": host, **got}
    print(f"\nemulated W8A8 perplexity over {WINDOW} tokens: {_done['scores']}")
    return _done["scores"]


@pytest.mark.parametrize("profile", list(ROUTES))
def test_emulated_float_perplexity_equals_the_host(scores, profile):
    # the same fp32 model on the same tokens: only summation order differs between the kernels
    assert scores[profile]["float"] == pytest.approx(scores["host_float"], rel=1e-3), scores


@pytest.mark.parametrize("profile,route", [(p, r) for p, rs in ROUTES.items() for r in rs if r != "float"])
def test_emulated_w8a8_perplexity_within_bound_of_float(scores, profile, route):
    ratio = scores[profile][route] / scores[profile]["float"]
    assert ratio <= BOUND, f"{profile} {route}: perplexity {scores[profile][route]:.3f} vs float " \
                           f"{scores[profile]['float']:.3f} (x{ratio:.4f} > x{BOUND})"
