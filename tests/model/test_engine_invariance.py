"""The same greedy tokens whatever the batch composition, block size, token budget (chunked
prefill), prefix caching and preemption; block pool integrity checked after every step."""
from __future__ import annotations

import random

import pytest

from appliance import LLM, SamplingParams
from appliance.engine.llm_engine import LLMEngine
from appliance.config import EngineConfig
from helpers import drive_engine

SHARED = "Paris is the capital of France. The quick brown fox jumps over the lazy dog. " * 2


def prompts(tok):
    rng = random.Random(0)
    texts = [SHARED + "Hello", SHARED + "def f(x)", "Hello", "The quick brown fox",
             SHARED * 2 + "ünïcode ✓", "Paris"]
    ids = [tok.encode(t) for t in texts]
    ids.append([rng.randrange(3, 384) for _ in range(70)])
    return ids


def run_engine(engine: LLMEngine, ids, params, order=None, stagger=0):
    """Drive the engine step by step (optionally adding requests over time) checking integrity."""
    return drive_engine(engine, ids, params, stagger, order)


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=512, enable_prefix_caching=False)
    ids = prompts(llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    # one request at a time: the plainest possible schedule
    return ids, [llm.generate(prompt_token_ids=[p], sampling_params=params)[0].outputs[0].token_ids for p in ids]


CONFIGS = {
    "batched": dict(),
    "block_size_1": dict(block_size=1, num_kv_blocks=4096),
    "block_size_16_budget_8": dict(max_num_batched_tokens=8),  # chunked prefill everywhere
    "long_prefill_threshold": dict(long_prefill_token_threshold=5, max_num_batched_tokens=40),
    "no_prefix_cache": dict(enable_prefix_caching=False),
    "max_num_seqs_2": dict(max_num_seqs=2),
    "preemption": dict(num_kv_blocks=16, block_size=8),  # far too small for 7 requests at once
    "preemption_block1_budget": dict(num_kv_blocks=110, block_size=1, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("stagger", [0, 3])
def test_same_tokens_under_any_schedule(llama_dir, reference, name, stagger):
    ids, expected = reference
    cfg = dict(dtype="float32", num_kv_blocks=512)
    cfg.update(CONFIGS[name])
    engine = LLMEngine(EngineConfig(model=str(llama_dir), **cfg))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    order = list(range(len(ids)))
    random.Random(stagger).shuffle(order)
    got = run_engine(engine, ids, params, order, stagger)
    assert got == expected
    if name.startswith("preemption") and not stagger:
        assert engine.scheduler.num_preemptions > 0
    if name == "batched" and stagger:
        # requests sharing SHARED's full blocks hit the cache
        assert engine.kv.pool.num_hits > 0


def test_prefix_cache_hit_skips_prefill(llama_dir, reference):
    ids, expected = reference
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=512))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert run_engine(engine, [ids[0]], params) == [expected[0]]
    before = engine.stats["prompt_tokens"]
    engine.add_request("again", ids[0], params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].outputs[0].token_ids == expected[0]
    n_blocks = (len(ids[0]) - 1) // 16
    assert outs[0].num_cached_tokens == n_blocks * 16
    # only the uncached tail of the prompt was computed
    assert engine.stats["prompt_tokens"] - before == len(ids[0]) - n_blocks * 16
