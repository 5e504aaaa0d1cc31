"""Data parallel x tensor parallel: M replicas of N ranks each behind one server (dp_client).

- Placement: M x N bind lists ("0-1|2-3|4-5|6-7": replica 0 = ranks 0-1), ``auto`` one rank per NUMA
  node when there are enough nodes (a fake four-node tree) else the physical cores split evenly (a
  fake two-node tree), each replica's config carrying its ranks' lists; the refusals name the flags.
- End to end on this 2-core host: DP=2 x TP=2 pinned needs 4 cores, so the server refuses it (asserted).
  The wiring (per-replica configs, a tensor-parallel executor inside each replica process, a
  shared-memory all-reduce per replica, routing) is run with the four ranks unpinned, one thread
  each, time-sharing the 2 cores: the placement check that refuses exactly that for users is
  replaced in this test (monkeypatch), nothing else. Both executor backends (mp, ray): greedy tokens
  equal one TP=1 engine's, both replicas used.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from appliance.config import EngineConfig
from appliance.errors import ApplianceError, InvalidRequestError
from appliance.runtime import threads
from appliance.server import dp_client
from appliance.server.async_engine import EngineDeadError
from test_placement import _fake_sysfs


@pytest.fixture
def two_nodes(tmp_path, monkeypatch):
    _fake_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"}, smt=8)  # 2 nodes x 4 cores x 2 SMT
    monkeypatch.setattr(threads, "_SYS", tmp_path)
    return set(range(16))


@pytest.fixture
def four_nodes(tmp_path, monkeypatch):
    _fake_sysfs(tmp_path, {0: "0-3", 1: "4-7", 2: "8-11", 3: "12-15"})
    monkeypatch.setattr(threads, "_SYS", tmp_path)
    return set(range(16))


def test_config_accepts_dp_x_tp_and_counts_lists_for_every_rank():
    c = EngineConfig(tensor_parallel_size=2, data_parallel_size=2)
    assert (c.tensor_parallel_size, c.data_parallel_size, c.data_parallel_rank) == (2, 2, None)
    with pytest.raises(InvalidRequestError, match=r"omp_threads_bind='0\|1': 2 CPU lists \('\|' separates ranks\) "
                                                  r"for 4 rank\(s\)") as e:
        EngineConfig(tensor_parallel_size=2, data_parallel_size=2, omp_threads_bind="0|1")
    assert e.value.param == "omp_threads_bind"
    # a replica's own copy lists its ranks only
    assert EngineConfig(tensor_parallel_size=2, data_parallel_size=2, data_parallel_rank=1,
                        omp_threads_bind="0|1").data_parallel_rank == 1
    with pytest.raises(InvalidRequestError, match=r"data_parallel_rank must be in \[0, data_parallel_size=2\), got 2"):
        EngineConfig(data_parallel_size=2, data_parallel_rank=2)


def test_explicit_lists_replica_by_replica(two_nodes):
    cfg = EngineConfig(tensor_parallel_size=2, data_parallel_size=2, omp_threads_bind="0-1|2-3|4-5|6-7")
    groups = dp_client.replica_rank_groups(cfg, two_nodes)
    assert [[p.cpus for p in g] for g in groups] == [[(0, 1), (2, 3)], [(4, 5), (6, 7)]]
    assert [p.numa_node for g in groups for p in g] == [0, 0, 1, 1]
    union = dp_client.replica_placements(cfg, two_nodes)
    assert [p.cpus for p in union] == [(0, 1, 2, 3), (4, 5, 6, 7)] and [p.numa_node for p in union] == [0, 1]
    confs = dp_client.replica_configs(cfg, groups)
    assert [(c.data_parallel_rank, c.omp_threads_bind) for c in confs] == [(0, "0-1|2-3"), (1, "4-5|6-7")]
    # what each replica's tensor-parallel executor resolves (among its own CPUs) gives the same ranks
    for c, g, u in zip(confs, groups, union):
        assert threads.resolve_ranks(c.omp_threads_bind, 2, c.num_threads, set(u.cpus)) == [
            p.__class__(**{**p.__dict__, "spec": c.omp_threads_bind}) for p in g]


def test_auto_one_rank_per_node_when_there_are_enough(four_nodes):
    cfg = EngineConfig(tensor_parallel_size=2, data_parallel_size=2)
    groups = dp_client.replica_rank_groups(cfg, four_nodes)
    assert [[(p.numa_node, p.cpus) for p in g] for g in groups] == [
        [(0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))], [(2, (8, 9, 10, 11)), (3, (12, 13, 14, 15))]]
    assert all(p.bind_memory for g in groups for p in g)
    assert [c.omp_threads_bind for c in dp_client.replica_configs(cfg, groups)] == ["0-3|4-7", "8-11|12-15"]


def test_auto_fewer_nodes_than_ranks_splits_the_cores(two_nodes):
    cfg = EngineConfig(tensor_parallel_size=2, data_parallel_size=2)
    groups = dp_client.replica_rank_groups(cfg, two_nodes)
    # one thread per physical core (SMT siblings 8-15 left out), each node's cores to two ranks
    assert [[p.cpus for p in g] for g in groups] == [[(0, 1), (2, 3)], [(4, 5), (6, 7)]]


@pytest.mark.parametrize("kw, allowed, msg", [
    (dict(omp_threads_bind="0-1|2-3|4-5|6-7|8"), None, r"5 CPU lists .* for 4 rank"),
    (dict(omp_threads_bind="0-1|2-3|2-3|6-7"), None, r"CPU 2 is in the lists of ranks 1 and 2"),
    (dict(omp_threads_bind="0|1|2|99"), None, r"rank 3's CPU\(s\) 99 do not exist"),
    (dict(), {0, 1, 2}, r"--data-parallel-size 2 x --tensor-parallel-size 2 = 4 ranks x at least 1 thread per rank "
                        r"= 4 threads, but --omp-threads-bind 'auto' gives 3 CPU core\(s\); valid: "
                        r"--data-parallel-size x --tensor-parallel-size <= 3"),
    (dict(num_threads=3), None, r"= 4 ranks x --num-threads 3 per rank = 12 threads, but --omp-threads-bind 'auto' "
                                r"gives 8 CPU core\(s\); valid: .* and --num-threads <= 2"),
])
def test_refusals_name_the_flags(two_nodes, kw, allowed, msg):
    with pytest.raises((ApplianceError, InvalidRequestError), match=msg):
        dp_client.replica_rank_groups(EngineConfig(tensor_parallel_size=2, data_parallel_size=2, **kw),
                                      allowed or two_nodes)


def test_serve_refuses_dp2_x_tp2_on_this_host(llama_dir):
    """This host has 2 cores: 4 ranks do not fit, refused before anything starts (exit 2)."""
    cores = len(threads.one_cpu_per_core(sorted(os.sched_getaffinity(0))))
    assert cores < 4, "this check is for hosts with fewer than 4 cores; on a larger one run DP=2 x TP=2 pinned"
    r = subprocess.run([sys.executable, "-m", "appliance.cli", "serve", str(llama_dir), "--data-parallel-size", "2",
                        "--tensor-parallel-size", "2", "--port", "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert (f"--data-parallel-size 2 x --tensor-parallel-size 2 = 4 ranks x at least 1 thread per rank = 4 threads, "
            f"but --omp-threads-bind 'auto' gives {cores} CPU core(s); valid: --data-parallel-size x "
            f"--tensor-parallel-size <= {cores}") in r.stderr


PROMPTS = ["Hello", "The quick brown fox", "Paris is the capital of", "def f(x):", "ünïcode ✓", "one two three",
           "Hello world! Héllo", "The lazy dog"]


def _oversubscribed(config, allowed=None):
    """Four unpinned ranks of one thread each: what replica_rank_groups refuses on 2 cores."""
    one = threads.Placement(1, None, None, "nobind")
    return [[one] * config.tensor_parallel_size for _ in range(config.data_parallel_size)]


async def _generate(client, tok, params):
    streams = [client.add_request(f"r{i}", tok.encode(p), params) for i, p in enumerate(PROMPTS)]
    out = []
    for s in streams:
        ids = []
        while True:
            d = await asyncio.wait_for(s.queue.get(), 300)
            assert not isinstance(d, BaseException), d
            ids += [t for c in d.choices for t in c.token_ids]
            if d.finished:
                break
        out.append(ids)
    return out


async def _kill_mid_stream(client, tok, pid):
    """Long requests on both replicas; once every stream has a token, SIGKILL ``pid``. Returns each
    stream's end: the exception it ended with, or "finished" (within 60 s each, else a timeout)."""
    import signal

    from appliance.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    streams = [client.add_request(f"k{i}", tok.encode(p), params) for i, p in enumerate(PROMPTS[:4])]
    firsts = [await asyncio.wait_for(s.queue.get(), 300) for s in streams]
    assert not any(isinstance(d, BaseException) or d.finished for d in firsts), firsts
    os.kill(pid, signal.SIGKILL)
    out = []
    for s in streams:
        while True:
            d = await asyncio.wait_for(s.queue.get(), 60)
            if isinstance(d, BaseException):
                out.append(d)
                break
            if d.finished:
                out.append("finished")
                break
    return out


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_dp2_x_tp2_tokens_equal_one_engine(llama_dir, monkeypatch, backend):
    from transformers import AutoTokenizer

    from appliance.engine.llm_engine import LLMEngine
    from appliance.sampling_params import SamplingParams
    from helpers import drive_engine

    if backend == "ray":
        pytest.importorskip("ray", reason="the ray extra is not installed here")  # installed in CI (pyproject)
    base = dict(model=str(llama_dir), dtype="float32", linear_backend="torch", num_kv_blocks=64, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    ref = LLMEngine(EngineConfig(**base))
    want = drive_engine(ref, [tok.encode(p) for p in PROMPTS], params)

    monkeypatch.setattr(dp_client, "replica_rank_groups", _oversubscribed)
    client = dp_client.DPEngineClient(EngineConfig(**base, tensor_parallel_size=2, data_parallel_size=2,
                                                   omp_threads_bind="nobind", distributed_executor_backend=backend))
    client.tokenizer = tok
    try:
        info = client.start(timeout=600)
        assert info["data_parallel_size"] == 2 and len(info["replicas"]) == 2
        assert [r.config.data_parallel_rank for r in client.replicas] == [0, 1]
        # each replica is a tensor-parallel engine of its own: its rank 0 and a worker rank, with the
        # shared-memory all-reduce (mp; Ray actors on one host use it too)
        tps = [r["tensor_parallel"] for r in info["replicas"]]
        assert all(t["world_size"] == 2 and t["communicator"] == "shm" and len(t["worker_pids"]) == 1 for t in tps), tps
        pids = [r["pid"] for r in info["replicas"]] + [p for t in tps for p in t["worker_pids"]]
        assert len(set(pids)) == 4 and os.getpid() not in pids, pids
        assert all(r.config.tensor_parallel_size == 2 and r.config.omp_threads_bind == "nobind"
                   and r.config.num_threads == 1 for r in client.replicas)
        async def session():
            client.attach(asyncio.get_running_loop())
            got = await _generate(client, tok, params)
            routed = list(client.routed)
            return got, routed, await _kill_mid_stream(client, tok, tps[1]["worker_pids"][0])

        got, routed, outcomes = asyncio.run(session())
        assert got == want
        assert all(n > 0 for n in routed), routed
        # a worker rank of replica 1 killed mid-generation: every in-flight stream (both replicas') ends
        # with an error naming the dead replica, the set is dead (new requests refused), nothing hangs
        assert all(isinstance(o, EngineDeadError) for o in outcomes), outcomes
        assert client.dead and client.dead.startswith("data-parallel replica 1 died"), client.dead
        with pytest.raises(EngineDeadError):
            client.add_request("late", tok.encode("Hello"), params)
    finally:
        client.shutdown()
