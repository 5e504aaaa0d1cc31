"""The shared-memory all-reduce on aarch64: the library cross-compiles with the exact command the
appliance builds it with, and a stand-alone self-test (native/neon_sve/shm/selftest.cpp: forked ranks,
float32 and bfloat16, across the sequence wrap) passes under qemu, built for armv8-a (LL/SC or outline
atomics) and armv8.1-a (LSE). The flags compile to load-acquire / store-release. Takes seconds."""
from __future__ import annotations

import subprocess

import pytest
from arm_tools import ensure_arm_tools

from appliance.distributed.shm_allreduce import build_command, source_path

SELFTEST = source_path().parent / "selftest.cpp"


@pytest.fixture(scope="module", autouse=True)
def tools():
    ensure_arm_tools()


def _objdump(path) -> str:
    return subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(path)], capture_output=True, text=True,
                          check=True).stdout


def test_library_cross_compiles(tmp_path):
    out = tmp_path / "libappliance_shm.so"
    r = subprocess.run(build_command(source_path(), out, cxx="aarch64-linux-gnu-g++"), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    asm = _objdump(out)
    assert "ldar\t" in asm and "stlr\t" in asm  # the flag waits and publishes


@pytest.mark.parametrize("march,cpu", [("armv8-a", "neoverse-n1"), ("armv8.1-a", "max")])
def test_selftest_under_qemu(tmp_path, march, cpu):
    exe = tmp_path / f"selftest-{march}"
    r = subprocess.run(["aarch64-linux-gnu-g++", "-O3", "-std=c++17", f"-march={march}", "-static", str(SELFTEST),
                        "-o", str(exe), "-lrt"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    if march == "armv8.1-a":
        assert "ldaddal" in _objdump(exe)  # the attach count: one LSE atomic
    for world in (2, 3):
        run = subprocess.run(["qemu-aarch64-static", "-cpu", cpu, str(exe), str(world)], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.startswith(f"ok world={world}"), run.stdout + run.stderr
