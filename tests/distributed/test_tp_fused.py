"""The one-call native decoder stack (``ops.native.llama_layers``) under tensor parallelism: each rank
runs its heads and MLP slice in one native call per step, the stack summing the row-parallel o_proj
and down_proj outputs itself through the shared-memory all-reduce's C entry. Checked on 2 ranks
(rank 0 here, rank 1 a spawned worker): every rank took the fused path on every step (its counter,
since equal outputs alone cannot tell the paths apart), and TP=2 gives TP=1's greedy tokens under
chunked prefill, prefix caching and preemption, and TP=1's and transformers' logits within 1e-4;
W8A8 (quantized at load, the native int8 GEMM in the stack) as close to TP=1 as the per-op path's
TP=2 is (tests/distributed/test_tp_quantized.py: per-rank activation quantization)."""
from __future__ import annotations

import pytest
import torch
from helpers import drive_engine, engine_logits, stack_at_every_step_size
from test_tp_engine import PARAMS, prompts

from appliance.config import EngineConfig
from appliance.engine.llm_engine import LLMEngine
from appliance.ops import native

CONFIG = dict(dtype="float32", attention_backend="native", block_size=8, num_kv_blocks=24,
              max_num_batched_tokens=16, enable_prefix_caching=True)


def _fused_calls(engine) -> list[int]:
    return [s["fused_calls"] for s in engine.runner.rank_stats()]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    assert native.is_available(), native.unavailable_reason()
    path = tiny_model_dir("llama")
    with pytest.MonkeyPatch.context() as mp:
        stack_at_every_step_size(mp)  # whole-prompt logits (up to 40 tokens) through the stack too
        tp1 = LLMEngine(EngineConfig(model=str(path), linear_backend="native", **CONFIG))
        tp2 = LLMEngine(EngineConfig(model=str(path), linear_backend="native", tensor_parallel_size=2, **CONFIG))
        yield path, tp1, tp2
        tp2.runner.close()


def test_every_rank_runs_the_fused_stack_with_its_shard(engines):
    _, _, tp2 = engines
    assert tp2.runner.comm.native_all_reduce() is not None  # the shared-memory communicator
    before = _fused_calls(tp2)
    ids = prompts(tp2.tokenizer)[:2]
    drive_engine(tp2, ids, PARAMS)
    after = _fused_calls(tp2)
    # every step on every rank: at least the prefill and PARAMS.max_tokens - 1 decode steps
    assert all(a - b >= PARAMS.max_tokens for a, b in zip(after, before)), (before, after)
    assert after[0] - before[0] == after[1] - before[1]


@pytest.mark.parametrize("stagger", [0, 3])
def test_fused_tp2_tokens_equal_tp1_under_chunking_caching_preemption(engines, stagger):
    _, tp1, tp2 = engines
    ids = prompts(tp1.tokenizer)
    before = _fused_calls(tp2)
    want = drive_engine(tp1, ids, PARAMS, stagger)
    got = drive_engine(tp2, ids, PARAMS, stagger)
    assert got == want
    assert all(a > b for a, b in zip(_fused_calls(tp2), before))
    if stagger == 0:
        assert tp2.scheduler.num_preemptions > 0
    else:
        assert tp2.kv.pool.num_hits > 0


def test_fused_tp2_logits_equal_tp1_and_transformers(engines):
    import transformers

    path, tp1, tp2 = engines
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    for p in prompts(tp1.tokenizer)[:3]:
        before = _fused_calls(tp2)
        got = engine_logits(tp2, p)
        assert [a - b for a, b in zip(_fused_calls(tp2), before)] == [1, 1]
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(got, engine_logits(tp1, p), atol=1e-4, rtol=0)


def test_w8a8_fused_under_tp(engines, llama_dir, monkeypatch):
    """W8A8 (per-token A8 over each rank's slice of the row-parallel inputs: not TP=1 to 1e-4, see
    test_tp_quantized): through the fused stack on both ranks, the per-op path's TP=2 logits within
    1e-4 (APPLIANCE_FUSED_LAYERS=0 turns the stack off in the workers too), as close to the float
    model as TP=1 is (within 1.5x) and within 5% of TP=1 (a missed or doubled all-reduce is 100%)."""
    from appliance import LLM
    from appliance.layers.quant import QuantLinear

    # one TP engine per process at a time (a second one would form its own gloo group, which has no
    # native all-reduce): this test runs last, so the module's TP=2 engine is closed first
    engines[2].runner.close()
    kw = dict(dtype="float32", attention_backend="native", num_kv_blocks=32, max_model_len=128)
    ids = list(range(3, 40))
    ref = LLM(str(llama_dir), **kw)
    flt = engine_logits(ref, ids)
    del ref
    one = LLM(str(llama_dir), quantization="w8a8", **kw)
    want = engine_logits(one, ids)
    assert one.engine.runner.model.fused_calls > 0
    del one
    two = LLM(str(llama_dir), quantization="w8a8", tensor_parallel_size=2, **kw)
    try:
        down = two.engine.runner.model.model.layers[0].mlp.down_proj
        assert isinstance(down, QuantLinear) and down.tp_mode == "row"
        assert down.fused_descriptor() is not None, down.backend
        before = _fused_calls(two.engine)
        got = engine_logits(two, ids)
        assert [a - b for a, b in zip(_fused_calls(two.engine), before)] == [1, 1]
    finally:
        two.engine.runner.close()
    monkeypatch.setenv("APPLIANCE_FUSED_LAYERS", "0")
    monkeypatch.setattr(native, "FUSED_LAYERS", False)
    per_op = LLM(str(llama_dir), quantization="w8a8", tensor_parallel_size=2, **kw)
    try:
        per_op_logits = engine_logits(per_op, ids)
        assert _fused_calls(per_op.engine) == [0, 0]
    finally:
        per_op.engine.runner.close()
    torch.testing.assert_close(got, per_op_logits, atol=1e-4, rtol=0)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    q1, q2, tp = rel(want, flt), rel(got, flt), rel(got, want)
    assert q1 > 1e-3  # quantized for real
    assert q2 <= 1.5 * q1 and tp < 0.05, (q1, q2, tp)
