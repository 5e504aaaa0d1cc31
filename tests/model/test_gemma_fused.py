"""Gemma 2 and 3 on the one-call native decoder stack (``ops.native.llama_layers`` with Gemma's extras:
sandwich norms with (1 + w) factors, GeGLU with tanh GELU, a RoPE table per layer type, local/global windows,
q/k norms, the attention soft-cap, the scaled embedding before the call): with every linear on a method the
stack applies and native ops, each step is one call; greedy tokens equal transformers' ``generate``, last-token
logits within 1e-4 of transformers' and exactly the per-op path's (the same kernels in the same order).
In the ISA-capped runs (tests/isa/test_isa_caps.py)."""
from __future__ import annotations

import pytest
import torch
from helpers import engine_logits, hf_greedy, stack_at_every_step_size
from test_gemma import CASES, MAX_NEW, PROMPTS

from appliance import LLM, SamplingParams
from appliance.ops import native


@pytest.fixture(autouse=True)
def _stack_at_every_step_size(monkeypatch):
    stack_at_every_step_size(monkeypatch)  # the stack on prefill-sized steps too


def _counting(monkeypatch):
    calls = []
    real = native.llama_layers
    monkeypatch.setattr(native, "llama_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("case", ["gemma2", "gemma2_tied_softcap", "gemma3", "gemma3_tied_scaled", "gemma3_mm"])
def test_fused_stack_matches_transformers_and_per_op_path(tiny_model_dir, case, monkeypatch):
    assert native.is_available(), native.unavailable_reason()
    calls = _counting(monkeypatch)
    arch, tie, kw = CASES[case]
    path = tiny_model_dir(arch, tie, 2, **kw)
    llm = LLM(str(path), dtype="float32", linear_backend="native", attention_backend="native", num_kv_blocks=128)
    mlps = [m for m in llm.engine.runner.model.modules() if hasattr(m, "gate_up_proj")]
    assert mlps and not any(m.gate_up_proj.fused_silu_mul for m in mlps)  # GeGLU: no SiLU epilogue
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompt_token_ids=ids,
                        sampling_params=SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    steps = len(calls)
    assert steps >= MAX_NEW  # every step (prefill and decode) went through the fused call
    assert llm.engine.runner.model.fused_calls == steps
    hf, ref = hf_greedy(path, ids, MAX_NEW)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for p in ids:
        fused = engine_logits(llm, p)
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float()
        torch.testing.assert_close(fused, want, atol=1e-4, rtol=0)
        monkeypatch.setattr(native, "FUSED_LAYERS", False)
        per_op = engine_logits(llm, p)
        monkeypatch.setattr(native, "FUSED_LAYERS", True)
        assert torch.equal(fused, per_op), (fused - per_op).abs().max()
    assert len(calls) == steps + len(ids)  # the per-op probes did not call it


@pytest.mark.parametrize("linear,dtype", [("onednn", "float32"), ("torch", "float32"), ("native_bf16", "bfloat16")])
def test_fused_stack_equals_per_op_path_for_other_float_backends(tiny_model_dir, linear, dtype, monkeypatch):
    """oneDNN's and torch's float32 linears and the bf16 GEMM in the stack (a bf16 model's activations and
    KV cache with the norms' float32 factors): logits and greedy tokens exactly the per-op path's."""
    assert native.is_available(), native.unavailable_reason()
    calls = _counting(monkeypatch)
    arch, tie, kw = CASES["gemma3_tied_scaled"]
    llm = LLM(str(tiny_model_dir(arch, tie, 2, **kw)), dtype=dtype, linear_backend=linear,
              attention_backend="native", num_kv_blocks=128)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    for p in ids:
        fused = engine_logits(llm, p)
        monkeypatch.setattr(native, "FUSED_LAYERS", False)
        per_op = engine_logits(llm, p)
        monkeypatch.setattr(native, "FUSED_LAYERS", True)
        assert torch.equal(fused, per_op), (linear, dtype, (fused - per_op).abs().max())
    assert len(calls) == len(ids)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    fused_out = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=sp)]
    monkeypatch.setattr(native, "FUSED_LAYERS", False)
    per_op_out = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=sp)]
    assert fused_out == per_op_out


def test_reference_ops_stay_per_op(tiny_model_dir, monkeypatch):
    """What the stack does not take runs op by op: the reference ops. (A quantized KV cache it takes:
    tests/model/test_fused_kv_cache_dtype.py.)"""
    calls = _counting(monkeypatch)
    arch, tie, kw = CASES["gemma3"]
    path = str(tiny_model_dir(arch, tie, 2, **kw))
    llm = LLM(path, dtype="float32", linear_backend="native", num_kv_blocks=64, attention_backend="reference")
    engine_logits(llm, list(range(3, 20)))
    assert llm.engine.runner.model.fused_calls == 0
    assert calls == []
