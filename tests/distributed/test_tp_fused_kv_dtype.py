"""The one-call native decoder stack with a quantized KV cache under tensor parallelism: each rank's stack
writes and reads its heads' int8 / fp8 codes and per-row scales (its runner's own scale tensors) through the
same native kernels as the per-op path. TP=2 with the stack on both ranks gives the per-op path's TP=2
greedy tokens (``APPLIANCE_FUSED_LAYERS=0`` turns it off in the workers too) under chunked prefill, prefix
caching and preemption, and the ranks' counters show which path ran."""
from __future__ import annotations

import pytest
from helpers import drive_engine
from test_tp_engine import PARAMS, prompts
from test_tp_fused import CONFIG, _fused_calls

from appliance.config import EngineConfig
from appliance.engine.llm_engine import LLMEngine
from appliance.ops import native


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_fused_tp2_with_quantized_kv_equals_per_op_tp2(tiny_model_dir, kv_cache_dtype, monkeypatch):
    assert native.is_available(), native.unavailable_reason()
    path = tiny_model_dir("llama")
    got = {}
    for fused in (True, False):
        # one TP engine per process at a time (a second one would form its own gloo group)
        monkeypatch.setenv("APPLIANCE_FUSED_LAYERS", "1" if fused else "0")
        monkeypatch.setattr(native, "FUSED_LAYERS", fused)
        eng = LLMEngine(EngineConfig(model=str(path), linear_backend="native", tensor_parallel_size=2,
                                     kv_cache_dtype=kv_cache_dtype, **CONFIG))
        try:
            assert str(eng.runner.kv_cache.dtype).endswith({"int8": "int8", "fp8_e4m3": "e4m3fn"}[kv_cache_dtype])
            before = _fused_calls(eng)
            got[fused] = drive_engine(eng, prompts(eng.tokenizer), PARAMS)
            calls = [a - b for a, b in zip(_fused_calls(eng), before)]
            assert eng.scheduler.num_preemptions > 0
            if fused:
                assert all(c >= PARAMS.max_tokens for c in calls) and calls[0] == calls[1], calls
            else:
                assert calls == [0, 0]
        finally:
            eng.runner.close()
    assert got[True] == got[False]
