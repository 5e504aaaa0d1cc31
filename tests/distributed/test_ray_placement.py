"""Ranks placed by Ray on several hosts: each rank's CPUs are planned on the node it landed on
(``threads.node_rank_placements``, ``RayReplicaSet.node_placements``), in that node's CPU numbering.

One machine cannot show several hosts, so the nodes here are fake topologies (``threads.NodeTopology``)
with numberings unlike this host's: two NUMA nodes with SMT siblings, NUMA nodes with interleaved
CPU numbers, one big node. What the live loopback Ray runs check (the plan on one host is the
driver's own) is in test_tp_ray.py and tests/server/test_server_dp_ray.py."""
from __future__ import annotations

import os

import pytest

from appliance.errors import ApplianceError
from appliance.runtime import threads

# Host A: 2 NUMA nodes x 4 cores x 2 SMT threads (node 0 = CPUs 0-3 and their siblings 8-11).
A = threads.NodeTopology("host-a", {0: (0, 1, 2, 3, 8, 9, 10, 11), 1: (4, 5, 6, 7, 12, 13, 14, 15)},
                         {c: (0, c % 8) for c in range(16)}, tuple(range(16)))
# Host B: 2 NUMA nodes whose CPUs interleave (node 0 = even CPUs), no SMT.
B = threads.NodeTopology("host-b", {0: (0, 2, 4, 6), 1: (1, 3, 5, 7)}, {c: (c % 2, c) for c in range(8)},
                         tuple(range(8)))
# Host C: one NUMA node of 6 cores, of which the process there may use 2-5.
C = threads.NodeTopology("host-c", {0: tuple(range(6))}, {c: (0, c) for c in range(6)}, (2, 3, 4, 5))
TOPO = {"a": A, "b": B, "c": C}


def cpus(ps):
    return [p.cpus for p in ps]


def test_auto_each_node_splits_its_own_numa_nodes():
    ps = threads.node_rank_placements("auto", None, ["a", "a", "b", "b"], TOPO)
    assert cpus(ps) == [(0, 1, 2, 3), (4, 5, 6, 7), (0, 2, 4, 6), (1, 3, 5, 7)]
    assert [p.numa_node for p in ps] == [0, 1, 0, 1]
    assert all(p.bind_memory for p in ps) and all(p.num_threads == 4 for p in ps)
    assert threads.omp_env(ps[3])["OMP_PLACES"] == "{1},{3},{5},{7}"


def test_ranks_interleaved_over_nodes_keep_rank_order_within_a_node():
    # a spread placement: ranks 0 and 2 on A, 1 and 3 on B
    ps = threads.node_rank_placements("auto", 2, ["a", "b", "a", "b"], TOPO)
    assert cpus(ps) == [(0, 1), (0, 2), (4, 5), (1, 3)]
    assert all(p.num_threads == 2 for p in ps)


def test_a_rank_alone_on_its_node_takes_one_numa_node_and_binds_memory():
    ps = threads.node_rank_placements("auto", None, ["a", "b", "c"], TOPO)
    assert cpus(ps) == [(0, 1, 2, 3), (0, 2, 4, 6), (2, 3, 4, 5)]  # C: only the CPUs allowed there
    assert [p.bind_memory for p in ps] == [True, True, False]  # C has one NUMA node: nothing to bind


def test_split_cores_when_a_node_has_fewer_numa_nodes_than_ranks():
    ps = threads.node_rank_placements("auto", None, ["c", "c", "a"], TOPO)
    assert cpus(ps) == [(2, 3), (4, 5), (0, 1, 2, 3)]


def test_explicit_lists_are_each_ranks_own_nodes_numbering():
    # the same CPU numbers on two hosts are two sets of cores: no overlap
    ps = threads.node_rank_placements("0-3|0-3", None, ["a", "b"], TOPO)
    assert cpus(ps) == [(0, 1, 2, 3), (0, 1, 2, 3)]
    assert ps[0].numa_node == 0 and ps[1].numa_node is None  # B's 0-3 span both its NUMA nodes
    assert all(p.spec == "0-3|0-3" for p in ps)
    with pytest.raises(ApplianceError, match=r"rank\(s\) 0, 1 on node host-a: .*CPU 1 is in the lists of ranks 0 "
                                             r"and 1"):
        threads.node_rank_placements("0-3|1-2", None, ["a", "a"], TOPO)
    # CPUs 8-11 exist on A, not on B: refused naming the rank's node
    with pytest.raises(ApplianceError, match=r"rank\(s\) 1 on node host-b: .*8-11 are not available"):
        threads.node_rank_placements("8-11|8-11", None, ["a", "b"], TOPO)
    with pytest.raises(ApplianceError, match=r"3 CPU list\(s\) for 2 ranks"):
        threads.node_rank_placements("0|1|2", None, ["a", "b"], TOPO)


