"""Per-rank placement (appliance/runtime/threads.py resolve_ranks): '|'-separated lists, auto = one rank
per NUMA node on a fake two-node sysfs tree (even split on one node), memory binding, and the refusals."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.config import EngineConfig
from appliance.errors import ApplianceError, InvalidRequestError
from appliance.runtime import threads
from appliance.vllm_compat import vllm_env_engine_kwargs

REPO = Path(__file__).parents[2]


def _fake_sysfs(root: Path, nodes: dict[int, str], smt: int | None = None, ncpu: int = 16) -> None:
    """/sys/devices/system lookalike: node/nodeN/cpulist, and cpu/cpuC/topology where CPUs c and c + smt
    are SMT siblings of one core (no siblings when smt is None)."""
    for n, cl in nodes.items():
        (root / "node" / f"node{n}").mkdir(parents=True)
        (root / "node" / f"node{n}" / "cpulist").write_text(cl + "\n")
    for c in range(ncpu):
        topo = root / "cpu" / f"cpu{c}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{c % smt if smt else c}\n")


@pytest.fixture
def two_nodes(tmp_path, monkeypatch):
    # 2 nodes x 4 cores x 2 SMT threads: node 0 = CPUs 0-3 and their siblings 8-11.
    _fake_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"}, smt=8)
    monkeypatch.setattr(threads, "_SYS", tmp_path)
    return set(range(16))


@pytest.fixture
def one_node(tmp_path, monkeypatch):
    _fake_sysfs(tmp_path, {0: "0-7"}, ncpu=8)
    monkeypatch.setattr(threads, "_SYS", tmp_path)
    return set(range(8))


def test_fake_tree_is_read(two_nodes):
    assert threads.numa_nodes() == {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15]}
    assert threads.core_of(9) == threads.core_of(1)


def test_auto_one_rank_per_node(two_nodes):
    p0, p1 = threads.resolve_ranks("auto", 2, allowed=two_nodes)
    assert (p0.cpus, p0.numa_node, p0.num_threads, p0.bind_memory) == ((0, 1, 2, 3), 0, 4, True)
    assert (p1.cpus, p1.numa_node, p1.num_threads, p1.bind_memory) == ((4, 5, 6, 7), 1, 4, True)
    assert threads.omp_env(p1)["OMP_PLACES"] == "{4},{5},{6},{7}"
    assert "memory bound" in p1.describe()


def test_auto_more_ranks_than_nodes_splits_each_node(two_nodes):
    ps = threads.resolve_ranks("auto", 4, allowed=two_nodes)
    assert [(p.cpus, p.numa_node) for p in ps] == [((0, 1), 0), ((2, 3), 0), ((4, 5), 1), ((6, 7), 1)]


def test_auto_only_allowed_cpus(two_nodes):
    ps = threads.resolve_ranks("auto", 2, allowed={1, 2, 5, 6, 7})
    assert [(p.cpus, p.numa_node) for p in ps] == [((1, 2), 0), ((5, 6, 7), 1)]


def test_auto_one_node_splits_evenly(one_node):
    ps = threads.resolve_ranks("auto", 2, allowed=one_node)
    assert [(p.cpus, p.numa_node, p.bind_memory) for p in ps] == [((0, 1, 2, 3), 0, False), ((4, 5, 6, 7), 0, False)]
    assert [p.cpus for p in threads.resolve_ranks("auto", 3, allowed=one_node)] == [(0, 1, 2), (3, 4, 5), (6, 7)]
    assert [p.num_threads for p in threads.resolve_ranks("auto", 2, num_threads=2, allowed=one_node)] == [2, 2]


def test_explicit_lists(two_nodes):
    p0, p1 = threads.resolve_ranks("0-3|4-7", 2, allowed=two_nodes)
    assert (p0.cpus, p0.numa_node, p0.bind_memory) == ((0, 1, 2, 3), 0, True)
    assert (p1.cpus, p1.numa_node, p1.spec) == ((4, 5, 6, 7), 1, "0-3|4-7")
    # a list across both nodes: placed, not bound, warned
    q0, q1 = threads.resolve_ranks("0,4|1,5", 2, allowed=two_nodes)
    assert q0.numa_node is None and not q0.bind_memory and any("spans NUMA nodes" in w for w in q0.warnings)


def test_nobind_shares_cores(two_nodes):
    ps = threads.resolve_ranks("nobind", 2, allowed=two_nodes)
    assert [(p.cpus, p.num_threads) for p in ps] == [(None, 4), (None, 4)]


@pytest.mark.parametrize("spec,world,allowed,msg", [
    ("0-3", 2, None, r"--omp-threads-bind 0-3: 1 CPU list\(s\) for 2 ranks; give exactly 2 lists"),
    ("0-3|4-7|8-11", 2, None, r"3 CPU list\(s\) for 2 ranks"),
    ("0-3|4-7,99", 2, None, r"rank 1's CPU\(s\) 99 do not exist \(this host has CPUs 0-15\)"),
    ("0-3|3-7", 2, None, "CPU 3 is in the lists of ranks 0 and 1"),
    ("0-3|4-7", 2, {0, 1, 2, 3, 4}, r"CPU\(s\) 5-7 are not available to this process \(allowed: 0-4\)"),
    ("0-3|x", 2, None, "'x' in 'x' is not a CPU number"),
    ("auto", 9, None, r"auto: 9 ranks need a core each, but this process may use 8 physical core\(s\)"),
])
def test_refusals(two_nodes, spec, world, allowed, msg):
    with pytest.raises(ApplianceError, match=msg):
        threads.resolve_ranks(spec, world, allowed=allowed if allowed is not None else two_nodes)


def test_single_rank_refuses_rank_lists():
    with pytest.raises(ApplianceError, match=r"--omp-threads-bind 0-1\|2-3: 2 CPU lists .* for 1 rank"):
        threads.resolve("0-1|2-3")
    with pytest.raises(InvalidRequestError, match=r"omp_threads_bind='0\|1': 2 CPU lists .* for 1 rank"):
        EngineConfig(omp_threads_bind="0|1")
    with pytest.raises(ApplianceError, match=r"VLLM_CPU_OMP_THREADS_BIND='0\|1': 2 CPU lists"):
        vllm_env_engine_kwargs({}, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})


def test_vllm_variable_passes_rank_lists_for_ranks():
    out = vllm_env_engine_kwargs({"tensor_parallel_size": 2}, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert out["omp_threads_bind"] == "0|1"


def test_apply_binds_memory_to_the_node():
    # A child process, so this one's policy stays as it was. Node 0 exists on every Linux host.
    code = ("import json; from appliance.runtime import threads as t; "
            "t.apply(t.Placement(1, None, 0, 'x', bind_memory=True)); print(json.dumps(t.memory_policy()))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(REPO)},
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [2, [0]]  # MPOL_BIND to node 0
    before = threads.memory_policy()
    assert before is not None and before[0] != 2  # and this process was not bound
