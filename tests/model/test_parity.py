"""Greedy output and logits against transformers on tiny random-weight models (float32)."""
from __future__ import annotations

import pytest
import torch
import transformers

from appliance import LLM, SamplingParams
from helpers import engine_logits, hf_greedy, skip_unless_backend, stack_at_every_step_size

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France. Hello world! Héllo wörld, ünïcode ✓ 東京 and a longer tail of words",
    "def f(x): return x * 2",
    "Hello",
]
CASES = [
    ("llama", False, 2),
    ("llama", True, 2),  # tied embeddings
    ("llama", False, 1),  # MQA
    ("llama", False, 4),  # MHA
    ("mistral", False, 2),
    ("qwen2", False, 2),  # q/k/v bias
    ("qwen3", False, 2),  # q/k norm, head_dim != hidden / heads
]
MAX_NEW = 24


@pytest.mark.parametrize("arch,tie,kv", CASES)
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_greedy_and_logits_match_transformers(tiny_model_dir, arch, tie, kv, backend):
    path = tiny_model_dir(arch, tie, kv)
    llm = LLM(str(path), dtype="float32", attention_backend=backend, num_kv_blocks=128)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompt_token_ids=ids,
                        sampling_params=SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    hf, ref = hf_greedy(path, ids, MAX_NEW)
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r
        assert o.outputs[0].finish_reason == "length"
    for p in ids:
        with torch.no_grad():
            ref_logits = hf(torch.tensor([p])).logits[0, -1].float()
        got = engine_logits(llm, p)
        torch.testing.assert_close(got, ref_logits, atol=1e-4, rtol=0)
    llm.engine.check_integrity()
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.num_blocks


def test_llama3_rope_scaling_matches_transformers(tiny_model_dir):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    path = tiny_model_dir("llama", rope_scaling=scaling, rope_theta=500000.0)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128)
    ids = llm.get_tokenizer().encode(PROMPTS[1] * 3)
    assert len(ids) > 64  # past the original context, where the scaling matters
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(engine_logits(llm, ids), ref, atol=1e-4, rtol=0)


def test_max_model_len_defaults_to_max_position_embeddings(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64)
    assert llm.engine.max_model_len == 512
    small = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=100)
    assert small.engine.max_model_len == 100


@pytest.mark.parametrize("arch,tie", [("llama", True), ("qwen2", False)])
@pytest.mark.parametrize("linear", ["onednn", "native"])
def test_prepacked_linear_matches_transformers(tiny_model_dir, arch, tie, linear):
    """Both prepacked float backends (oneDNN's blocked layout; the native panel GEMM, with the qkv bias
    of Qwen2) give transformers' greedy tokens and last-token logits within 1e-4."""
    path = tiny_model_dir(arch, tie, 2)
    llm = LLM(str(path), dtype="float32", linear_backend=linear, num_kv_blocks=128)
    assert set(llm.engine.runner.linear_backends.values()) == {linear}
    # what the banner and `appliance generate` report, per layer group
    assert llm.engine.runner.linear_groups == dict.fromkeys(
        ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"), linear)
    mlps = [m for m in llm.engine.runner.model.modules() if hasattr(m, "gate_up_proj")]
    # native: the MLP's silu(gate) * up runs in the gate/up GEMM's epilogue
    assert mlps and all(m.gate_up_proj.fused_silu_mul == (linear == "native") for m in mlps)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompt_token_ids=ids,
                        sampling_params=SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    hf, ref = hf_greedy(path, ids, MAX_NEW)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for p in ids:
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float()
        torch.testing.assert_close(engine_logits(llm, p), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch,tie,kv", [("llama", True, 2), ("llama", False, 1), ("qwen2", False, 2),
                                         ("qwen3", False, 2)])
def test_fused_native_layers_match_per_op_path_and_transformers(tiny_model_dir, arch, tie, kv, monkeypatch):
    """Every linear on the native GEMM and native ops: the decoder stack runs as one native call
    (ops.native.llama_layers; q/k/v bias of Qwen2, q/k norm of Qwen3, MQA). It gives transformers'
    greedy tokens and logits (1e-4), and exactly the per-op path's logits: the same kernels in the
    same order."""
    stack_at_every_step_size(monkeypatch)
    from appliance.ops import native

    assert native.is_available(), native.unavailable_reason()
    calls = []
    real = native.llama_layers
    monkeypatch.setattr(native, "llama_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    path = tiny_model_dir(arch, tie, kv)
    llm = LLM(str(path), dtype="float32", linear_backend="native", attention_backend="native", num_kv_blocks=128)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompt_token_ids=ids,
                        sampling_params=SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    steps = len(calls)
    assert steps >= MAX_NEW  # every step (prefill and decode) went through the fused call
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
        assert torch.equal(fused, per_op)
    assert len(calls) == steps + len(ids)  # the per-op probes did not call it


@pytest.mark.parametrize("linear,dtype", [("onednn", "float32"), ("torch", "float32"), ("onednn", "bfloat16"),
                                          ("native", "float32"), ("native_bf16", "bfloat16")])
def test_fused_layers_equal_per_op_path_for_every_float_backend(tiny_model_dir, linear, dtype, monkeypatch):
    """The one-call decoder stack takes every float linear backend (oneDNN's packed weights through
    mkldnn::_linear_pointwise, F.linear, the native GEMM) and bfloat16 as well: the logits of every
    step are bitwise the per-op path's, which runs the same functions one Python call at a time."""
    stack_at_every_step_size(monkeypatch)
    from appliance.ops import native

    skip_unless_backend(linear, getattr(torch, dtype))
    calls = []
    real = native.llama_layers
    monkeypatch.setattr(native, "llama_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    llm = LLM(str(tiny_model_dir("qwen2", False, 2)), dtype=dtype, linear_backend=linear,
              attention_backend="native", num_kv_blocks=128)
    assert set(llm.engine.runner.linear_backends.values()) == {linear}
    tok = llm.get_tokenizer()
    for p in PROMPTS:
        ids = tok.encode(p)
        fused = engine_logits(llm, ids)
        monkeypatch.setattr(native, "FUSED_LAYERS", False)
        per_op = engine_logits(llm, ids)
        monkeypatch.setattr(native, "FUSED_LAYERS", True)
        assert torch.equal(fused, per_op), (linear, dtype)
    assert len(calls) == len(PROMPTS)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = [tok.encode(p) for p in PROMPTS]
    fused_out = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=sp)]
    monkeypatch.setattr(native, "FUSED_LAYERS", False)
    per_op_out = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=sp)]
    assert fused_out == per_op_out


