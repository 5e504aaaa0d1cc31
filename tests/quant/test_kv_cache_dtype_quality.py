"""The default model (SmolLM2-135M-Instruct, float32) with a quantized KV cache: perplexity on the
held-out text (tests/quant/data/heldout_en.txt, 512-token windows scored through the paged cache,
so every score reads K/V back from it) against bfloat16 KV, and the capital of France.

Bound: int8 and fp8 (= fp8_e4m3, vLLM's meaning) KV within +2% of bfloat16 KV's perplexity (issue
19's bar, not fitted). fp8_e5m2 (2 mantissa bits) does not meet it: measured +2.1%, held to +3%.
Measured on the development host (x86 AVX2, native kernels, float32 activations): PPL_MEASURED."""
from __future__ import annotations

import pytest

from appliance import LLM, SamplingParams
from test_default_model_quality import KW, _perplexity

# perplexity measured with each KV dtype (float32 activations), for the record
PPL_MEASURED = {"auto (float32)": 19.1438, "bfloat16": 19.1454, "int8": 19.1589, "fp8_e4m3": 19.1533,
                "fp8_e5m2": 19.5491}
BOUNDS = {"int8": 1.02, "fp8_e4m3": 1.02, "fp8_e5m2": 1.03}


@pytest.fixture(scope="module")
def ppl():
    out = {}
    for kvd in ("bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"):
        llm = LLM(**KW, kv_cache_dtype=kvd)
        out[kvd] = (_perplexity(llm), llm)
        if kvd != "int8":
            del llm
            out[kvd] = (out[kvd][0], None)
    return out


@pytest.mark.parametrize("kvd", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_perplexity_close_to_bf16_kv(ppl, kvd):
    base, got = ppl["bfloat16"][0], ppl[kvd][0]
    assert got <= BOUNDS[kvd] * base, (kvd, got, base)


def test_int8_kv_still_answers_paris(ppl):
    llm = ppl["int8"][1]
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    assert "Paris" in out[0].outputs[0].text, out[0].outputs[0].text
