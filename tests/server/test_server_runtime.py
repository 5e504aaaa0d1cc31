"""The engine process of `appliance serve` really runs with mimalloc preloaded (checked from outside
through /proc/PID/maps), and without it under --allocator system; /metrics says which."""
from __future__ import annotations

import httpx
import psutil
import pytest

from appliance.runtime.allocator import mimalloc_mapped


def engine_pid(server) -> int:
    kids = psutil.Process(server.proc.pid).children(recursive=True)
    cores = [p for p in kids if "multiprocessing" in " ".join(p.cmdline()) or p.name().startswith("python")]
    assert cores, f"no engine process under {server.proc.pid}"
    return cores[0].pid


@pytest.mark.parametrize("allocator,expect", [("mimalloc", True), ("system", False)])
def test_engine_process_allocator(start_server, server_model_dir, allocator, expect):
    server = start_server(server_model_dir, "--dtype", "float32", "--num-kv-blocks", "64",
                          "--allocator", allocator)
    try:
        pid = engine_pid(server)
        assert bool(mimalloc_mapped(pid)) is expect
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        line = next(l for l in metrics.splitlines() if l.startswith("appliance:allocator_info{"))
        assert f'mimalloc_live="{"true" if expect else "false"}"' in line
        # and it still serves
        r = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                       json={"model": str(server_model_dir), "prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200, r.text
    finally:
        assert server.stop() == 0