@pytest.mark.parametrize("arch,tie", [("llama", True), ("qwen2", False)])
def test_native_bf16_linear_matches_transformers_bf16(tiny_model_dir, arch, tie):
    """A bfloat16 model on the bf16 panel GEMM (every layer, lm_head included) against transformers in
    bfloat16, held to the deviation F.linear itself has there: both round every activation to bf16, so
    they differ by summation order only; the native_bf16 logits may deviate from transformers' at most
    1.5x as much as the torch backend's do (plus 1e-2). A wrong panel or pair would be off by O(1)."""
    path = tiny_model_dir(arch, tie, 2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    dev = {}
    for linear in ("native_bf16", "torch"):
        llm = LLM(str(path), dtype="bfloat16", linear_backend=linear, num_kv_blocks=128)
        assert set(llm.engine.runner.linear_backends.values()) == {linear}
        tok = llm.get_tokenizer()
        ids = [tok.encode(p) for p in PROMPTS]
        dev[linear] = 0.0
        for p in ids:
            with torch.no_grad():
                want = hf(torch.tensor([p])).logits[0, -1].float()
            dev[linear] = max(dev[linear], (engine_logits(llm, p).float() - want).abs().max().item())
    assert dev["native_bf16"] <= 1.5 * dev["torch"] + 1e-2, dev


QUANT_FUSED = {"w8a8_native": "w8a8", "w8a16_int8pack": "w8a8", "w4a16_int4pack": "w4a8", "w4a8_dynquant": "w4a8"}


@pytest.mark.parametrize("linear", list(QUANT_FUSED))
def test_fused_layers_equal_per_op_path_for_every_quantized_backend(tiny_model_dir, linear, monkeypatch):
    """Quantized layers run in the one-call decoder stack too, each kind applied there as its method's
    ``apply`` and QuantLinear.forward do (the W4 zero points' group-sum term included): the logits
    of every step are bitwise the per-op path's, and so are the greedy tokens."""
    from appliance.ops import native

    skip_unless_backend(linear, torch.float32)
    calls = []
    real = native.llama_layers
    monkeypatch.setattr(native, "llama_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    llm = LLM(str(tiny_model_dir("qwen2", False, 2)), dtype="float32", quantization=QUANT_FUSED[linear],
              linear_backend=linear, attention_backend="native", num_kv_blocks=128)
    # keyed by shape: the quantized layers' keys start with the scheme (the lm_head stays float)
    quant = {k: v for k, v in llm.engine.runner.linear_backends.items() if k.startswith(QUANT_FUSED[linear])}
    assert quant and set(quant.values()) == {linear}, llm.engine.runner.linear_backends
    tok = llm.get_tokenizer()
    for p in PROMPTS:
        ids = tok.encode(p)
        fused = engine_logits(llm, ids)
        monkeypatch.setattr(native, "FUSED_LAYERS", False)
        per_op = engine_logits(llm, ids)
        monkeypatch.setattr(native, "FUSED_LAYERS", True)
        assert torch.equal(fused, per_op), (linear, (fused - per_op).abs().max())
    assert len(calls) == len(PROMPTS)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = [tok.encode(p) for p in PROMPTS]
    fused_out = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=sp)]
    monkeypatch.setattr(native, "FUSED_LAYERS", False)
    per_op_out = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=sp)]
    assert fused_out == per_op_out


def test_fused_layers_not_used_with_onednn_int8(tiny_model_dir, monkeypatch):
    """oneDNN's int8 GEMM has no kind in the stack: a model using it runs op by op."""
    from appliance.ops import native

    skip_unless_backend("w8a8_onednn", torch.float32)
    calls = []
    real = native.llama_layers
    monkeypatch.setattr(native, "llama_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    llm = LLM(str(tiny_model_dir("llama", False, 2)), dtype="float32", quantization="w8a8",
              linear_backend="w8a8_onednn", attention_backend="native", num_kv_blocks=128)
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3 and calls == []