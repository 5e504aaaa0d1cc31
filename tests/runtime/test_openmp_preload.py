"""An aarch64 OpenMP program, cross-compiled against Debian's libgomp, run under qemu as Neoverse V2
with the chosen libgomp preloaded: the dynamic-schedule loop, the atomic counter and the reduction
are exact, and the preloaded library is the one mapped (read from the program's own /proc/self/maps).
Also the preload environment the engine process gets on aarch64."""
from __future__ import annotations

import os
import subprocess

import pytest

from appliance.runtime import openmp
from appliance.runtime.worker import worker_env

from conftest import REPO, torch_wheel_libgomp

V2 = "max,sve128=on"  # scripts/arm64/run.sh's v2 profile


@pytest.fixture(scope="module")
def omp_program(arm_tools, tmp_path_factory):
    exe = tmp_path_factory.mktemp("omp") / "omp_dynamic_check"
    subprocess.run(["aarch64-linux-gnu-gcc", "-O2", "-march=armv8.2-a", "-fopenmp",
                    str(REPO / "openmp" / "omp_dynamic_check.c"), "-o", str(exe)], check=True)
    return exe


def _run(exe, preload, threads=4, n=50000, cpu=V2):
    cmd = ["qemu-aarch64-static", "-L", "/usr/aarch64-linux-gnu", "-cpu", cpu, "-E", f"OMP_NUM_THREADS={threads}"]
    if preload:
        cmd += ["-E", f"LD_PRELOAD={preload}"]
    r = subprocess.run([*cmd, str(exe), str(n)], capture_output=True, text=True, timeout=120)
    out = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    return r, out


def test_lse_libgomp_preloaded_runs_dynamic_loop(omp_program, lse_libgomp):
    r, out = _run(omp_program, lse_libgomp, threads=4, n=50000)
    assert r.returncode == 0 and "ok" in r.stdout.split(), r.stdout + r.stderr
    assert os.path.realpath(out["libgomp"]) == os.path.realpath(lse_libgomp)
    assert out["threads"] == "4" and int(out["sum"]) == 50000 * 50001 // 2 and out["counter"] == "1000"


def test_without_preload_the_distro_libgomp_is_mapped(omp_program):
    r, out = _run(omp_program, None, threads=3, n=1000)
    assert r.returncode == 0 and "ok" in r.stdout.split(), r.stdout + r.stderr
    assert "libgomp" in out["libgomp"] and "/usr/aarch64-linux-gnu/" in out["libgomp"]


def test_torch_2_13_libgomp_preloaded_is_correct_too(omp_program):
    # Slow (LL/SC) is not wrong: the bundled runtime computes the same result.
    lib = torch_wheel_libgomp("2.13.0")
    r, out = _run(omp_program, lib, threads=4, n=20000)
    assert r.returncode == 0 and "ok" in r.stdout.split(), r.stdout + r.stderr
    assert os.path.realpath(out["libgomp"]) == os.path.realpath(lib)


def test_lse_libgomp_on_n1_profile(omp_program, lse_libgomp):
    # Neoverse N1 has LSE (v8.2): the inline-LSE build must run there, not only on V2.
    r, out = _run(omp_program, lse_libgomp, threads=2, n=5000, cpu="neoverse-n1")
    assert r.returncode == 0 and "ok" in r.stdout.split(), r.stdout + r.stderr


def test_worker_env_preloads_chosen_libgomp_before_mimalloc(lse_libgomp, monkeypatch):
    monkeypatch.setenv(openmp.LIBGOMP_ENV, str(lse_libgomp))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    env = worker_env("mimalloc", libgomp="auto")
    parts = env["LD_PRELOAD"].split(":")
    assert parts[-1] == str(lse_libgomp) and env["APPLIANCE_LIBGOMP_PRELOADED"] == str(lse_libgomp)
    assert "mimalloc" in parts[0]
    monkeypatch.setenv(openmp.LIBGOMP_ENV, "none")
    assert "APPLIANCE_LIBGOMP_PRELOADED" not in worker_env("system", libgomp="auto")


def test_choose_libgomp_off_aarch64(monkeypatch):
    monkeypatch.delenv(openmp.LIBGOMP_ENV, raising=False)
    monkeypatch.setattr(openmp.platform, "machine", lambda: "x86_64")
    lib, why = openmp.choose_libgomp()
    assert lib is None and "not aarch64" in why
    assert openmp.preload_env("auto") == {}
