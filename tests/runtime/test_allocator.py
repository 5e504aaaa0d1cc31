"""mimalloc preloaded into a child process (as the engine process is started): visible from outside
in /proc/PID/maps and live from inside (malloc resolves into it); absent with 'system'."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest

from appliance.errors import ApplianceError
from appliance.runtime import allocator
from appliance.runtime.worker import child_environ

CHILD = r"""
import json, resource, sys
from appliance.runtime.allocator import allocator_in_use
def step():
    b = bytearray(64 << 20)           # a 64 MB buffer per step, touched page by page
    b[::4096] = b"\x01" * len(b[::4096])
step()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 5
print(json.dumps({"info": allocator_in_use(), "faults_per_step": faults}), flush=True)
sys.stdin.readline()                  # stay alive until the parent has read our maps
"""


def _child(kind):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.pop("GLIBC_TUNABLES", None)
    env.update(allocator.preload_env(kind, base=env))
    p = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    report = json.loads(p.stdout.readline())
    outside = allocator.mimalloc_mapped(p.pid)  # checked from outside, while it runs
    p.stdin.write("\n")
    p.stdin.close()
    p.wait(30)
    return report, outside


@pytest.fixture(scope="module")
def mimalloc_lib():
    lib = allocator.find_mimalloc()
    if lib is None:
        pytest.fail("no libmimalloc: pip install cmeel-mimalloc (a dependency in pyproject.toml)")
    return lib


def test_find_mimalloc_is_3x(mimalloc_lib):
    v = allocator.library_version(mimalloc_lib)
    assert v is not None and v >= 30000, allocator.format_version(v)


def test_mimalloc_preload_visible_in_child_maps(mimalloc_lib):
    report, outside = _child("mimalloc")
    assert outside is not None and os.path.realpath(outside) == os.path.realpath(mimalloc_lib)
    info = report["info"]
    assert info["name"] == "mimalloc" and info["requested"] == "mimalloc"
    assert info["malloc_from"] and "mimalloc" in info["malloc_from"]
    assert info["mimalloc_version"].startswith("3.")
    # The reason for it: glibc takes ~16k faults per 64 MB step (mmap/munmap); mimalloc keeps pages.
    assert report["faults_per_step"] < 2000, report


def test_system_has_no_mimalloc(mimalloc_lib):
    report, outside = _child("system")
    assert outside is None
    assert report["info"]["name"] == "glibc" and report["info"]["mimalloc_mapped"] is None
    assert report["faults_per_step"] > 8000, report  # 16384 pages of 4 KiB per step here


def test_glibc_tuned_keeps_pages_without_preload():
    report, outside = _child("glibc-tuned")
    assert outside is None and report["info"]["name"] == "glibc"
    assert "glibc.malloc.mmap_threshold" in report["info"]["glibc_tunables"]
    assert report["faults_per_step"] < 2000, report


def _spawned_target(q):
    from appliance.runtime.worker import worker_startup

    q.put(worker_startup(None))
    time.sleep(5)


def test_spawned_engine_process_gets_mimalloc(mimalloc_lib):
    # As the server starts its engine core: multiprocessing spawn inside child_environ.
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_spawned_target, args=(q,), daemon=True)
    before = os.environ.get("LD_PRELOAD")
    with child_environ(allocator.preload_env("mimalloc")):
        p.start()
    assert os.environ.get("LD_PRELOAD") == before  # the parent is untouched
    try:
        report = q.get(timeout=60)
        assert allocator.mimalloc_mapped(p.pid) is not None
        assert report["allocator"]["name"] == "mimalloc"
    finally:
        p.terminate()
        p.join(10)


def test_preload_env_merges_and_validates(monkeypatch, mimalloc_lib):
    env = allocator.preload_env("mimalloc", base={"LD_PRELOAD": "/x/libfoo.so " + str(mimalloc_lib)})
    assert env["LD_PRELOAD"] == f"{mimalloc_lib}:/x/libfoo.so"
    t = allocator.preload_env("glibc-tuned", base={"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
    assert t["GLIBC_TUNABLES"].startswith("glibc.malloc.trim_threshold=1:")  # the user's value wins
    assert allocator.preload_env("system", base={}) == {"APPLIANCE_ALLOCATOR": "system"}
    with pytest.raises(ApplianceError, match="--allocator must be one of"):
        allocator.preload_env("jemalloc")
    monkeypatch.setenv(allocator.MIMALLOC_ENV, "/nonexistent/libmimalloc.so")
    with pytest.raises(ApplianceError, match="APPLIANCE_MIMALLOC"):
        allocator.preload_env("mimalloc")


def test_fallback_when_no_mimalloc(monkeypatch):
    monkeypatch.setattr(allocator, "find_mimalloc", lambda: None)
    env = allocator.preload_env("mimalloc", base={})
    assert env["APPLIANCE_ALLOCATOR"] == "glibc-tuned" and "LD_PRELOAD" not in env and "GLIBC_TUNABLES" in env
