"""Actors on other Ray nodes: a three-node Ray cluster on this one host (``ray.cluster_utils.Cluster``:
a head node with no CPUs for actors, where the driver runs, and two nodes with the CPUs), usage
statistics off. Every bundle has to go to a node other than the driver's, so the engine has to learn
where Ray put it, read that node's topology there (a task on that node) and plan the actor's CPUs
from it.

- Tensor parallel: rank 0 (the engine, on the head node) and rank 1 on another node, each alone on its
  node; TP=2 gives TP=1's greedy tokens.
- Data parallel with ``APPLIANCE_RAY_PLACEMENT_STRATEGY=STRICT_SPREAD``: the two replicas on the two
  nodes, each alone on its node and planned there; their tokens equal one engine's, both used.

What one host cannot show: the nodes share the host's CPUs (a rank alone on its node plans every core
of it, so here the ranks time-share the cores), its hostname (so the all-reduce stays on shared
memory; on two real hosts it is gloo) and its network."""
from __future__ import annotations

import os

import pytest
from helpers import drive_engine
from test_tp_engine import PARAMS, prompts

from appliance.config import EngineConfig
from appliance.engine.llm_engine import LLMEngine

CONFIG = dict(dtype="float32", linear_backend="torch", block_size=8, num_kv_blocks=24, max_num_batched_tokens=16,
              enable_prefix_caching=True)


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray", reason="the ray extra is not installed here")  # installed in CI (pyproject)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(2):
        c.add_node(num_cpus=len(os.sched_getaffinity(0)))
    ray.init(address=c.address, logging_level="WARNING")
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


def test_tp2_rank_on_the_second_node_plans_there_and_equals_tp1(cluster, tiny_model_dir):
    import ray

    from appliance.runtime import threads

    path = tiny_model_dir("llama")
    tp1 = LLMEngine(EngineConfig(model=str(path), **CONFIG))
    tp2 = LLMEngine(EngineConfig(model=str(path), tensor_parallel_size=2, distributed_executor_backend="ray",
                                 **CONFIG))
    (rank1,) = tp2.runner.procs
    try:
        rs = tp2.runner.ray_set
        head = ray.get_runtime_context().get_node_id()
        (node,) = rs.bundle_nodes
        assert rs.local_node == head and node != head, (head, rs.bundle_nodes)
        assert len(ray.nodes()) == 3 and set(rs.topologies) == {node}  # read on that node, by a task there
        topo = rs.topologies[node]
        assert isinstance(topo, threads.NodeTopology) and topo.numa == {k: tuple(v) for k, v in
                                                                        threads.numa_nodes().items()}
        # rank 1 is alone on its node: auto gives it that node's cores (here: this host's), not the driver's
        # two-rank plan of one host (its half of the cores); its actor started with that OpenMP environment
        want = threads.resolve_ranks("auto", 1, allowed=set(topo.allowed))[0]
        one_host = threads.resolve_ranks("auto", 2)[1]
        assert want.cpus != one_host.cpus
        env = dict(kv.split("=", 1) for kv in open(f"/proc/{rank1.pid}/environ").read().split("\0") if "=" in kv)
        assert (env["OMP_NUM_THREADS"], env.get("OMP_PLACES")) == (
            str(want.num_threads), threads.omp_env(want).get("OMP_PLACES")), env
        ids = prompts(tp1.tokenizer)
        assert drive_engine(tp2, ids, PARAMS, 3) == drive_engine(tp1, ids, PARAMS, 3)
    finally:
        tp2.runner.close()
    assert not rank1.is_alive() and rank1.exitcode == 0
    assert ray.is_initialized()  # the engine joined this cluster: it leaves it running


def test_dp2_spread_over_two_nodes_plans_each_replica_on_its_node(cluster, llama_dir, monkeypatch):
    import asyncio
    import socket

    import ray
    from test_dp_tp import PROMPTS, _generate
    from transformers import AutoTokenizer

    from appliance.runtime import threads
    from appliance.sampling_params import SamplingParams
    from appliance.server.dp_client import DPEngineClient

    monkeypatch.setenv("APPLIANCE_RAY_PLACEMENT_STRATEGY", "STRICT_SPREAD")
    base = dict(model=str(llama_dir), dtype="float32", linear_backend="torch", num_kv_blocks=64, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    want = drive_engine(LLMEngine(EngineConfig(**base)), [tok.encode(p) for p in PROMPTS], params)

    client = DPEngineClient(EngineConfig(**base, data_parallel_size=2, distributed_executor_backend="ray"))
    client.tokenizer = tok
    one_host = [g[0] for g in client.rank_groups]  # the driver's plan: the cores split between the replicas
    try:
        info = client.start(timeout=600)
        rs = client._ray
        head = ray.get_runtime_context().get_node_id()
        assert rs.strategy == "STRICT_SPREAD" and len(set(rs.bundle_nodes)) == 2 and head not in rs.bundle_nodes
        assert set(rs.topologies) == set(rs.bundle_nodes)
        alone = threads.resolve_ranks("auto", 1, allowed=set(rs.topologies[rs.bundle_nodes[0]].allowed))[0]
        assert alone.cpus != one_host[0].cpus
        for r, p in zip(info["replicas"], client.placements):
            # what each replica's engine reports: its node's whole plan, not its share of this host's
            assert p == alone and r["num_threads"] == alone.num_threads, (r, p)
            assert r["cpus"] == threads.format_cpu_list(list(alone.cpus)) and r["host"] == socket.gethostname(), r

        async def session():
            client.attach(asyncio.get_running_loop())
            return await _generate(client, tok, params), list(client.routed)

        got, routed = asyncio.run(session())
        assert got == want and all(n > 0 for n in routed), routed
    finally:
        client.shutdown()
