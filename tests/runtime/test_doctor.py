"""`appliance doctor --json`: validates against its schema and tells the truth about this CPU."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from appliance.doctor import ARM_FEATURES, SCHEMA, X86_FEATURES, doctor_report, validate

from conftest import REPO


@pytest.fixture(scope="module")
def report():
    return doctor_report()


def _cpuinfo_flags() -> set[str]:
    for line in open("/proc/cpuinfo"):
        key, _, val = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return set(val.split())
    return set()


def test_report_validates(report):
    assert validate(report) == []
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(report, SCHEMA)


def test_validator_catches_errors(report):
    bad = json.loads(json.dumps(report))
    bad["cpu"]["features"]["avx2"] = "yes"
    del bad["memory"]
    bad["problems"].append({"severity": "fatal", "what": "x", "fix": "y"})
    errs = validate(bad)
    assert any("$.cpu.features.avx2" in e for e in errs)
    assert any("missing 'memory'" in e for e in errs)
    assert any("'fatal' not in" in e for e in errs)


def test_cpu_features_are_the_truth(report):
    flags = _cpuinfo_flags()
    c = report["cpu"]
    assert c["arch"] == ("aarch64" if platform.machine() in ("aarch64", "arm64") else platform.machine())
    names = ARM_FEATURES if c["arch"] == "aarch64" else X86_FEATURES
    assert set(c["features"]) == set(names)
    if c["arch"] == "x86_64":  # on Arm the truth is getauxval; /proc/cpuinfo may show a host under qemu
        for n in names:
            assert c["features"][n] == (n in flags), n
    assert c["native_bf16"] == (("avx512_bf16" in flags or "amx_bf16" in flags) if c["arch"] == "x86_64"
                                else c["features"]["bf16"])


def test_cores_memory_and_torch(report):
    assert report["cores"]["logical"] == os.cpu_count()
    assert 1 <= report["cores"]["physical"] <= report["cores"]["logical"]
    assert sorted(c for v in report["cores"]["numa_nodes"].values() for c in v)
    assert report["memory"]["total_gib"] > 0
    import torch

    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["mkldnn"] == torch.backends.mkldnn.is_available()
    assert report["omp"]["recommended"]["num_threads"] >= 1
    for p in report["problems"]:
        assert p["fix"].strip(), p  # every problem comes with its fix


def test_cli_json_round_trip():
    r = subprocess.run([sys.executable, "-m", "appliance.doctor", "--json"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode in (0, 1), r.stderr
    data = json.loads(r.stdout)
    assert validate(data) == []


def test_rich_output_runs():
    r = subprocess.run([sys.executable, "-m", "appliance.doctor"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode in (0, 1) and "appliance doctor" in r.stdout and "allocator" in r.stdout


def _doctor_json(*args: str, env: dict | None = None) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, "-m", "appliance.cli", "doctor", "--json", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    assert r.returncode in (0, 1), r.stderr
    data = json.loads(r.stdout)
    assert validate(data) == []
    return r.returncode, data


def test_placement_per_rank_as_serve_would_make_it():
    """`doctor --json -tp/-dp/--omp-threads-bind` shows each rank's CPUs: what resolve_ranks gives serve."""
    from appliance.runtime import threads

    _, data = _doctor_json()
    pl = data["placement"]
    one = threads.resolve("auto")
    assert (pl["tensor_parallel_size"], pl["data_parallel_size"], pl["error"]) == (1, 1, None)
    assert [(x["replica"], x["rank"], x["cpus"]) for x in pl["ranks"]] == [(0, 0, list(one.cpus))]
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return
    a, b = cpus[:2]
    for args, env, shape in (
            (("-tp", "2"), {}, [(0, 0), (0, 1)]),
            (("-tp", "2", "--omp-threads-bind", f"{b}|{a}"), {}, [(0, 0), (0, 1)]),
            (("-dp", "2"), {"VLLM_CPU_OMP_THREADS_BIND": f"{b}|{a}"}, [(0, 0), (1, 0)])):
        rc, data = _doctor_json(*args, env=env)
        pl = data["placement"]
        spec = args[-1] if "--omp-threads-bind" in args else env.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
        want = threads.resolve_ranks(spec, 2)
        assert pl["error"] is None and pl["omp_threads_bind"] == spec, pl
        assert [(x["replica"], x["rank"]) for x in pl["ranks"]] == shape
        assert [x["cpus"] for x in pl["ranks"]] == [list(p.cpus) for p in want], (args, pl)
        assert [x["omp_places"] for x in pl["ranks"]] == [threads.omp_env(p)["OMP_PLACES"] for p in want]
        assert not set(pl["ranks"][0]["cpus"]) & set(pl["ranks"][1]["cpus"])
    # what serve would refuse: an error problem naming the flag and the value, exit code 1
    rc, data = _doctor_json("-tp", "2", "--omp-threads-bind", f"{a}|{a}")
    assert rc == 1 and data["placement"]["ranks"] == []
    assert f"CPU {a} is in the lists of ranks 0 and 1" in data["placement"]["error"]
    assert any(p["severity"] == "error" and p["what"].startswith("placement: --omp-threads-bind")
               for p in data["problems"]), data["problems"]
    rc, data = _doctor_json("-tp", "2", "-dp", "1", "--omp-threads-bind", f"{a}|{b}|{a}")
    assert rc == 1 and "3 CPU lists ('|' separates ranks) for 2 rank(s)" in data["placement"]["error"]


def test_placement_one_rank_per_numa_node_on_two_nodes():
    """On a two-node host (a fake topology), auto gives each rank a node and binds its memory there."""
    from appliance.doctor import placement_plan
    from appliance.runtime import threads

    host = threads.NodeTopology("two", {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}, {c: (c // 4, c) for c in range(8)},
                                tuple(range(8)))
    with threads.on_node(host):
        pl = placement_plan(tensor_parallel_size=2)
    assert pl["error"] is None
    assert [(x["cpus"], x["numa_node"], x["bind_memory"]) for x in pl["ranks"]] == [
        ([0, 1, 2, 3], 0, True), ([4, 5, 6, 7], 1, True)]
    assert "memory bound to it" in pl["ranks"][1]["describe"]


def test_placement_row_in_rich_output():
    r = subprocess.run([sys.executable, "-m", "appliance.cli", "doctor", "-tp", "2"], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode in (0, 1), r.stderr
    if len(os.sched_getaffinity(0)) >= 2:
        assert "replica 0 rank 1: 1 OpenMP threads, pinned to CPUs" in r.stdout, r.stdout
