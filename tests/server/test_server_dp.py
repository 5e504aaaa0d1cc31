"""Data parallel behind one server (--data-parallel-size 2), against live servers on the 2-core machine:
one replica per core. The model is the lifecycle tests' slow one (8 layers, hidden 512), so a long
request is still in flight when a test acts on it; --linear-backend torch so that no replica picks
its kernels by timing (two replicas timing under different load could pick different kernels, and
the texts must match DP=1's).

Servers: DP=1 (the reference texts), DP=2 (equality, both replicas used, disconnect, SIGTERM
drain), DP=2 whose replica is killed, DP=2 on Ray (equality)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from appliance.config import EngineConfig
from appliance.errors import ApplianceError, InvalidRequestError

FLAGS = ("--served-model-name", "slow", "--dtype", "float32", "--num-kv-blocks", "256",
         "--linear-backend", "torch", "--max-num-seqs", "32")
N_STREAMS = 32
TWO_CORES = len(os.sched_getaffinity(0)) >= 2
needs_two = pytest.mark.skipif(not TWO_CORES, reason="data parallel needs one core per replica: fewer than 2 CPUs")
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def slow_model_dir(tiny_model_dir):
    return tiny_model_dir("llama", hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                          max_position_embeddings=4096)


def prompts() -> list[str]:
    return [f"Request {i}: {' '.join(['tell', 'me', 'about', 'the', 'sea'][: 1 + i % 5])} {i * 7}"
            for i in range(N_STREAMS)]


async def _stream_text(c: httpx.AsyncClient, prompt: str) -> str:
    body = {"model": "slow", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                text.extend(ch["text"] for ch in ev["choices"])
    return "".join(text)


def concurrent_texts(base_url: str) -> list[str]:
    """All prompts at once, streamed (32 concurrent streams)."""
    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=300,
                                     limits=httpx.Limits(max_connections=N_STREAMS + 4)) as c:
            return await asyncio.gather(*(_stream_text(c, p) for p in prompts()))
    return asyncio.run(run())


def samples(text: str, name: str) -> dict[str | None, float]:
    """{engine label (None: the total): value} of metric ``name`` in a /metrics text."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            m = re.search(r'engine="(\d+)"', line)
            out[m.group(1) if m else None] = float(line.rsplit(" ", 1)[1])
    return out


def scrape(base_url: str) -> str:
    return httpx.get(f"{base_url}/metrics", timeout=30).text


