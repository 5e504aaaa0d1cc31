"""OpenMP placement: --omp-threads-bind parsing, the default (physical cores of one NUMA node),
warnings, the env libgomp reads, and real pinning of a child's OpenMP threads."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from appliance.errors import ApplianceError
from appliance.runtime import threads


@pytest.mark.parametrize("spec,cpus", [("0-3", [0, 1, 2, 3]), ("0-1,4,6-7", [0, 1, 4, 6, 7]), ("3,1,1", [1, 3]),
                                       (" 0 - 2 ", [0, 1, 2])])
def test_parse_cpu_list(spec, cpus):
    assert threads.parse_cpu_list(spec) == cpus
    assert threads.parse_cpu_list(threads.format_cpu_list(cpus)) == cpus


@pytest.mark.parametrize("spec,msg", [("a-b", "not a CPU number"), ("3-1", "bad range"), ("", "names no CPU"),
                                      ("-1", "not a CPU number")])
def test_parse_cpu_list_errors(spec, msg):
    with pytest.raises(ApplianceError, match=msg):
        threads.parse_cpu_list(spec)


def _fake_topology(monkeypatch, nodes, smt):
    """nodes: {node: [cpus]}; smt: CPUs c and c+smt share a core."""
    monkeypatch.setattr(threads, "numa_nodes", lambda: nodes)
    monkeypatch.setattr(threads, "core_of", lambda c: (0, c % smt))


def test_auto_is_physical_cores_of_one_node(monkeypatch):
    # 2 nodes x 4 cores, SMT2: CPUs 0-7 are cores 0-7, 8-15 their siblings.
    _fake_topology(monkeypatch, {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15]}, smt=8)
    p = threads.resolve("auto", allowed=set(range(16)))
    assert p.cpus == (0, 1, 2, 3) and p.num_threads == 4 and p.numa_node == 0 and not p.warnings
    env = threads.omp_env(p)
    assert env == {"OMP_NUM_THREADS": "4", "OMP_SCHEDULE": "static", "OMP_DYNAMIC": "false",
                   "OMP_PLACES": "{0},{1},{2},{3}", "OMP_PROC_BIND": "close"}
    assert threads.frontend_cpus(p, allowed=set(range(16))) == {4, 5, 6, 7, 12, 13, 14, 15}


def test_explicit_bind_warnings(monkeypatch):
    _fake_topology(monkeypatch, {0: list(range(4)) + list(range(8, 12)), 1: list(range(4, 8)) + list(range(12, 16))}, 8)
    p = threads.resolve("2-5", allowed=set(range(16)))
    assert p.cpus == (2, 3, 4, 5) and any("spans NUMA nodes" in w for w in p.warnings)
    p = threads.resolve("0,8", allowed=set(range(16)))
    assert any("SMT siblings" in w for w in p.warnings)
    p = threads.resolve("0-1", num_threads=4, allowed=set(range(16)))
    assert p.num_threads == 4 and any("oversubscribed" in w for w in p.warnings)
    assert "OMP_PLACES" not in threads.omp_env(p)  # no one-CPU-per-thread binding possible
    with pytest.raises(ApplianceError, match="not available to this process"):
        threads.resolve("0-40", allowed=set(range(16)))
    p = threads.resolve("nobind", allowed=set(range(16)))
    assert p.cpus is None and p.num_threads == 8  # one per physical core
    assert "OMP_PLACES" not in threads.omp_env(p)


def test_fewer_threads_than_bound_cpus(monkeypatch):
    _fake_topology(monkeypatch, {0: list(range(8))}, 8)
    p = threads.resolve("0-7", num_threads=3, allowed=set(range(8)))
    assert p.cpus == (0, 1, 2) and p.num_threads == 3


CHILD = r"""
import json, os, torch
from appliance.runtime.threads import thread_affinities
torch.ones(256, 256) @ torch.ones(256, 256)   # start the OpenMP team
print(json.dumps({"tids": thread_affinities(), "n": torch.get_num_threads()}))
"""


def test_child_openmp_threads_are_pinned():
    allowed = sorted(os.sched_getaffinity(0))
    p = threads.resolve(threads.format_cpu_list(allowed[-1:]))  # one CPU: works on any machine
    env = dict(os.environ, **threads.omp_env(p))
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    out = json.loads(r.stdout)
    assert out["n"] == 1
    # libgomp binds the initial thread to place 0: our CPU.
    assert str(allowed[-1]) in out["tids"].values()


CHILD_PRIVATE_LIBGOMP = r"""
import importlib.util, json, os, torch
from appliance.runtime.openmp import mapped_libgomp
from appliance.runtime.threads import thread_affinities
torch.ones(256, 256) @ torch.ones(256, 256)
has_sp = importlib.util.find_spec("sentencepiece") is not None
if has_sp:
    import sentencepiece  # noqa: F401  (its wheel's private libgomp-<hash>.so loads now)
torch.ones(512, 512) @ torch.ones(512, 512)
maps = open("/proc/self/maps").read()
print(json.dumps({"tids": thread_affinities(), "n": torch.get_num_threads(), "has_sp": has_sp,
                  "libgomp": mapped_libgomp(), "private": "libgomp-" in maps}))
"""


def test_a_private_libgomp_loaded_after_torch_warns_but_leaves_torch_threads_pinned():
    """The engine process (``appliance serve``'s worker, the re-executed ``appliance bench``) starts with
    OMP_PLACES one CPU per thread; torch's libgomp binds the main thread to place 0 when it loads. A wheel's
    private copy loaded later (sentencepiece, when transformers' tokenizer code imports it) reads the same
    OMP_PLACES, finds only place 0 in the main thread's mask and prints "libgomp: Number of places reduced
    from N to 1" (bench/results/spec.txt's warning). Harmless: that copy serves only its own extension's
    parallel regions (none at tokenization); torch's team keeps one thread on each placed CPU."""
    allowed = sorted(os.sched_getaffinity(0))[:2]
    p = threads.resolve(threads.format_cpu_list(allowed))
    env = dict(os.environ, **threads.omp_env(p))
    r = subprocess.run([sys.executable, "-c", CHILD_PRIVATE_LIBGOMP], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["n"] == len(allowed) and "libgomp-" not in os.path.basename(out["libgomp"] or "")
    pinned = sorted(v for v in out["tids"].values() if v in {str(c) for c in allowed})
    assert {str(c) for c in allowed} <= set(pinned), out["tids"]  # every placed CPU runs a torch thread
    warned = "Number of places reduced" in r.stderr
    # the warning comes from the private copy, and only where it has a place to drop
    assert warned == (out["private"] and len(allowed) > 1), (r.stderr, out)
