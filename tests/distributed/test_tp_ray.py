"""``--distributed-executor-backend ray -tp 2``: rank 0 is the engine here, rank 1 a Ray actor (Ray on
loopback, usage statistics off) in a placement group, speaking the same messages as a spawned rank.
TP=2 gives TP=1's greedy tokens under chunked prefill, prefix caching and preemption and TP=1's and
transformers' logits within 1e-4; both ranks ran the one-call native stack (its counter); closing
ends the actor and the Ray instance the engine started."""
from __future__ import annotations

import os

import pytest
import torch
from helpers import drive_engine, engine_logits
from test_tp_engine import PARAMS, prompts

from appliance.config import EngineConfig
from appliance.engine.llm_engine import LLMEngine

CONFIG = dict(dtype="float32", linear_backend="native", attention_backend="native", block_size=8, num_kv_blocks=24,
              max_num_batched_tokens=16, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    try:
        import ray  # noqa: F401
    except ImportError:
        msg = 'ray is not installed (pip install "appliance[ray]"): the Ray tensor-parallel check did not run'
        print(msg)
        pytest.skip(msg)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    path = tiny_model_dir("llama")
    tp1 = LLMEngine(EngineConfig(model=str(path), **CONFIG))
    tp2 = LLMEngine(EngineConfig(model=str(path), tensor_parallel_size=2, distributed_executor_backend="ray",
                                 **CONFIG))
    yield path, tp1, tp2
    tp2.runner.close()


def test_rank1_is_a_ray_actor_in_a_placement_group(engines):
    import ray

    from appliance.distributed.ray_ranks import RayRank

    _, _, tp2 = engines
    (rank1,) = tp2.runner.procs
    assert isinstance(rank1, RayRank) and rank1.is_alive()
    assert rank1.pid is not None and rank1.pid != os.getpid()
    assert ray.get_actor("appliance-tp-rank1") is not None
    assert tp2.runner.ray_set.pg is not None
    assert tp2.runner.comm.native_all_reduce() is not None  # one host: shared memory, as spawned ranks
    # the group was placed on this node, so no other node's topology was read, and rank 1's CPUs planned on
    # its node are the driver's own plan (resolve_ranks over this process's CPUs): its rank thread runs there
    rs = tp2.runner.ray_set
    assert rs.strategy == "PACK" and rs.bundle_nodes == [rs.local_node] and rs.topologies == {}
    from appliance.runtime import threads

    want = threads.resolve_ranks("auto", 2, allowed=set(tp2.runner._saved[0]))[1]
    tids = [t for t, cpus in threads.thread_affinities(rank1.pid).items() if cpus == threads.format_cpu_list(want.cpus)]
    assert tids, (want, threads.thread_affinities(rank1.pid))


@pytest.mark.parametrize("stagger", [0, 3])
def test_ray_tp2_tokens_equal_tp1(engines, stagger):
    _, tp1, tp2 = engines
    ids = prompts(tp1.tokenizer)
    before = [s["fused_calls"] for s in tp2.runner.rank_stats()]
    assert drive_engine(tp2, ids, PARAMS, stagger) == drive_engine(tp1, ids, PARAMS, stagger)
    after = [s["fused_calls"] for s in tp2.runner.rank_stats()]
    assert all(a > b for a, b in zip(after, before)), (before, after)
    if stagger == 0:
        assert tp2.scheduler.num_preemptions > 0
    else:
        assert tp2.kv.pool.num_hits > 0


def test_ray_tp2_logits_equal_tp1_and_transformers(engines):
    import transformers

    path, tp1, tp2 = engines
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    for p in prompts(tp1.tokenizer)[:3]:
        got = engine_logits(tp2, p)
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(got, engine_logits(tp1, p), atol=1e-4, rtol=0)


def test_close_ends_the_actor_and_ray(engines):
    import ray

    _, _, tp2 = engines
    (rank1,) = tp2.runner.procs
    tp2.runner.close()
    assert not rank1.is_alive() and rank1.exitcode == 0
    assert not ray.is_initialized()
