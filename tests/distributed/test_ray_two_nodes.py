"""Tensor parallel with its worker rank on another Ray node: a two-node Ray cluster on this one host
(``ray.cluster_utils.Cluster``: a head node with no CPUs for actors, where the driver, rank 0, runs,
and a second node with the CPUs), usage statistics off. The rank-1 bundle can only go to the second
node, so the engine has to learn where Ray put it, read that node's topology there (a task on that
node) and plan rank 1's CPUs from it; TP=2 gives TP=1's greedy tokens.

What one host cannot show: the two nodes share the host's CPUs (each rank, alone on its node, plans
every core of it), its hostname (so the all-reduce stays on shared memory; on two real hosts it is
gloo) and its network."""
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
        assert len(ray.nodes()) == 2 and set(rs.topologies) == {node}  # read on that node, by a task there
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
