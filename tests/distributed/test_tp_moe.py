"""Mixture of experts under tensor parallel: tiny Mixtral, Qwen2-MoE (shared expert, a dense first
layer) and Qwen3-MoE at TP=2 (rank 1 a spawned worker, gloo on loopback) give TP=1's greedy tokens
under chunked prefill, prefix caching and preemption, and TP=1's and transformers' last-token
logits within 1e-4. Each expert's width is split over the ranks, the router replicated, one
all-reduce per MoE block (models/moe.py SparseMoeBlock)."""
from __future__ import annotations

import pytest
import torch

from appliance.config import EngineConfig
from appliance.engine.llm_engine import LLMEngine
from appliance.errors import ModelLoadError
from helpers import engine_logits
from test_tp_engine import CONFIG, prompts, run

MODELS = {"mixtral": dict(arch="mixtral"),
          "qwen2_moe_dense_first": dict(arch="qwen2_moe", mlp_only_layers=[0]),
          "qwen3_moe": dict(arch="qwen3_moe")}


@pytest.fixture(scope="module", params=list(MODELS))
def engines(request, tiny_model_dir):
    path = tiny_model_dir(**MODELS[request.param])
    tp1 = LLMEngine(EngineConfig(model=str(path), **CONFIG))
    tp2 = LLMEngine(EngineConfig(model=str(path), tensor_parallel_size=2, **CONFIG))
    yield request.param, path, tp1, tp2
    tp2.runner.close()


def test_moe_tp2_is_sharded_per_expert(engines):
    from appliance.models.moe import SparseMoeBlock

    name, _, tp1, tp2 = engines
    blocks = [(a, b) for a, b in zip(tp1.runner.model.modules(), tp2.runner.model.modules())
              if isinstance(a, SparseMoeBlock)]
    assert blocks and len(blocks) == (1 if name == "qwen2_moe_dense_first" else 2)
    for full, part in blocks:
        assert part.gate.weight.shape == full.gate.weight.shape  # the router is whole on every rank
        for ef, ep in zip(full.experts, part.experts):
            assert ep.gate_up_proj.weight.shape[0] * 2 == ef.gate_up_proj.weight.shape[0]
            assert ep.down_proj.weight.shape[1] * 2 == ef.down_proj.weight.shape[1]
            assert ep.down_proj.tp_mode == "row_partial" and ep.gate_up_proj.tp_mode == "column"
            # rank 0's rows of gate and of up (each shard split alike), rank 0's columns of down
            i = ef.down_proj.weight.shape[1]
            torch.testing.assert_close(ep.gate_up_proj.weight, torch.cat(
                [ef.gate_up_proj.weight[:i // 2], ef.gate_up_proj.weight[i:i + i // 2]]), atol=0, rtol=0)
            torch.testing.assert_close(ep.down_proj.weight, ef.down_proj.weight[:, :i // 2], atol=0, rtol=0)
        if full.shared_expert is not None:
            assert part.shared_expert.down_proj.weight.shape[1] * 2 == full.shared_expert.down_proj.weight.shape[1]


@pytest.mark.parametrize("stagger", [0, 3])
def test_moe_tp2_tokens_equal_tp1_under_chunking_caching_preemption(engines, stagger):
    _, _, tp1, tp2 = engines
    ids = prompts(tp1.tokenizer)
    want = run(tp1, ids, stagger)
    assert run(tp2, ids, stagger) == want
    # rank 0's experts (its shards) ran as one native call per layer where the op set has it, as at TP=1
    from appliance.models.moe import SparseMoeBlock

    ops = tp2.runner.ops
    one_call = hasattr(ops, "moe_experts") and ops.FUSED_LAYERS
    ran = [b.native_calls > 0 for b in tp2.runner.model.modules() if isinstance(b, SparseMoeBlock)]
    assert ran and ran == [one_call] * len(ran), (one_call, ran)
    if stagger == 0:
        assert tp2.scheduler.num_preemptions > 0
    else:
        assert tp2.kv.pool.num_hits > 0


def test_moe_tp2_logits_equal_transformers_and_tp1(engines):
    import transformers

    _, path, tp1, tp2 = engines
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    for p in prompts(tp1.tokenizer)[:3]:
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float()
        got = engine_logits(tp2, p)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(got, engine_logits(tp1, p), atol=1e-4, rtol=0)


def test_moe_expert_width_that_does_not_split_is_refused(tiny_model_dir):
    """An expert width of 33 (heads, KV heads, vocabulary and dense width all even): refused at start,
    naming the size and what would be valid."""
    from appliance.distributed.executor import check_tensor_parallel
    from appliance.models.loader import model_info

    path = tiny_model_dir(arch="qwen3_moe", moe_intermediate_size=33)
    # what the engine's start calls before spawning (a TP engine above pinned this process to one CPU,
    # so an EngineConfig with tensor_parallel_size=2 would be refused for that first)
    info = model_info(path)
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size=2 does not divide the model's "
                                             r"moe_intermediate_size=33; valid sizes for this model: 1$"):
        check_tensor_parallel(type("C", (), {"tensor_parallel_size": 2, "device": "cpu"})(), info,
                              torch.device("cpu"))