def test_nobind_shares_each_nodes_cores():
    ps = threads.node_rank_placements("nobind", None, ["a", "a", "b"], TOPO)
    assert cpus(ps) == [None, None, None] and [p.num_threads for p in ps] == [4, 4, 8]


def test_too_many_ranks_for_a_node_names_it():
    with pytest.raises(ApplianceError, match=r"rank\(s\) 1, 2, 3, 4, 5 on node host-c: .*5 ranks need a core each, "
                                             r"but this process may use 4"):
        threads.node_rank_placements("auto", None, ["a"] + ["c"] * 5, TOPO)


def test_one_node_is_resolve_ranks_on_that_node():
    local = threads.local_topology()
    for spec, n in (("auto", 2), ("nobind", 2), ("auto", 1)):
        want = threads.resolve_ranks(spec, n)
        assert threads.node_rank_placements(spec, None, ["here"] * n, {"here": local}) == want
    a, b = sorted(os.sched_getaffinity(0))[:2] if len(os.sched_getaffinity(0)) >= 2 else (0, 0)
    if a != b:
        spec = f"{a}|{b}"
        assert threads.node_rank_placements(spec, None, ["x", "x"], {"x": local}) == threads.resolve_ranks(spec, 2)


def test_on_node_view_is_scoped():
    here = threads.numa_nodes()
    with threads.on_node(B):
        assert threads.numa_nodes() == {0: [0, 2, 4, 6], 1: [1, 3, 5, 7]}
        assert threads.core_of(3) == (1, 3)
    assert threads.numa_nodes() == here


def test_replica_set_plans_rank0_on_the_driver_node_then_each_bundle(monkeypatch):
    """``RayReplicaSet.node_placements`` with the bundles' nodes as Ray reported them: a tensor-parallel
    rank 0 (this process) on the driver's node, ranks per bundle on theirs."""
    pytest.importorskip("ray", reason="the ray extra is not installed here")  # installed in CI (pyproject)
    from appliance.server.ray_executor import RayReplicaSet

    rs = RayReplicaSet([threads.Placement(4, (0, 1, 2, 3))] * 3)
    rs.local_node, rs.bundle_nodes, rs.topologies = "a", ["a", "b", "b"], {"b": B}
    seen = {}

    def fake_local(allowed=None):
        seen["allowed"] = allowed
        return A

    monkeypatch.setattr(threads, "local_topology", fake_local)
    ps = rs.node_placements("auto", None, {0, 1}, leading_local=1)
    assert seen["allowed"] == {0, 1}
    assert cpus(ps) == [(0, 1, 2, 3), (4, 5, 6, 7), (0, 2, 4, 6), (1, 3, 5, 7)]
    # data parallel x tensor parallel: each replica's 2 ranks on its bundle's node
    rs.bundle_nodes = ["b", "a"]
    ps = rs.node_placements("auto", None, {0, 1}, ranks_per_bundle=2)
    assert cpus(ps) == [(0, 2, 4, 6), (1, 3, 5, 7), (0, 1, 2, 3), (4, 5, 6, 7)]
    assert rs.node_hosts() == ["host-b", __import__("socket").gethostname()]


def test_placement_strategy_variable(monkeypatch):
    pytest.importorskip("ray", reason="the ray extra is not installed here")
    from appliance.server import ray_executor

    monkeypatch.delenv(ray_executor.STRATEGY_VAR, raising=False)
    assert ray_executor.placement_strategy() == "PACK"
    monkeypatch.setenv(ray_executor.STRATEGY_VAR, "strict_spread")
    assert ray_executor.placement_strategy() == "STRICT_SPREAD"
    monkeypatch.setenv(ray_executor.STRATEGY_VAR, "SCATTER")
    with pytest.raises(ApplianceError, match=r"APPLIANCE_RAY_PLACEMENT_STRATEGY='SCATTER' is not a Ray placement "
                                             r"group strategy; valid: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"):
        ray_executor.placement_strategy()


def test_serve_refuses_a_bad_strategy_at_start():
    pytest.importorskip("ray", reason="the ray extra is not installed here")
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "appliance.cli", "serve", "--port", "1", "--distributed-executor-backend",
                        "ray"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "APPLIANCE_RAY_PLACEMENT_STRATEGY": "EVERYWHERE"})
    assert r.returncode == 2, r.stderr
    assert "APPLIANCE_RAY_PLACEMENT_STRATEGY='EVERYWHERE' is not a Ray placement group strategy; valid: PACK, " \
           "SPREAD, STRICT_PACK, STRICT_SPREAD" in r.stderr, r.stderr
