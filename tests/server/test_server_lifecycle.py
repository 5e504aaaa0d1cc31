"""Auth, the queue limit, abort on disconnect and SIGTERM, against live servers running a model
slow enough (8 layers, hidden 512) that a long request is still in flight when the test acts: its
long requests (1600 tokens, ~3 s at ~2 ms per token with the one-call native decoder stack) outlast
the 1 s client timeouts and shutdown timeout the tests use several times over."""
from __future__ import annotations

import contextlib
import json
import signal
import threading
import time

import httpx
import openai
import pytest

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SLOW_FLAGS = ("--served-model-name", "slow", "--dtype", "float32", "--num-kv-blocks", "256")


@pytest.fixture(scope="module")
def slow_model_dir(tiny_model_dir):
    return tiny_model_dir("llama", hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                          max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(start_server, slow_model_dir):
    # The key comes from the environment (APPLIANCE_API_KEY), the limits from flags.
    srv = start_server(slow_model_dir, "--served-model-name", "slow", "--dtype", "float32", "--num-kv-blocks", "256",
                       "--max-num-seqs", "2", "--max-queued-requests", "1", env={"APPLIANCE_API_KEY": KEY})
    yield srv
    assert srv.stop() == 0, srv.output()
    assert "Traceback" not in srv.output(), srv.output()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60, headers=AUTH) as c:
        yield c


def metric(http, name: str, label: str = "", text: str | None = None) -> float:
    for line in (text if text is not None else http.get("/metrics").text).splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_idle(http, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        text = http.get("/metrics").text
        if metric(http, "appliance:kv_cache_usage_perc", text=text) == 0 and \
                metric(http, "appliance:num_requests_running", text=text) == 0 and \
                metric(http, "appliance:num_requests_waiting", text=text) == 0:
            return
        assert time.monotonic() < deadline, http.get("/metrics").text
        time.sleep(0.1)


def long_chat(max_tokens: int = 1600) -> dict:
    return {"model": "slow", "messages": [{"role": "user", "content": "Tell me everything."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}


def test_auth_enforced(server):
    url = server.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{url}/v1/completions", json={"model": "slow", "prompt": "x", "max_tokens": 1}, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.post(f"{url}/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200  # probes and scrapers need no key
    assert httpx.get(f"{url}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    r = good.completions.create(model="slow", prompt="Hello", max_tokens=2, temperature=0,
                                extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


def test_abort_on_disconnect_frees_kv_cache(http, server):
    wait_idle(http)
    aborted = metric(http, "appliance:request_success_total", 'finished_reason="abort"')
    with httpx.Client(base_url=server.base_url, timeout=60, headers=AUTH) as c, \
            c.stream("POST", "/v1/chat/completions", json=long_chat()) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        n = 0
        while n < 3:  # the role chunk and two tokens
            n += next(lines).startswith("data: ")
        # still reading (leaving iter_lines closes the connection): the request holds KV blocks
        assert metric(http, "appliance:kv_cache_usage_perc") > 0
        assert metric(http, "appliance:num_requests_running") == 1
        lines.close()
    # the client is gone: the request is aborted and its blocks return to the pool within a step
    wait_idle(http, timeout=10)
    assert metric(http, "appliance:request_success_total", 'finished_reason="abort"') == aborted + 1
    assert "aborted (client went away)" in server.output()


def test_non_streaming_request_aborted_when_client_goes_away(http, server):
    wait_idle(http)
    aborted = metric(http, "appliance:request_success_total", 'finished_reason="abort"')
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/chat/completions", json={**long_chat(), "stream": False}, headers=AUTH,
                   timeout=httpx.Timeout(60, read=1.0))
    wait_idle(http, timeout=10)
    assert metric(http, "appliance:request_success_total", 'finished_reason="abort"') == aborted + 1


def test_queue_limit_gives_503_then_recovers(http, server):
    wait_idle(http)
    with contextlib.ExitStack() as stack:
        # max_num_seqs 2 + max_queued_requests 1: three sequences fit
        readers = []  # kept alive: a dropped iter_lines() closes its connection
        for _ in range(3):
            r = stack.enter_context(http.stream("POST", "/v1/chat/completions", json=long_chat()))
            assert r.status_code == 200
            readers.append(r.iter_lines())
            assert next(readers[-1]).startswith("data: ")  # the role chunk: admitted
        r = http.post("/v1/chat/completions", json={**long_chat(4), "stream": False})
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == "server_overloaded" and "max_queued_requests=1" in err["message"]
        text = http.get("/metrics").text  # one scrape: running and waiting from the same moment
        assert metric(http, "appliance:num_requests_running", text=text) + \
            metric(http, "appliance:num_requests_waiting", text=text) == 3
    wait_idle(http, timeout=15)
    r = http.post("/v1/completions", json={"model": "slow", "prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert metric(http, "appliance:request_rejected_total") >= 1


def _stream_in_thread(url: str, body: dict, events: list, first: threading.Event):
    def run():
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
                if r.status_code != 200:
                    events.append(r.read().decode())
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        events.append(data if data == "[DONE]" else json.loads(data))
                        if len(events) >= 2:
                            first.set()
        except httpx.HTTPError as e:
            events.append(e)
        first.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_sigterm_finishes_in_flight_and_exits_0(start_server, slow_model_dir):
    srv = start_server(slow_model_dir, *SLOW_FLAGS, "--shutdown-timeout", "300")
    events: list = []
    first = threading.Event()
    t = _stream_in_thread(srv.base_url, long_chat(600), events, first)
    assert first.wait(60), srv.output()
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # no new connections once SIGTERM is seen
        httpx.get(f"{srv.base_url}/health", timeout=5)
    t.join(300)
    assert srv.proc.wait(60) == 0, srv.output()
    assert events[-1] == "[DONE]", events[-3:]
    assert not any("error" in e for e in events[:-1]), events[-3:]
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["delta"].get("content", "")) > 0 for c in chunks) > 10
    out = srv.output()
    assert "shutting down: 1 request(s) in flight" in out and "Traceback" not in out, out


def test_sigterm_aborts_after_shutdown_timeout_and_exits_0(start_server, slow_model_dir):
    srv = start_server(slow_model_dir, *SLOW_FLAGS, "--shutdown-timeout", "1")
    events: list = []
    first = threading.Event()
    t = _stream_in_thread(srv.base_url, long_chat(2000), events, first)
    assert first.wait(60), srv.output()
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0, srv.output()
    assert time.monotonic() - t0 < 15
    t.join(10)
    assert events[-1] == "[DONE]", events[-3:]
    assert events[-2]["error"]["code"] == "aborted", events[-2]
    out = srv.output()
    assert "aborting 1 request(s)" in out and "Traceback" not in out, out
