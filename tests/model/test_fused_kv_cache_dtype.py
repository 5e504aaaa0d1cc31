"""The one-call native decoder stack (``ops.native.llama_layers``) over a quantized or bfloat16 KV cache
(``--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2``; ``bfloat16`` under a float32 model): it writes and reads the
cache's codes and per-row scales through the same native ``reshape_and_cache`` and ``paged_attention`` as
the per-op path (appliance/layers/attention.py), in the same order, so its logits are bitwise the per-op
path's (the tolerance every fused-stack test holds, tests/model/test_parity.py) and so are its greedy
tokens, under chunked prefill, prefix caching and preemption too. Each test asserts which path ran
(``fused_calls``, the models' counter of one-call forwards). How far each dtype's logits are from a float32
cache is tests/model/test_kv_cache_dtype.py's subject; the default model's quality with them is
tests/quant/test_kv_cache_dtype_quality.py's.
"""
from __future__ import annotations

import random

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.config import EngineConfig
from appliance.engine.llm_engine import LLMEngine
from appliance.ops import native
from helpers import drive_engine, engine_logits, skip_unless_backend, stack_at_every_step_size

KV_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
             "bfloat16": torch.bfloat16}
PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France. Hello world! Héllo wörld, ünïcode ✓ 東京 and a longer tail of words " * 3,
    "def f(x): return x * 2",
    "Hello",
]
MAX_NEW = 16


@pytest.fixture(autouse=True)
def _native(monkeypatch):
    assert native.is_available(), native.unavailable_reason()
    stack_at_every_step_size(monkeypatch)  # the stack on prefill-sized steps too


def _llm(path, kv_cache_dtype, dtype="float32", **kw):
    llm = LLM(str(path), dtype=dtype, linear_backend="native" if dtype == "float32" else "native_bf16",
              attention_backend="native", kv_cache_dtype=kv_cache_dtype, **{"num_kv_blocks": 128, **kw})
    runner = llm.engine.runner
    assert runner.kv_cache.dtype == KV_DTYPES[kv_cache_dtype]
    assert (runner.kv_scale is not None) == (kv_cache_dtype != "bfloat16")
    return llm


# (model, activations' dtype, KV cache dtype): Llama and Qwen3 (q/k norms) with every cache dtype under a
# float32 model; Gemma 2 (soft-capped scores, windows) and Gemma 3 (a RoPE table per layer type), whose
# stack calls take Gemma's extras; a bfloat16 model (bf16 activations quantized into the cache)
CASES = ([(arch, "float32", kvd) for arch in ("llama", "qwen3") for kvd in KV_DTYPES]
         + [(g, "float32", kvd) for g in ("gemma2_tied_softcap", "gemma3") for kvd in ("int8", "fp8_e4m3")]
         + [("qwen2", "bfloat16", kvd) for kvd in ("int8", "fp8_e5m2")])


def _model_dir(tiny_model_dir, name):
    if name.startswith("gemma"):
        from test_gemma import CASES as GEMMA

        arch, tie, kw = GEMMA[name]
        return tiny_model_dir(arch, tie, 2, **kw)
    return tiny_model_dir(name)


@pytest.mark.parametrize("name,dtype,kv_cache_dtype", CASES)
def test_fused_stack_equals_per_op_path(tiny_model_dir, name, dtype, kv_cache_dtype, monkeypatch):
    """Last-token logits of whole-prompt prefills and greedy continuations (prefill and decode steps)
    with the stack on and off: bitwise equal, and the stack really ran (and did not, when off)."""
    if dtype == "bfloat16":
        skip_unless_backend("native_bf16", torch.bfloat16)
    llm = _llm(_model_dir(tiny_model_dir, name), kv_cache_dtype, dtype)
    model = llm.engine.runner.model
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    for p in ids:
        before = model.fused_calls
        fused = engine_logits(llm, p)
        assert model.fused_calls == before + 1
        monkeypatch.setattr(native, "FUSED_LAYERS", False)
        per_op = engine_logits(llm, p)
        monkeypatch.setattr(native, "FUSED_LAYERS", True)
        assert model.fused_calls == before + 1
        assert torch.equal(fused, per_op), (kv_cache_dtype, (fused - per_op).abs().max())
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    before = model.fused_calls
    fused_out = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=sp)]
    assert model.fused_calls - before >= MAX_NEW  # every step (prefill and decode) went through the stack
    monkeypatch.setattr(native, "FUSED_LAYERS", False)
    before = model.fused_calls
    per_op_out = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=sp)]
    assert model.fused_calls == before
    assert fused_out == per_op_out
    llm.engine.check_integrity()


