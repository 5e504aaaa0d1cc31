"""--kv-cache-dtype end to end on tiny random-weight models (float32 activations): the engine with a
bfloat16 / int8 / fp8 KV cache against the same engine with a float32 cache, and the native kernels
against the reference with the same cache dtype.

Last-token logits vs the float32 cache (prompts of 5-90 tokens, whole-prompt prefill through the
cache), max abs error measured on these models (llama, qwen3; logits of magnitude ~2):
bfloat16 4.3e-3 / 5.4e-3, int8 1.7e-2 / 1.8e-2, fp8_e4m3 8.8e-2 / 7.5e-2, fp8_e5m2 1.8e-1 / 1.6e-1.
The bounds below are about 2x those. Greedy tokens: random tiny models have top-2 logit margins far
below these errors (their distributions are nearly flat), so int8/fp8 greedy continuations do drift
from float32's here (measured: 2 of 4 prompts equal for int8 and e4m3 on llama, 0-1 for e5m2); what
is asserted instead is that the native kernels give token for token the reference's continuation over
the same quantized cache, and that bfloat16 KV keeps float32's tokens on llama (measured: 4 of 4).
The default model's quality with quantized KV is tests/quant/test_kv_cache_dtype_quality.py.
"""
from __future__ import annotations

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.config import EngineConfig
from appliance.engine.model_runner import ModelRunner
from appliance.errors import InvalidRequestError
from helpers import engine_logits

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France. Hello world! Héllo wörld, ünïcode ✓ 東京 and a longer tail of words " * 3,
    "def f(x): return x * 2",
    "Hello",
]
LOGIT_BOUNDS = {"bfloat16": 1e-2, "int8": 4e-2, "fp8_e4m3": 0.2, "fp8": 0.2, "fp8_e5m2": 0.4}
NATIVE_VS_REFERENCE = {"bfloat16": 1e-4, "int8": 5e-4, "fp8": 1e-3, "fp8_e5m2": 2e-3}
MAX_NEW = 24


def _run(path, backend, kv_cache_dtype=None):
    kw = {} if kv_cache_dtype is None else {"kv_cache_dtype": kv_cache_dtype}
    llm = LLM(str(path), dtype="float32", attention_backend=backend, num_kv_blocks=128, **kw)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    outs = llm.generate(prompt_token_ids=ids,
                        sampling_params=SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    tokens = [o.outputs[0].token_ids for o in outs]
    logits = [engine_logits(llm, p) for p in ids]
    llm.engine.check_integrity()
    return llm, tokens, logits


@pytest.fixture(scope="module")
def float_runs(tiny_model_dir):
    out = {}
    for arch in ("llama", "qwen3"):
        _, tokens, logits = _run(tiny_model_dir(arch), "auto")  # today's engine: no kv_cache_dtype given
        out[arch] = (tokens, logits)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8", "fp8", "fp8_e5m2"])
def test_logits_close_to_float_cache_and_native_equals_reference(tiny_model_dir, float_runs, arch, kv_cache_dtype):
    path = tiny_model_dir(arch)
    llm, tokens, logits = _run(path, "auto", kv_cache_dtype)
    want = {"bfloat16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn,
            "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    assert llm.engine.runner.kv_cache.dtype == want
    assert (llm.engine.runner.kv_scale is not None) == (want != torch.bfloat16)
    f_tokens, f_logits = float_runs[arch]
    err = max(float((a - b).abs().max()) for a, b in zip(logits, f_logits))
    assert err <= LOGIT_BOUNDS[kv_cache_dtype], err
    assert err > 0  # the cache really stores another dtype
    # the native kernels (auto) against the reference over the same quantized cache, end to end
    _, r_tokens, r_logits = _run(path, "reference", kv_cache_dtype)
    assert tokens == r_tokens
    # Not bit for bit: the native and reference ops before the cache write (norms, rotary, GEMMs) differ
    # by ~1e-6, which now and then moves a K/V element across a rounding boundary of the cache's
    # dtype, one code step (e4m3: 1/16 relative, e5m2: 1/8). Measured on llama: bfloat16 and int8
    # within 1e-4, fp8_e4m3 2.2e-4; bounds NATIVE_VS_REFERENCE.
    for a, b in zip(logits, r_logits):
        torch.testing.assert_close(a, b, atol=NATIVE_VS_REFERENCE[kv_cache_dtype], rtol=0)
    if kv_cache_dtype == "bfloat16" and arch == "llama":
        assert tokens == f_tokens


def test_auto_is_the_model_dtype(llama_dir, float_runs):
    llm, tokens, logits = _run(llama_dir, "auto", "auto")
    assert llm.engine.runner.kv_cache.dtype == torch.float32 and llm.engine.runner.kv_scale is None
    assert tokens == float_runs["llama"][0]
    for a, b in zip(logits, float_runs["llama"][1]):
        assert torch.equal(a, b)


def test_kv_budget_grows_with_smaller_dtypes(llama_dir):
    # same memory, more blocks: rows of head_size bytes (+ a 4-byte scale) instead of 4 * head_size
    blocks = {}
    for kvd in ("auto", "bfloat16", "int8", "fp8_e4m3"):
        llm = LLM(str(llama_dir), dtype="float32", kv_cache_memory=0.01, kv_cache_dtype=kvd)
        r = llm.engine.runner
        d = r.head_size
        row = {"auto": 4 * d, "bfloat16": 2 * d, "int8": d + 4, "fp8_e4m3": d + 4}[kvd]
        assert r.bytes_per_block == 2 * r.num_layers * r.block_size * r.num_kv_heads * row
        blocks[kvd] = r.num_blocks
    assert blocks["auto"] < blocks["bfloat16"] < blocks["int8"] == blocks["fp8_e4m3"]


def test_unknown_kv_cache_dtype_refused():
    with pytest.raises(InvalidRequestError, match=r"kv_cache_dtype \(--kv-cache-dtype\) must be one of "
                                                  r"auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2, int8; got 'fp4'"):
        EngineConfig(kv_cache_dtype="fp4")


@pytest.mark.parametrize("kvd", ["int8", "fp8", "fp8_e5m2", "bfloat16"])
def test_quantized_kv_refused_on_cuda(kvd):
    # the Triton kernels read caches of the model's dtype only: refused at start, naming flag and value
    with pytest.raises(InvalidRequestError, match=rf"kv_cache_dtype \(--kv-cache-dtype\) '{kvd}' is not "
                                                  r"supported on CUDA with a float32 model; valid there: auto"):
        ModelRunner._kv_cache_dtype(kvd, torch.float32, torch.device("cuda"))
    assert ModelRunner._kv_cache_dtype("bfloat16", torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    assert ModelRunner._kv_cache_dtype(kvd, torch.float32, torch.device("cpu")) != torch.float32
