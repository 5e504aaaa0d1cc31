"""Tensor parallel end to end: tiny Llama (untied) and Qwen2 (tied embeddings, q/k/v biases) at
TP=2 (rank 0 here, rank 1 a spawned worker, gloo on loopback) give TP=1's greedy tokens under
chunked prefill, prefix caching and forced preemption, and transformers' last-token logits within
1e-4. One TP=2 engine per model for the whole module (each start spawns a process)."""
from __future__ import annotations

import random

import pytest
import torch

from appliance import SamplingParams
from appliance.config import EngineConfig
from appliance.engine.llm_engine import LLMEngine
from helpers import drive_engine, engine_logits

SHARED = "Paris is the capital of France. The quick brown fox jumps over the lazy dog. " * 2
# chunked prefill (16-token budget), a cache far too small for every request at once (preemption),
# prefix caching on
CONFIG = dict(dtype="float32", linear_backend="torch", block_size=8, num_kv_blocks=24, max_num_batched_tokens=16,
              enable_prefix_caching=True)
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(tok):
    rng = random.Random(0)
    texts = [SHARED + "Hello", SHARED + "def f(x)", "Hello", "The quick brown fox", SHARED + "ünïcode ✓", "Paris"]
    return [tok.encode(t) for t in texts] + [[rng.randrange(3, 384) for _ in range(40)]]


def run(engine: LLMEngine, ids, stagger: int):
    """Every prompt through the engine (all at once, or one every ``stagger`` steps), checking the
    block pool after every step. Returns each request's tokens."""
    return drive_engine(engine, ids, PARAMS, stagger)



MODELS = {"llama": dict(arch="llama"), "qwen2_tied": dict(arch="qwen2", tie=True)}


@pytest.fixture(scope="module", params=list(MODELS))
def engines(request, tiny_model_dir):
    path = tiny_model_dir(**MODELS[request.param])
    tp1 = LLMEngine(EngineConfig(model=str(path), **CONFIG))
    tp2 = LLMEngine(EngineConfig(model=str(path), tensor_parallel_size=2, **CONFIG))
    yield path, tp1, tp2
    tp2.runner.close()


def test_tp2_is_sharded(engines):
    _, tp1, tp2 = engines
    assert tp2.runner.world_size == 2 and len(tp2.runner.procs) == 1 and tp2.runner.procs[0].is_alive()
    attn = tp2.runner.model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)  # of 4 and 2
    assert tp2.runner.num_kv_heads == tp1.runner.num_kv_heads // 2  # each rank's cache holds its KV heads
    assert tp2.runner.kv_cache.numel() * 2 == tp1.runner.kv_cache.numel()
    assert tp2.runner.num_blocks == tp1.runner.num_blocks


@pytest.mark.parametrize("stagger", [0, 3])
def test_tp2_tokens_equal_tp1_under_chunking_caching_preemption(engines, stagger):
    _, tp1, tp2 = engines
    ids = prompts(tp1.tokenizer)
    want = run(tp1, ids, stagger)
    got = run(tp2, ids, stagger)
    assert got == want
    if stagger == 0:  # 7 requests at once in 24 blocks of 8
        assert tp2.scheduler.num_preemptions > 0
    else:  # requests sharing SHARED's full blocks hit the cache
        assert tp2.kv.pool.num_hits > 0


def test_tp2_logits_equal_transformers_and_tp1(engines):
    import transformers

    path, tp1, tp2 = engines
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    for p in prompts(tp1.tokenizer)[:3]:
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float()
        got = engine_logits(tp2, p)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(got, engine_logits(tp1, p), atol=1e-4, rtol=0)


def test_tp2_prompt_logprobs_equal_tp1(engines):
    """Prompt logprobs make every rank compute (and gather) the logits of a whole chunk."""
    _, tp1, tp2 = engines
    ids = prompts(tp1.tokenizer)[0]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)

    def plp(engine):
        engine.add_request("plp", ids, params)
        while engine.has_unfinished_requests():
            outs = [o for o in engine.step() if o.finished]
        return outs[0].prompt_logprobs

    a, b = plp(tp1), plp(tp2)
    assert a[0] is None and b[0] is None and len(a) == len(b) == len(ids)
    for x, y in zip(a[1:], b[1:]):
        assert x.keys() == y.keys()
        for t in x:
            assert abs(x[t] - y[t]) < 1e-4


def test_tp2_with_ngram_speculation_equals_tp1(engines):
    """Drafts travel to every rank (the vocab-parallel gather needs the same logits rows on each):
    TP=2 verifying n-gram drafts gives TP=1's greedy tokens, with drafts accepted."""
    path, tp1, tp2 = engines
    spec = {"method": "ngram", "num_speculative_tokens": 3, "cost_aware": False, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    # one TP engine per process at a time (torch.distributed's default group; rank 0 pins this process):
    # this test runs last for each model, so the module's TP=2 engine is closed first
    tp2.runner.close()
    tp2s = LLMEngine(EngineConfig(model=str(path), tensor_parallel_size=2, speculative_config=spec, **CONFIG))
    try:
        ids = prompts(tp1.tokenizer)
        assert run(tp2s, ids, 3) == run(tp1, ids, 3)
        stats = tp2s.spec.stats()
        assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0, stats
    finally:
        tp2s.runner.close()