def wait_idle(base_url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(base_url)
        busy = [(n, v) for n in ("appliance:kv_cache_usage_perc", "appliance:num_requests_running",
                                 "appliance:num_requests_waiting") for v in samples(text, n).values() if v]
        if not busy:
            return
        assert time.monotonic() < deadline, text
        time.sleep(0.1)


def replica_pids(output: str) -> dict[int, int]:
    return {int(i): int(p) for i, p in re.findall(r"data-parallel replica (\d+): pid (\d+)", output)}


def long_stream_in_thread(base_url: str, max_tokens: int, events: list, started: threading.Event):
    """A streamed chat request in a thread: ``events`` gets every SSE payload (parsed), an HTTP
    status text or the exception; ``started`` is set after the first two events."""
    body = {"model": "slow", "messages": [{"role": "user", "content": "Tell me everything."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}

    def run():
        try:
            with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=300) as r:
                if r.status_code != 200:
                    events.append(r.read().decode())
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                        if len(events) >= 2:
                            started.set()
        except httpx.HTTPError as e:
            events.append(e)
        started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def wait_running_on(base_url: str, want: dict[str, float], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(base_url)
        got = samples(text, "appliance:num_requests_running")
        if all(got.get(k) == v for k, v in want.items()):
            return text
        assert time.monotonic() < deadline, text
        time.sleep(0.05)


# -- refusals -------------------------------------------------------------------------------------
def test_config_refuses_bad_dp_size_and_backend():
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidRequestError, match=r"--data-parallel-size must be an integer >= 1, got") as e:
            EngineConfig(data_parallel_size=bad)
        assert e.value.param == "data_parallel_size"
    with pytest.raises(InvalidRequestError, match=r"--distributed-executor-backend must be one of mp, ray; got 'mpi'"):
        EngineConfig(distributed_executor_backend="mpi")


def test_replica_placements_split_and_refuse():
    from appliance.server.dp_client import replica_placements

    allowed = set(os.sched_getaffinity(0))
    if len(allowed) >= 2:
        a, b = sorted(allowed)[:2]
        ps = replica_placements(EngineConfig(data_parallel_size=2, omp_threads_bind=f"{a}|{b}"), allowed)
        assert [p.cpus for p in ps] == [(a,), (b,)] and [p.num_threads for p in ps] == [1, 1]
        with pytest.raises(ApplianceError, match=rf"CPU {a} is in the lists of ranks 0 and 1"):
            replica_placements(EngineConfig(data_parallel_size=2, omp_threads_bind=f"{a}|{a}"), allowed)
    with pytest.raises(ApplianceError, match=r"omp_threads_bind='0\|1': 2 CPU lists .* for 3 rank\(s\)"):
        replica_placements(EngineConfig(data_parallel_size=3, omp_threads_bind="0|1"), allowed)
    # more replicas than cores, and replicas x threads beyond the cores: flag, value and the valid range
    from appliance.runtime.threads import one_cpu_per_core

    n = len(one_cpu_per_core(sorted(allowed)))
    with pytest.raises(ApplianceError, match=rf"--data-parallel-size {n + 1} x .* gives \d+ CPU core\(s\); "
                                             rf"valid: --data-parallel-size <= \d+"):
        replica_placements(EngineConfig(data_parallel_size=n + 1), allowed)
    with pytest.raises(ApplianceError, match=rf"--data-parallel-size 2 x --num-threads {n} per replica = {2 * n} "
                                             r"threads.*and --num-threads <= "):
        replica_placements(EngineConfig(data_parallel_size=2, num_threads=n), allowed)
    with pytest.raises(ApplianceError, match=rf"--data-parallel-size 2 x --num-threads {len(allowed)} .*'nobind'"):
        replica_placements(EngineConfig(data_parallel_size=2, num_threads=len(allowed), omp_threads_bind="nobind"),
                           allowed)
    # an even split of the cores: disjoint, every replica the same size
    if n >= 2:
        ps = replica_placements(EngineConfig(data_parallel_size=2), allowed)
        assert len(ps) == 2 and not set(ps[0].cpus) & set(ps[1].cpus)
        assert ps[0].num_threads == ps[1].num_threads == len(ps[0].cpus) >= 1


def _serve_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_cli_refuses_too_many_replicas_and_missing_ray(tmp_path):
    from appliance.runtime.threads import one_cpu_per_core

    n = len(one_cpu_per_core(sorted(os.sched_getaffinity(0))))  # physical cores: one replica each at most
    r = _serve_cli("--port", "1", "-dp", str(n + 1))
    assert r.returncode == 2, r.stderr
    assert f"--data-parallel-size {n + 1}" in r.stderr and f"valid: --data-parallel-size <= {n}" in r.stderr, r.stderr
    # Ray missing: a `ray` package that fails to import stands in for an uninstalled one
    fake = tmp_path / "noray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    r = _serve_cli("--port", "1", "--distributed-executor-backend", "ray",
                   env={"PYTHONPATH": f"{fake.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert r.returncode == 2, r.stderr
    assert '--distributed-executor-backend ray: the ray package is not installed; install it with: ' \
           'pip install "appliance[ray]"' in r.stderr, r.stderr


def test_bench_passes_dp_through():
    from appliance.bench.common import parse_engine_args
    from appliance.bench.servers import appliance_command

    cmd = appliance_command("m", parse_engine_args(["data_parallel_size=2", "distributed_executor_backend=ray"]))
    assert cmd[cmd.index("--data-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "ray"


# -- live servers -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dp1_texts(start_server, slow_model_dir):
    srv = start_server(slow_model_dir, *FLAGS)
    try:
        texts = concurrent_texts(srv.base_url)
    finally:
        assert srv.stop() == 0, srv.output()
    assert all(texts) and len(set(texts)) > 1, texts  # real, distinct outputs to compare against
    return texts


@pytest.fixture(scope="module")
def dp2(start_server, slow_model_dir):
    srv = start_server(slow_model_dir, *FLAGS, "-dp", "2", "--shutdown-timeout", "300")
    yield srv
    srv.stop()
    assert "Traceback" not in srv.output(), srv.output()


@needs_two
def test_dp2_streams_equal_dp1_and_use_both_replicas(dp1_texts, dp2):
    out = dp2.output()
    pids = replica_pids(out)
    assert len(pids) == 2 and pids[0] != pids[1], out
    # each replica's threads are pinned to its own CPU (libgomp binds the main thread to its first place)
    from appliance.runtime.threads import parse_cpu_list

    cpus = {int(i): set(parse_cpu_list(c)) for i, c in re.findall(r"data-parallel replica (\d+): pid \d+, "
                                                                   r"1 threads on CPUs ([\d,-]+),", out)}
    assert len(cpus) == 2 and not cpus[0] & cpus[1], out
    for i, pid in pids.items():
        assert os.sched_getaffinity(pid) == cpus[i], (i, os.sched_getaffinity(pid), cpus[i])
    texts = concurrent_texts(dp2.base_url)
    for i, (a, b) in enumerate(zip(dp1_texts, texts)):
        assert a == b, (i, a, b)
    text = scrape(dp2.base_url)
    routed = samples(text, "appliance:engine_requests_routed_total")
    assert set(routed) == {"0", "1"} and sum(routed.values()) >= N_STREAMS, routed
    # all 32 arrive together; least-loaded routing on the frontend's count splits them evenly
    assert abs(routed["0"] - routed["1"]) <= 2, routed
    queries = samples(text, "appliance:prefix_cache_queries_total")  # the cores' own counts: both did work
    assert queries["0"] > 0 and queries["1"] > 0 and queries[None] == queries["0"] + queries["1"], queries
    wait_idle(dp2.base_url)


@needs_two
def test_disconnect_aborts_on_owning_replica(dp2):
    base = dp2.base_url
    wait_idle(base)
    before = samples(scrape(base), "appliance:request_success_total")
    aborted = [float(line.rsplit(" ", 1)[1]) for line in scrape(base).splitlines()
               if line.startswith('appliance:request_success_total{') and 'finished_reason="abort"' in line][0]
    body = {"model": "slow", "messages": [{"role": "user", "content": "Tell me everything."}],
            "max_tokens": 1600, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=60) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        n = 0
        while n < 3:
            n += next(lines).startswith("data: ")
        text = scrape(base)
        kv = samples(text, "appliance:kv_cache_usage_perc")
        running = samples(text, "appliance:num_requests_running")
        owner = [k for k in ("0", "1") if running[k] == 1]
        assert len(owner) == 1 and kv[owner[0]] > 0, text  # one replica holds it, the other is idle
        other = "1" if owner[0] == "0" else "0"
        assert running[other] == 0 and kv[other] == 0, text
        lines.close()
    wait_idle(base, timeout=10)  # the owner's KV usage is back to 0 (and the other's stayed there)
    after = [float(line.rsplit(" ", 1)[1]) for line in scrape(base).splitlines()
             if line.startswith('appliance:request_success_total{') and 'finished_reason="abort"' in line][0]
    assert after == aborted + 1, (before, after)
    assert "aborted (client went away)" in dp2.output()


@needs_two
def test_sigterm_drains_both_replicas(dp2):
    """The module's last use of the DP=2 server."""
    base = dp2.base_url
    wait_idle(base)
    runs = []
    for _ in range(2):
        events: list = []
        started = threading.Event()
        runs.append((events, long_stream_in_thread(base, 600, events, started), started))
        assert started.wait(60), dp2.output()
    wait_running_on(base, {"0": 1, "1": 1})  # one on each replica
    dp2.proc.send_signal(signal.SIGTERM)
    for events, t, _ in runs:
        t.join(300)
    assert dp2.proc.wait(60) == 0, dp2.output()
    for events, _, _ in runs:
        assert events[-1] == "[DONE]", events[-3:]
        assert not any("error" in e for e in events[:-1]), events[-3:]
        chunks = [e for e in events[:-1] if e["choices"]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "shutting down: 2 request(s) in flight" in dp2.output()


@needs_two
def test_killed_replica_fails_requests_and_stops_server(start_server, slow_model_dir):
    check_killed_replica(start_server(slow_model_dir, *FLAGS, "-dp", "2"))


def check_killed_replica(srv) -> None:
    """Replica 0's process killed while both replicas stream: every in-flight stream ends with an
    engine_dead error, new requests get 503 naming the replica, the server exits non-zero within 20 s.
    (Also run for the Ray backend: tests/server/test_server_dp_ray.py.)"""
    try:
        pids = replica_pids(srv.output())
        runs = []
        for _ in range(2):
            events: list = []
            started = threading.Event()
            runs.append((events, long_stream_in_thread(srv.base_url, 3000, events, started), started))
            assert started.wait(60), srv.output()
        wait_running_on(srv.base_url, {"0": 1, "1": 1})
        os.kill(pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        saw_503 = False
        while time.monotonic() - t0 < 10 and not saw_503:  # new requests are refused until the server is gone
            try:
                r = httpx.post(f"{srv.base_url}/v1/completions", json={"model": "slow", "prompt": "x", "max_tokens": 2},
                               timeout=5)
                saw_503 = r.status_code == 503
                if saw_503:
                    assert "replica 0 died" in r.json()["error"]["message"], r.text
            except httpx.HTTPError:
                break  # already gone
        code = srv.proc.wait(20)
        assert code != 0, srv.output()
        assert time.monotonic() - t0 < 20
        for events, t, _ in runs:  # both in-flight streams (the dead replica's and the other's) end with an error
            t.join(10)
            assert not t.is_alive()
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            assert errors and errors[0]["error"]["code"] == "engine_dead", events[-3:]
            assert "the engine failed" in errors[0]["error"]["message"], errors[0]
        assert saw_503, srv.output()
        assert "data-parallel replica 0 died" in srv.output()
    finally:
        srv.stop()


def test_killed_single_engine_stops_server(start_server, llama_dir):
    """The one-engine path takes the same exit: in-flight error, 503, non-zero exit."""
    srv = start_server(llama_dir, "--dtype", "float32", "--linear-backend", "torch", "--num-kv-blocks", "64")
    try:
        pid = int(re.search(r"core process pid (\d+)", srv.output()).group(1))
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        codes = set()
        while time.monotonic() - t0 < 10 and 503 not in codes:
            try:
                codes.add(httpx.get(f"{srv.base_url}/health", timeout=5).status_code)
            except httpx.HTTPError:
                break
        assert srv.proc.wait(20) != 0, srv.output()
        assert time.monotonic() - t0 < 20
        assert 503 in codes, (codes, srv.output())
        assert "server stopped because the engine failed" in srv.output()
    finally:
        srv.stop()


@needs_two
def test_dp2_ray_streams_equal_dp1(dp1_texts, start_server, slow_model_dir):
    try:
        import ray  # noqa: F401
    except ImportError:
        msg = 'ray is not installed (pip install "appliance[ray]"): the Ray data-parallel check did not run'
        print(msg)
        pytest.skip(msg)
    srv = start_server(slow_model_dir, *FLAGS, "-dp", "2", "--distributed-executor-backend", "ray",
                       env={"RAY_USAGE_STATS_ENABLED": "0"}, startup_timeout=300)
    try:
        out = srv.output()
        assert "2 replicas (ray)" in out, out
        texts = concurrent_texts(srv.base_url)
        for i, (a, b) in enumerate(zip(dp1_texts, texts)):
            assert a == b, (i, a, b)
        routed = samples(scrape(srv.base_url), "appliance:engine_requests_routed_total")
        assert routed["0"] > 0 and routed["1"] > 0, routed
    finally:
        assert srv.stop() == 0, srv.output()
    assert "Traceback" not in srv.output(), srv.output()
