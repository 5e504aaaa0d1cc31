"""Fixtures of the bench tests: a live tiny-model `appliance serve` (with an API key) and a fake
OpenAI-compatible server whose delays are known."""
from __future__ import annotations

import threading
import time

import pytest

from appliance.bench.servers import ServerProcess, appliance_command, free_port
from fake_openai import fake_app

API_KEY = "bench-test-key"


@pytest.fixture(scope="session")
def live_server(llama_dir):
    """`appliance serve` on the tiny llama, float32, requiring API_KEY."""
    cmd = appliance_command(str(llama_dir), {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 128},
                            api_key=API_KEY)
    srv = ServerProcess(cmd, api_key=API_KEY, startup_timeout=180)
    srv.api_key = API_KEY
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def fake_server():
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake_app(), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    t.join(10)
