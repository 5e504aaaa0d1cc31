"""The data-parallel replica set without processes: routing by sequences in flight, aborts to the
owning replica, a dead replica failing every stream, the stats totals and their /metrics rendering
(each engine series once as a total and once per replica, labelled engine="i")."""
from __future__ import annotations

import asyncio

import pytest

from appliance.config import EngineConfig
from appliance.sampling_params import SamplingParams
from appliance.server.async_engine import EngineDeadError
from appliance.server.dp_client import DPEngineClient
from appliance.server.engine_core import AbortRequests, AddRequest, EngineDead
from appliance.server.metrics import ServerMetrics


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llama_dir))


def _client(tokenizer) -> DPEngineClient:
    c = DPEngineClient(EngineConfig(data_parallel_size=2, omp_threads_bind="nobind", num_threads=1))
    c.tokenizer = tokenizer
    return c


def _sent(replica) -> list:
    out = []
    while not replica._send_q.empty():
        out.append(replica._send_q.get())
    return out


def test_routes_to_fewest_sequences_in_flight_and_aborts_on_owner(tokenizer):
    async def run():
        c = _client(tokenizer)
        sp = SamplingParams(max_tokens=4, temperature=0.0)
        c.add_request("a", [1, 2], SamplingParams(max_tokens=4, temperature=0.0, n=3))  # 3 sequences
        for rid in ("b", "c", "d"):
            c.add_request(rid, [1, 2], sp)
        # a -> 0 (tie, lowest index); b, c, d -> 1 (1, then 2, sequences < 3)
        assert [c.owner_of(r) for r in "abcd"] == [0, 1, 1, 1]
        # 3 vs 3: the cores' last reported running + waiting breaks the tie
        c.replicas[0].last_stats = {"num_running": 3, "num_waiting": 1}
        c.replicas[1].last_stats = {"num_running": 3, "num_waiting": 0}
        c.add_request("e", [1, 2], sp)
        assert c.owner_of("e") == 1
        assert c.routed == [1, 4] and c.num_in_flight == 5 and set(c.streams) == set("abcde")
        assert [m.request_id for m in _sent(c.replicas[0])] == ["a"]
        assert all(isinstance(m, AddRequest) for m in _sent(c.replicas[1]))
        c.abort(["c", "a"])
        assert [m.request_ids for m in _sent(c.replicas[0])] == [["a"]]
        assert [m.request_ids for m in _sent(c.replicas[1])] == [["c"]]
        assert set(c.streams) == {"b", "d", "e"}

    asyncio.run(run())


def test_dead_replica_fails_every_stream_and_refuses_new_requests(tokenizer):
    async def run():
        c = _client(tokenizer)
        sp = SamplingParams(max_tokens=4, temperature=0.0)
        s0 = c.add_request("x", [1], sp)
        s1 = c.add_request("y", [1], sp)
        assert (c.owner_of("x"), c.owner_of("y")) == (0, 1)
        _sent(c.replicas[1])
        c.replicas[0]._dispatch(EngineDead("the engine process exited"))
        e0, e1 = s0.queue.get_nowait(), s1.queue.get_nowait()
        assert isinstance(e0, EngineDeadError) and "the engine process exited" in str(e0)
        assert isinstance(e1, EngineDeadError) and "data-parallel replica 0 died" in str(e1)
        assert c.dead.startswith("data-parallel replica 0 died") and c.num_in_flight == 0
        assert [type(m) for m in _sent(c.replicas[1])] == [AbortRequests]  # the live replica frees its blocks
        with pytest.raises(EngineDeadError, match="replica 0 died"):
            c.add_request("z", [1], sp)

    asyncio.run(run())


def test_stats_totals_and_per_replica_metrics(tokenizer):
    async def run():
        c = _client(tokenizer)
        for r, (run_, wait, kv, q) in zip(c.replicas, ((2, 1, 0.5, 10), (1, 0, 0.25, 6))):
            r.last_stats = {"num_running": run_, "num_waiting": wait, "kv_cache_usage": kv,
                            "prefix_cache_queries": q, "prefix_cache_hits": 1, "num_preemptions": 0}
            r.dead = "stopped"  # answers from last_stats without a core
        c.routed = [5, 3]
        return await c.get_stats()

    s = asyncio.run(run())
    assert (s["num_running"], s["num_waiting"], s["prefix_cache_queries"]) == (3, 1, 16)
    assert s["kv_cache_usage"] == pytest.approx(0.375)
    text = ServerMetrics("m").render(s)
    for want in ('appliance:num_requests_running{model_name="m"} 3',
                 'appliance:num_requests_running{model_name="m",engine="0"} 2',
                 'appliance:num_requests_running{model_name="m",engine="1"} 1',
                 'appliance:kv_cache_usage_perc{model_name="m",engine="1"} 0.25',
                 'appliance:prefix_cache_queries_total{model_name="m",engine="0"} 10',
                 'appliance:engine_requests_routed_total{model_name="m",engine="1"} 3',
                 'vllm:num_requests_waiting{model_name="m",engine="0"} 1',
                 'vllm:kv_cache_usage_perc{model_name="m"} 0.375'):
        assert want in text.splitlines(), want
    # one engine: no engine label and no routed series, as before
    single = ServerMetrics("m").render({"num_running": 1})
    assert 'engine="' not in single and "engine_requests_routed" not in single


def test_default_kv_budget_is_shared_by_replicas(llama_dir, monkeypatch):
    """Replicas load at the same moment and each would see the same free memory: the default KV
    budget (a fraction of available RAM) is the host's, so each of N replicas takes 1/N of it."""
    from types import SimpleNamespace

    import appliance.engine.model_runner as mr
    from appliance.engine.llm_engine import LLMEngine

    monkeypatch.setattr(mr.psutil, "virtual_memory", lambda: SimpleNamespace(available=256 << 20))
    runners = [LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", data_parallel_size=n)).runner
               for n in (1, 2)]
    budget = min(mr.DEFAULT_KV_FRACTION * (256 << 20), mr.DEFAULT_KV_CAP_GIB * mr.GiB)
    assert [r.num_blocks for r in runners] == [int(budget // runners[0].bytes_per_block),
                                               int(budget / 2 // runners[1].bytes_per_block)]
    assert runners[0].num_blocks > 1


def test_speculative_counters_summed_and_rates_recomputed_over_replicas():
    from appliance.server.dp_client import _spec_totals

    busy = {"spec_decode_num_drafts": 4, "spec_decode_num_draft_tokens": 12,
            "spec_decode_num_accepted_tokens": 6, "spec_decode_num_accepted_tokens_per_pos": [3, 2, 1]}
    other = {"spec_decode_num_drafts": 2, "spec_decode_num_draft_tokens": 4,
             "spec_decode_num_accepted_tokens": 4, "spec_decode_num_accepted_tokens_per_pos": [2, 2]}
    idle = {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
            "spec_decode_num_accepted_tokens": 0, "spec_decode_num_accepted_tokens_per_pos": []}
    t = _spec_totals([busy, other, idle])
    assert (t["spec_decode_num_drafts"], t["spec_decode_num_draft_tokens"], t["spec_decode_num_accepted_tokens"]) \
        == (6, 16, 10)
    assert t["spec_decode_num_accepted_tokens_per_pos"] == [5, 4, 1]
    # from the sums, not the mean of per-replica rates (which would be (0.5 + 1 + 0) / 3)
    assert t["spec_decode_acceptance_rate"] == pytest.approx(10 / 16)
    assert t["spec_decode_mean_accepted_length"] == pytest.approx(1 + 10 / 6)
