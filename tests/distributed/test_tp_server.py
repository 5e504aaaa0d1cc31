"""`appliance serve -tp 2 --omp-threads-bind "a|b"`: the engine process (rank 0) starts its worker on
its CPU list, a greedy completion equals
the offline TP=1 engine's text, and a worker killed while the server runs turns the next request
into an error naming the dead rank (the engine fails at once, nothing hangs)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from appliance import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--dtype", "float32", "--linear-backend", "torch", "--num-kv-blocks", "64"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_tp2_completes_and_fails_clearly_when_a_rank_dies(llama_dir):
    port = _port()
    cpus = sorted(os.sched_getaffinity(0))[:2]
    bind = f"{cpus[0]}|{cpus[1]}"  # one CPU list per rank
    log = tempfile.NamedTemporaryFile("w+", prefix="appliance-serve-tp-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "appliance.cli", "serve", str(llama_dir), "--port", str(port),
                             "-tp", "2", "--omp-threads-bind", bind, *FLAGS], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, Path(log.name).read_text(errors="replace")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, Path(log.name).read_text(errors="replace")
            time.sleep(0.3)
        body = {"model": str(llama_dir), "prompt": "Paris is the capital of", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        one = LLM(str(llama_dir), dtype="float32", linear_backend="torch", num_kv_blocks=64)
        want = one.generate(body["prompt"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert r.json()["choices"][0]["text"] == want[0].outputs[0].text

        # the server, its engine process (rank 0) and the engine's worker (rank 1)
        family = psutil.Process(proc.pid).children(recursive=True)
        workers = [p for p in family if p.ppid() != proc.pid]
        assert len(workers) == 1, [(p.pid, p.ppid(), p.cmdline()[-1:]) for p in family]
        assert workers[0].cpu_affinity() == [cpus[1]]  # rank 1 on its list
        banner = Path(log.name).read_text(errors="replace")
        assert "tensor parallel" in banner and "2 ranks (shm)" in banner, banner
        os.kill(workers[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert time.monotonic() - t0 < 10
        assert r.status_code >= 500 and f"rank 1 (pid {workers[0].pid}) exited with code -9" in r.text, r.text
        # the engine core died with its rank: the server stops serving and exits non-zero within seconds
        assert proc.wait(15) != 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_serve_tp2_ray_completes_and_fails_clearly_when_the_rank_actor_dies(llama_dir):
    """``-tp 2 --distributed-executor-backend ray``: rank 0 is the engine process, rank 1 a Ray actor
    (Ray on loopback, usage statistics off); the completion equals TP=1's text, and killing the
    actor's process fails the next request naming the rank, and the server exits non-zero."""
    try:
        import ray  # noqa: F401
    except ImportError:
        msg = 'ray is not installed (pip install "appliance[ray]"): the Ray tensor-parallel server check did not run'
        print(msg)
        pytest.skip(msg)
    port = _port()
    log = tempfile.NamedTemporaryFile("w+", prefix="appliance-serve-tp-ray-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "appliance.cli", "serve", str(llama_dir), "--port", str(port),
                             "-tp", "2", "--distributed-executor-backend", "ray", *FLAGS], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"})
    url = f"http://127.0.0.1:{port}"
    family: list = []
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, Path(log.name).read_text(errors="replace")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, Path(log.name).read_text(errors="replace")
            time.sleep(0.3)
        body = {"model": str(llama_dir), "prompt": "Paris is the capital of", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        one = LLM(str(llama_dir), dtype="float32", linear_backend="torch", num_kv_blocks=64)
        want = one.generate(body["prompt"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert r.json()["choices"][0]["text"] == want[0].outputs[0].text

        family = psutil.Process(proc.pid).children(recursive=True)
        actors = [p for p in family if "RankActor" in " ".join(p.cmdline())]
        assert len(actors) == 1, [(p.pid, p.cmdline()[:2]) for p in family]
        os.kill(actors[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert time.monotonic() - t0 < 15
        assert r.status_code >= 500 and "rank 1 (pid " in r.text, r.text
        assert proc.wait(30) != 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for p in family:  # Ray's own processes, should the engine not have stopped them
            try:
                p.kill()
            except psutil.Error:
                pass
