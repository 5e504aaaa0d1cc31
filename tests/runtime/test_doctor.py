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
