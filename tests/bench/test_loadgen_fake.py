"""The load generator's statistics against a fake server with known, injected delays."""
from __future__ import annotations

import pytest

from appliance.bench.loadgen import LoadConfig, run_level
from fake_openai import FAKE_GAP, FAKE_TOKENS, FAKE_TTFT

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def within(x, expected, rel=0.10):
    return x is not None and abs(x - expected) <= rel * expected


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_recovers_injected_ttft_and_gaps(fake_server, endpoint):
    cfg = LoadConfig(fake_server, "ok", endpoint=endpoint, output_len=FAKE_TOKENS)
    lv = run_level(cfg, ["hello world"] * 4, concurrency=2)
    assert lv["completed"] == 4 and lv["failed"] == 0 and lv["errors"] == []
    for key in ("mean", "p50"):  # tails carry scheduler jitter of a loaded CI host
        assert within(lv["ttft_s"][key], FAKE_TTFT), lv["ttft_s"]
        assert within(lv["itl_s"][key], FAKE_GAP), lv["itl_s"]
        assert within(lv["tpot_s"][key], FAKE_GAP), lv["tpot_s"]
        assert within(lv["e2e_s"][key], FAKE_TTFT + (FAKE_TOKENS - 1) * FAKE_GAP), lv["e2e_s"]
    # token counts are the server's usage
    assert lv["usage_reported"] and lv["output_tokens"] == 4 * FAKE_TOKENS and lv["input_tokens"] == 4 * 5
    assert lv["output_throughput"] == pytest.approx(lv["output_tokens"] / lv["duration_s"])


def test_poisson_arrivals(fake_server):
    cfg = LoadConfig(fake_server, "ok", output_len=2)
    lv = run_level(cfg, ["x"] * 6, request_rate=50.0, seed=1)
    assert lv["completed"] == 6 and lv["request_rate"] == 50.0 and lv["concurrency"] is None
    assert within(lv["ttft_s"]["p50"], FAKE_TTFT)


@pytest.mark.parametrize("mode,needle", [("http500", "HTTP 500"), ("streamerror", "injected stream error")])
def test_failures_are_counted_not_fast(fake_server, mode, needle):
    cfg = LoadConfig(fake_server, mode, output_len=FAKE_TOKENS)
    lv = run_level(cfg, ["x"] * 3, concurrency=3)
    assert lv["failed"] == 3 and lv["completed"] == 0
    assert any(needle in e for e in lv["errors"])
    assert lv["output_throughput"] is None and lv["output_tokens"] == 0
    assert all(v is None for v in lv["ttft_s"].values()) and all(v is None for v in lv["e2e_s"].values())


def test_unreachable_server_counts_failures():
    from appliance.bench.servers import free_port

    cfg = LoadConfig(f"http://127.0.0.1:{free_port()}", "m", output_len=4)
    lv = run_level(cfg, ["x"] * 2, concurrency=1)
    assert lv["failed"] == 2 and lv["request_throughput"] is None