SHARED = "Paris is the capital of France. The quick brown fox jumps over the lazy dog. " * 2
SCHEDULES = {
    "chunked_prefill": dict(max_num_batched_tokens=8),
    "prefix_caching": dict(enable_prefix_caching=True),  # staggered: later requests hit SHARED's blocks
    "preemption": dict(num_kv_blocks=16, block_size=8),  # far too small for 6 requests at once
}


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_fused_stack_equals_per_op_path_under_schedules(llama_dir, kv_cache_dtype, schedule, monkeypatch):
    """The engine's greedy tokens over a quantized cache, stack on vs off, with the schedule's feature
    exercised (asserted): chunks of a prompt read the codes and scales earlier chunks wrote, prefix
    cache hits read blocks (codes and scales) other requests wrote, preempted requests rewrite theirs."""
    stagger = 3 if schedule == "prefix_caching" else 0
    got = {}
    for fused in (True, False):
        monkeypatch.setattr(native, "FUSED_LAYERS", fused)
        cfg = dict(dtype="float32", linear_backend="native", attention_backend="native",
                   kv_cache_dtype=kv_cache_dtype, num_kv_blocks=256)
        cfg.update(SCHEDULES[schedule])
        engine = LLMEngine(EngineConfig(model=str(llama_dir), **cfg))
        texts = [SHARED + "Hello", SHARED + "def f(x)", "Hello", "The quick brown fox", SHARED * 2 + "ünïcode ✓"]
        ids = [engine.tokenizer.encode(t) for t in texts] + [[random.Random(0).randrange(3, 384) for _ in range(70)]]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        model = engine.runner.model
        assert engine.runner.kv_cache.dtype == KV_DTYPES[kv_cache_dtype]
        got[fused] = drive_engine(engine, ids, params, stagger)
        assert (model.fused_calls > 0) == fused
        if schedule == "preemption":
            assert engine.scheduler.num_preemptions > 0
        if schedule == "prefix_caching":
            assert engine.kv.pool.num_hits > 0
    assert got[True] == got[False]


def test_stack_refuses_a_quantized_cache_without_scales(llama_dir, monkeypatch):
    """Called with an int8 cache but no scales (or scales for the wrong number of layers), the native
    stack refuses by name rather than read codes as floats."""
    seen = []
    real = native.llama_layers
    monkeypatch.setattr(native, "llama_layers", lambda *a, **k: seen.append((a, k)) or real(*a, **k))
    llm = _llm(llama_dir, "int8")
    engine_logits(llm, [5, 6, 7])
    (args, kw), = seen
    assert len(kw["kv_scales"]) == 2 * llm.engine.runner.num_layers
    with pytest.raises(RuntimeError, match=r"k_scale is required for a Char KV cache"):
        real(*args, **dict(kw, kv_scales=()))
    with pytest.raises(RuntimeError, match=r"kv_scales empty or 2 tensors per layer \(\d+\), got 1"):
        real(*args, **dict(kw, kv_scales=kw["kv_scales"][:1]))


def test_plan_takes_quantized_caches_only_with_scales_the_kernels_take():
    """``_fused_kv_scales``: float caches need none (empty), quantized ones give per layer (k_scale, v_scale)
    in the stack's layout; missing scales, or scales the kernels would not take (another shape or dtype),
    leave the step to the per-op path (None) instead of reaching the native stack."""
    from appliance.models.llama import _fused_kv_scales
    from appliance.ops.reference import kv_scale_shape

    shape = (8, 2, 16, 32)  # [num_blocks, num_kv_heads, block_size, head_size]
    floats = [(torch.zeros(shape), torch.zeros(shape))] * 2
    assert _fused_kv_scales(native, floats, None) == []
    caches = [(torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)) for _ in range(2)]
    scales = [(torch.ones(kv_scale_shape(8, 16, 2)), torch.ones(kv_scale_shape(8, 16, 2))) for _ in range(2)]
    flat = _fused_kv_scales(native, caches, scales)
    assert [t.data_ptr() for t in flat] == [t.data_ptr() for pair in scales for t in pair]
    assert _fused_kv_scales(native, caches, None) is None
    assert _fused_kv_scales(native, caches, scales[:1]) is None
    assert _fused_kv_scales(native, caches, [scales[0], (scales[1][0], torch.ones(8, 16, 2))]) is None
    assert _fused_kv_scales(native, caches, [scales[0], (scales[1][0].double(), scales[1][1])]) is None
