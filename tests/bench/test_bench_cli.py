"""Every `appliance bench` subcommand end to end on a tiny model (a live server for serve and compare),
each record checked against the schema."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from typer.testing import CliRunner

from appliance.bench import schema
from appliance.bench.loadgen import LoadConfig, _client, one_request
from appliance.cli import app

runner = CliRunner()


def invoke(*args):
    res = runner.invoke(app, ["bench", *map(str, args)], catch_exceptions=False)
    return res


def load(path):
    rec = json.loads(path.read_text())
    schema.validate(rec)
    return rec


def server_tokens(srv) -> tuple[int, int]:
    text = httpx.get(f"{srv.base_url}/metrics", headers={"Authorization": f"Bearer {srv.api_key}"}).text
    get = lambda name: int(float(re.search(rf"^appliance:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1)))  # noqa: E731
    return get("prompt_tokens_total"), get("generation_tokens_total")


def test_serve_against_live_server(live_server, tmp_path):
    before = server_tokens(live_server)
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    res = invoke("serve", "--base-url", live_server.base_url + "/v1", "--api-key", live_server.api_key, "--concurrency", "1,2",
                 "--num-prompts", 3, "--input-len", 8, "--output-len", 4, "--prompt-format", "ids", "--warmup", 0,
                 "--json", out, "--plot", png)
    assert res.exit_code == 0, res.output
    rec = load(out)
    after = server_tokens(live_server)
    levels = rec["results"]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    for lv in levels:
        assert lv["completed"] == 3 and lv["failed"] == 0 and lv["usage_reported"]
        assert lv["output_tokens"] == 3 * 4 and lv["input_tokens"] == 3 * 8
        for q in ("mean", "p50", "p90", "p99"):
            assert 0 < lv["ttft_s"][q] <= lv["e2e_s"][q]
    # the token counts are the server's own
    assert after[0] - before[0] == sum(lv["input_tokens"] for lv in levels)
    assert after[1] - before[1] == sum(lv["output_tokens"] for lv in levels)
    assert rec["settings"]["concurrency"] == [1, 2] and rec["machine"]["logical_cpus"] >= 1
    assert png.stat().st_size > 1000


def test_serve_chat_with_poisson_arrivals(live_server, tmp_path):
    out = tmp_path / "rate.json"
    res = invoke("serve", "--base-url", live_server.base_url, "--api-key", live_server.api_key, "--endpoint", "chat",
                 "--request-rate", 20, "--num-prompts", 3, "--input-len", 8, "--output-len", 3, "--warmup", 0,
                 "--json", out)
    assert res.exit_code == 0, res.output
    (lv,) = load(out)["results"]["levels"]
    assert lv["request_rate"] == 20 and lv["concurrency"] is None  # the default sweep list is no cap
    assert lv["completed"] == 3 and lv["output_tokens"] == 9 and lv["input_tokens"] > 0


def test_each_request_ttft_le_e2e_and_usage_matches(live_server):
    cfg = LoadConfig(live_server.base_url, "x", endpoint="chat", output_len=5, api_key=live_server.api_key)
    cfg.model = httpx.get(f"{live_server.base_url}/v1/models",
                          headers={"Authorization": f"Bearer {live_server.api_key}"}).json()["data"][0]["id"]

    async def go():
        async with _client(cfg, 2) as c:
            return await asyncio.gather(*(one_request(c, cfg, "The quick brown fox") for _ in range(3)))

    for r in asyncio.run(go()):
        assert r.ok, r.error
        assert 0 < r.ttft <= r.e2e and r.output_tokens == 5 and r.usage_reported
        assert r.chunks <= r.output_tokens and len(r.itl) == r.chunks - 1


def test_wrong_api_key_counts_failures(live_server, tmp_path):
    out = tmp_path / "bad.json"
    res = invoke("serve", "--base-url", live_server.base_url, "--api-key", "wrong", "--model", "whatever",
                 "--concurrency", 2, "--num-prompts", 3, "--input-len", 8, "--output-len", 4, "--warmup", 0,
                 "--json", out)
    assert res.exit_code == 1  # nothing completed: not a result
    lv = load(out)["results"]["levels"][0]
    assert lv["failed"] == 3 and lv["completed"] == 0 and "HTTP 401" in lv["errors"][0]
    assert lv["output_throughput"] is None and lv["ttft_s"]["p50"] is None
    # and without --model the /v1/models probe fails with an actionable message
    res = invoke("serve", "--base-url", live_server.base_url, "--api-key", "wrong", "--concurrency", 1)
    assert res.exit_code == 1 and "API key" in res.output


def test_throughput(llama_dir, tmp_path):
    out = tmp_path / "t.json"
    res = invoke("throughput", "--model", llama_dir, "--num-prompts", 4, "--input-len", 8, "--output-len", 4,
                 "--dtype", "float32", "-e", "num_kv_blocks=64", "--json", out)
    assert res.exit_code == 0, res.output
    r = load(out)["results"]
    assert r["num_requests"] == 4 and r["input_tokens"] == 32 and r["output_tokens"] == 16
    assert r["output_tokens_per_s"] == pytest.approx(16 / r["elapsed_s"])
    assert load(out)["settings"]["engine"] == {"dtype": "float32", "num_kv_blocks": 64}


def test_throughput_jsonl_dataset(llama_dir, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "Paris is the capital"}\n"The quick brown fox"\n')
    res = invoke("throughput", "--model", llama_dir, "--dataset", data, "--output-len", 3, "--dtype", "float32",
                 "-e", "num_kv_blocks=64")
    assert res.exit_code == 0, res.output


def test_engine_arg_errors_name_the_field(llama_dir):
    res = invoke("throughput", "--model", llama_dir, "-e", "no_such_flag=1")
    assert res.exit_code == 2 and "no_such_flag" in res.output


def test_latency(llama_dir, tmp_path):
    out = tmp_path / "l.json"
    res = invoke("latency", "--model", llama_dir, "--batch-size", 2, "--input-len", 8, "--output-len", 4,
                 "--repeats", 2, "--dtype", "float32", "-e", "num_kv_blocks=64", "--json", out)
    assert res.exit_code == 0, res.output
    r = load(out)["results"]
    assert r["ttft_s"]["p50"] <= r["e2e_s"]["p50"] and r["tpot_s"]["p50"] > 0


@pytest.mark.parametrize("quantization", ["none", "w4a8"])
def test_profile(llama_dir, tmp_path, quantization):
    out, trace = tmp_path / "p.json", tmp_path / "trace.json"
    quant = ["-e", f"quantization={quantization}"] if quantization != "none" else []
    res = invoke("profile", "--model", llama_dir, "--num-prompts", 2, "--input-len", 8, "--output-len", 4,
                 "--dtype", "float32", "-e", "num_kv_blocks=64", *quant, "--trace", trace, "--json", out)
    assert res.exit_code == 0, res.output
    r = load(out)["results"]
    b = {x["name"]: x["seconds"] for x in r["buckets"]}
    for name in ("linear", "attention", "norm_rotary_act", "sampling", "sched_prep", "detokenize"):
        assert b[name] > 0, (name, b)
    assert sum(x["fraction"] for x in r["buckets"]) == pytest.approx(1.0, abs=0.02)
    assert r["output_tokens"] == 8 and r["threads"]["process"] >= 1 and r["top_ops"]
    # every projection of both layers and lm_head, float or quantized, in every forward step
    assert trace.read_text().count('"name": "appliance::linear"') >= (2 * 4 + 1) * r["steps"]
    # the wrappers are gone afterwards
    from appliance.layers.linear import Linear
    from appliance.layers.quant import QuantLinear
    assert Linear.forward.__qualname__ == "Linear.forward"
    assert QuantLinear.forward.__qualname__ == "QuantLinear.forward"


def test_kernels(llama_dir, tmp_path):
    out = tmp_path / "k.json"
    res = invoke("kernels", "--model", llama_dir, "--decode-batch", "1,4", "--prefill-tokens", 16, "--context", 32,
                 "--min-time", 0.01, "--peak-size", 128, "--bandwidth-mb", 4, "--json", out)
    assert res.exit_code == 0, res.output
    r = load(out)["results"]
    layers = {g["layer"] for g in r["gemm"]}
    assert layers == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert {g["phase"] for g in r["gemm"]} == {"decode", "prefill"} and "torch" in {g["backend"] for g in r["gemm"]}
    for g in r["gemm"]:
        assert g["roofline_gflops"] <= r["peak_gemm_gflops"] + 1e-9
        assert g["fraction_of_peak"] == pytest.approx(g["gflops"] / r["peak_gemm_gflops"])
    assert r["attention"] and all(a["gbps"] > 0 for a in r["attention"])


def test_compare_appliance_only(llama_dir, tmp_path):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    res = invoke("compare", "--model", llama_dir, "--peers", "llama.cpp", "--concurrency", "1,2", "--num-prompts", 2,
                 "--input-len", 8, "--output-len", 4, "--warmup", 0, "--max-model-len", 128, "-e", "num_kv_blocks=64",
                 "--peers-dir", tmp_path / "no-peers", "--json", out,
                 "--plot", png)
    assert res.exit_code == 0, res.output
    systems = load(out)["results"]["systems"]
    assert systems[0]["name"] == "appliance" and systems[0]["status"] == "ran"
    assert [lv["completed"] for lv in systems[0]["levels"]] == [2, 2]
    # llama.cpp is not installed (not in --peers-dir, nor in this Python): skipped, with the reason
    assert systems[1]["name"] == "llama.cpp" and systems[1]["status"] == "skipped" and systems[1]["reason"]
    assert png.exists()


def test_schema_command_prints_the_schema():
    res = invoke("schema", "serve")
    assert res.exit_code == 0
    assert json.loads(res.output)["properties"]["bench"] == {"enum": ["serve"]}


def test_bench_process_runs_with_mimalloc_unless_told_otherwise(llama_dir, tmp_path):
    """`appliance bench` re-executes itself under the engine worker's environment (mimalloc
    preloaded), as `appliance serve` starts its engine process; --allocator system opts out."""
    import subprocess
    import sys

    for alloc, want in (("mimalloc", "mimalloc"), ("system", "glibc")):
        out = tmp_path / f"{alloc}.json"
        r = subprocess.run([sys.executable, "-m", "appliance.cli", "bench", "--allocator", alloc, "throughput",
                            "--model", str(llama_dir), "--num-prompts", "2", "--input-len", "8", "--output-len", "2",
                            "--dtype", "float32", "--json", str(out)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        rec = json.loads(out.read_text())
        assert rec["machine"]["allocator"].startswith(want), rec["machine"]["allocator"]
