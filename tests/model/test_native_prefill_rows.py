"""A float32 model on the ``native`` linear method: decode-sized steps run the one-call decoder stack with
the native panel kernel (fastest at a few rows); steps of more than ``NATIVE_F32_MAX_ROWS`` tokens run the
per-op path, where the same packed panels go through torch's batched GEMM (the panel kernel has no
blocking over rows and lost 3-6x at prefill sizes, so ``auto`` never chose it and batch-1 decode ran a
slower method). Logits within 1e-4 of transformers' on both paths, greedy tokens equal, and each step's
path asserted (``fused_calls``)."""
from __future__ import annotations

import torch

from appliance import LLM, SamplingParams
from appliance.layers.methods import floating
from appliance.ops import native
from helpers import engine_logits, hf_greedy


def test_prefill_sized_steps_leave_the_stack_and_match_transformers(tiny_model_dir):
    assert native.is_available(), native.unavailable_reason()
    path = tiny_model_dir("llama")
    llm = LLM(str(path), dtype="float32", linear_backend="native", attention_backend="native", num_kv_blocks=128)
    model = llm.engine.runner.model
    assert {m.backend for m in model.modules() if hasattr(m, "silu_mul_next")} == {"native"}
    limit = floating.NATIVE_F32_MAX_ROWS
    short = list(range(5, 5 + limit))  # exactly the limit: the stack
    long = [(7 * i) % 200 + 3 for i in range(3 * limit + 1)]  # above it: the per-op path
    fresh = long[::-1]  # not in the prefix cache: its whole prefill is one step
    hf, ref = hf_greedy(path, [fresh], 6)
    for ids, stack in ((short, True), (long, False)):
        before = model.fused_calls
        got = engine_logits(llm, ids)
        assert model.fused_calls == before + int(stack), (len(ids), stack)
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # a whole generation: the prompt's prefill per op, every decode step (1 row) in the stack
    before = model.fused_calls
    out = llm.generate(prompt_token_ids=[fresh], sampling_params=SamplingParams(temperature=0, max_tokens=6,
                                                                                ignore_eos=True))
    assert out[0].outputs[0].token_ids == ref[0]
    assert model.fused_calls - before == 5
