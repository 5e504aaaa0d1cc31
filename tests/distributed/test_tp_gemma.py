"""Gemma 2 and 3 under tensor parallelism (issue 17): heads, MLP width and vocabulary sharded as Llama's
(tiny models, 4 query / 2 KV heads: 2 / 1 per rank), each rank running its shard through the one-call native
stack with Gemma's extras and the shared-memory all-reduce. TP=2 (rank 0 here, rank 1 a spawned worker) gives
TP=1's greedy tokens under chunked prefill, prefix caching and preemption, and TP=1's and transformers' logits
within 1e-4; the per-op path at TP=2 (APPLIANCE_FUSED_LAYERS=0, in the workers too) gives the same logits."""
from __future__ import annotations

import pytest
import torch
from helpers import drive_engine, engine_logits, stack_at_every_step_size
from test_tp_engine import PARAMS, prompts

from appliance import LLM
from appliance.config import EngineConfig
from appliance.engine.llm_engine import LLMEngine
from appliance.ops import native

CONFIG = dict(dtype="float32", linear_backend="native", attention_backend="native", block_size=8, num_kv_blocks=24,
              max_num_batched_tokens=16, enable_prefix_caching=True)


WINDOW = 8  # shorter than most prompts: the local layers' window bites
# (tiny_models arch, tie, config overrides), as tests/model/test_gemma.py's cases of the same names
CASES = {
    # tied (vocabulary-parallel head on the embedding), final soft-cap, linear RoPE on the global layer only
    "gemma3_tied_scaled": ("gemma3", True, dict(
        sliding_window=WINDOW, final_logit_softcapping=3.0, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})),
    # attention-logit soft-cap small enough to bite
    "gemma2": ("gemma2", False, dict(sliding_window=WINDOW, attn_logit_softcapping=1.5)),
}


def _fused_calls(engine) -> list[int]:
    return [s["fused_calls"] for s in engine.runner.rank_stats()]


@pytest.fixture(scope="module", params=["gemma3_tied_scaled", "gemma2"])
def engines(request, tiny_model_dir):
    assert native.is_available(), native.unavailable_reason()
    arch, tie, kw = CASES[request.param]
    path = tiny_model_dir(arch, tie, 2, **kw)
    with pytest.MonkeyPatch.context() as mp:
        stack_at_every_step_size(mp)  # whole-prompt logits through the stack too
        tp1 = LLMEngine(EngineConfig(model=str(path), **CONFIG))
        tp2 = LLMEngine(EngineConfig(model=str(path), tensor_parallel_size=2, **CONFIG))
        yield path, tp1, tp2
        tp2.runner.close()


def test_gemma_tp2_is_sharded(engines):
    _, tp1, tp2 = engines
    attn = tp2.runner.model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)  # of 4 and 2
    mlp = tp2.runner.model.model.layers[0].mlp
    assert mlp.down_proj.tp_mode == "row" and mlp.gate_up_proj.tp_mode == "column"
    assert tp2.runner.kv_cache.numel() * 2 == tp1.runner.kv_cache.numel()


@pytest.mark.parametrize("stagger", [0, 3])
def test_gemma_tp2_tokens_equal_tp1_under_chunking_caching_preemption(engines, stagger):
    _, tp1, tp2 = engines
    ids = prompts(tp1.tokenizer)
    before = _fused_calls(tp2)
    want = drive_engine(tp1, ids, PARAMS, stagger)
    got = drive_engine(tp2, ids, PARAMS, stagger)
    assert got == want
    after = _fused_calls(tp2)
    assert all(a > b for a, b in zip(after, before)) and after[0] - before[0] == after[1] - before[1]
    if stagger == 0:
        assert tp2.scheduler.num_preemptions > 0
    else:
        assert tp2.kv.pool.num_hits > 0


def test_gemma_tp2_logits_equal_tp1_transformers_and_per_op(engines, monkeypatch):
    import transformers

    path, tp1, tp2 = engines
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ids = prompts(tp1.tokenizer)[:3]
    fused = []
    for p in ids:
        before = _fused_calls(tp2)
        got = engine_logits(tp2, p)
        assert [a - b for a, b in zip(_fused_calls(tp2), before)] == [1, 1]
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(got, engine_logits(tp1, p), atol=1e-4, rtol=0)
        fused.append(got)
    # one TP engine per process at a time (a second forms its own group): the module's closes first
    tp2.runner.close()
    monkeypatch.setenv("APPLIANCE_FUSED_LAYERS", "0")
    monkeypatch.setattr(native, "FUSED_LAYERS", False)
    per_op = LLM(str(path), tensor_parallel_size=2, **{k: v for k, v in CONFIG.items()})
    try:
        for p, got in zip(ids, fused):
            torch.testing.assert_close(engine_logits(per_op, p), got, atol=1e-4, rtol=0)
        assert _fused_calls(per_op.engine) == [0, 0]
    finally:
        per_op.engine.runner.close()
