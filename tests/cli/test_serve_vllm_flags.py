"""`appliance serve` under vLLM's spellings: every alias, the --config YAML file and the VLLM_*
environment variables produce exactly the EngineConfig / ServerConfig our own flags produce.
Parse level: the server itself is replaced by a function that records the configs."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from appliance.cli import app
from appliance.runtime import threads

ENV_NAMES = ("VLLM_API_KEY", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
             "APPLIANCE_API_KEY", "APPLIANCE_KV_CACHE_MEMORY", "APPLIANCE_OMP_THREADS_BIND", "APPLIANCE_NUM_THREADS",
             "APPLIANCE_NUM_KV_BLOCKS", "APPLIANCE_ENABLE_PREFIX_CACHING")


@pytest.fixture
def parse(monkeypatch):
    """parse(*argv, env={}) -> (EngineConfig, ServerConfig) that `appliance serve argv` would run."""
    import appliance.server.launcher as launcher

    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    seen = {}

    def fake_serve(engine_config, server_config):
        seen["configs"] = (engine_config, server_config)
        return 0

    monkeypatch.setattr(launcher, "serve", fake_serve)

    def run(*argv, env=None, expect_code=0):
        seen.clear()
        r = CliRunner().invoke(app, ["serve", "/some/model", *argv], env=env or {}, catch_exceptions=False)
        assert r.exit_code == expect_code, r.output
        return seen.get("configs") or r.output

    return run


@pytest.mark.parametrize("ours, vllms, other", [
    (["--prefix-caching"], ["--enable-prefix-caching"], ["--no-prefix-caching"]),
    (["--no-prefix-caching"], ["--no-enable-prefix-caching"], ["--prefix-caching"]),
    (["--num-kv-blocks", "77"], ["--num-gpu-blocks-override", "77"], []),
    (["--kv-cache-memory", "4"], ["--kv-cache-memory-bytes", "4G"], []),
    (["--kv-cache-memory", "0.5"], ["--kv-cache-memory-bytes", "512M"], []),
    (["--kv-cache-memory", str(2**32 / 2**30)], ["--kv-cache-memory-bytes", "4294967296"], []),
])
def test_engine_aliases_map_to_our_flags(parse, ours, vllms, other):
    assert parse(*ours) == parse(*vllms)
    assert parse(*ours)[0] != parse(*other)[0]  # the comparison can fail: the flag does change the config


def test_kv_cache_memory_bytes_units(parse):
    assert parse("--kv-cache-memory-bytes", "4g")[0].kv_cache_memory == pytest.approx(4e9 / 2**30)
    assert parse("--kv-cache-memory-bytes", "1.5K")[0].kv_cache_memory == pytest.approx(1536 / 2**30)
    out = parse("--kv-cache-memory-bytes", "4X", expect_code=2)
    assert "--kv-cache-memory-bytes" in out and "'4X'" in out
    out = parse("--kv-cache-memory-bytes", "4G", "--kv-cache-memory", "2", expect_code=2)
    assert "--kv-cache-memory" in out and "not both" in out


def test_several_served_names_and_api_keys(parse):
    _, server = parse("--served-model-name", "a", "--served-model-name", "b", "--api-key", "k1", "--api-key", "k2")
    assert server.served_model_names == ["a", "b"]
    assert server.api_keys == ["k1", "k2"]


def test_space_separated_lists_as_vllm(parse):
    # parse() puts the model first, as `vllm serve MODEL ...` does
    want = parse("--served-model-name", "a", "--served-model-name", "b", "--api-key", "k1", "--api-key", "k2",
                 "--port", "9001")
    assert parse("--served-model-name", "a", "b", "--api-key", "k1", "k2", "--port", "9001") == want
    assert want[1].served_model_names == ["a", "b"] and want[1].api_keys == ["k1", "k2"]


def test_space_separated_lists_need_the_model_first():
    from appliance.vllm_compat import expand_multi_value_flags

    args = ["--served-model-name", "a", "MODEL"]  # MODEL is the positional here, not a second name
    assert expand_multi_value_flags(args) == args
    assert expand_multi_value_flags(["M", "--api-key", "x", "y", "--seed", "1"]) == \
        ["M", "--api-key", "x", "--api-key", "y", "--seed", "1"]


def test_server_flags(parse, tmp_path):
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    key.write_text("x")
    cert.write_text("y")
    _, s = parse("--uvicorn-log-level", "WARNING", "--allowed-origins", '["http://a.example", "http://b.example"]',
                 "--allowed-methods", "GET", "--allowed-headers", "X-Custom", "--allow-credentials",
                 "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", "/api",
                 "--generation-config", "vllm")
    assert (s.uvicorn_log_level, s.allowed_origins, s.allowed_methods, s.allowed_headers, s.allow_credentials,
            s.ssl_keyfile, s.ssl_certfile, s.root_path, s.generation_config) == (
        "warning", ['["http://a.example", "http://b.example"]'], ["GET"], ["X-Custom"], True, str(key), str(cert),
        "/api", "vllm")
    from appliance.server.api import cors_values

    assert cors_values(s.allowed_origins, []) == ["http://a.example", "http://b.example"]
    out = parse("--ssl-keyfile", str(key), expect_code=2)
    assert "--ssl-certfile" in out
    out = parse("--root-path", "api", expect_code=2)
    assert "--root-path" in out and "'api'" in out
    out = parse("--generation-config", "/some/dir", expect_code=2)
    assert "--generation-config" in out and "/some/dir" in out
    out = parse("--allowed-origins", "[not json", expect_code=2)
    assert "[not json" in out


def test_config_yaml(parse, tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max-model-len: 256\nmax_num_seqs: 3\nenable-prefix-caching: false\n"
                   "served-model-name: [x, y]\nnum-gpu-blocks-override: 40\nport: 9123\n"
                   "kv-cache-memory-bytes: 1G\n")
    engine, server = parse("--config", str(cfg))
    want_engine, want_server = parse("--max-model-len", "256", "--max-num-seqs", "3", "--no-prefix-caching",
                                     "--served-model-name", "x", "--served-model-name", "y", "--num-kv-blocks", "40",
                                     "--port", "9123", "--kv-cache-memory", "1")
    assert (engine, server) == (want_engine, want_server)
    # the command line wins over the file
    engine, server = parse("--config", str(cfg), "--max-num-seqs", "5", "--port", "9000")
    assert (engine.max_num_seqs, engine.max_model_len, server.port) == (5, 256, 9000)
    # a negative flag name as a key
    cfg.write_text("no-enable-prefix-caching: true\n")
    assert parse("--config", str(cfg))[0].enable_prefix_caching is False


def test_config_yaml_errors(parse, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("max-model-len: 256\nmax-modle-len: 5\n")
    out = parse("--config", str(cfg), expect_code=2)
    assert "unknown key 'max-modle-len'" in out
    cfg.write_text("max-model-len: lots\n")
    out = parse("--config", str(cfg), expect_code=2)
    assert "max-model-len" in out and "lots" in out
    cfg.write_text("- a\n- b\n")
    assert "mapping" in parse("--config", str(cfg), expect_code=2)
    assert "cannot read" in parse("--config", str(tmp_path / "none.yaml"), expect_code=2)


def test_vllm_env_vars(parse):
    engine, server = parse(env={"VLLM_API_KEY": "secret", "VLLM_CPU_KVCACHE_SPACE": "2",
                                "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    want_engine, want_server = parse("--api-key", "secret", "--kv-cache-memory", "2", "--omp-threads-bind", "nobind")
    assert (engine, server) == (want_engine, want_server)
    # flags win over the variables; our APPLIANCE_* names win over vLLM's
    engine, server = parse("--api-key", "mine", "--kv-cache-memory", "1",
                           env={"VLLM_API_KEY": "secret", "VLLM_CPU_KVCACHE_SPACE": "2"})
    assert (server.api_keys, engine.kv_cache_memory) == (["mine"], 1.0)
    engine, _ = parse(env={"APPLIANCE_KV_CACHE_MEMORY": "3", "VLLM_CPU_KVCACHE_SPACE": "2"})
    assert engine.kv_cache_memory == 3.0
    out = parse(env={"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}, expect_code=2)
    assert "VLLM_CPU_OMP_THREADS_BIND" in out and "0-1|2-3" in out


def test_vllm_reserved_cpus(parse):
    cores = len(threads.resolve("auto").cpus)
    if cores < 2:
        out = parse(env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, expect_code=2)
        assert "VLLM_CPU_NUM_OF_RESERVED_CPU" in out
        return
    engine, _ = parse(env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
    assert engine == parse("--num-threads", str(cores - 1))[0]
    # the reserved cores are the last of the placement: the engine keeps the first cores - 1
    assert threads.resolve(engine.omp_threads_bind, engine.num_threads).cpus == threads.resolve("auto").cpus[:-1]
    out = parse(env={"VLLM_CPU_NUM_OF_RESERVED_CPU": str(cores)}, expect_code=2)
    assert "leaves no core" in out


@pytest.mark.parametrize("flag, value, read", [
    ("itl-target", "250", lambda e, s: e.itl_target),
    ("max-model-len", "333", lambda e, s: e.max_model_len),
    ("runner", "pooling", lambda e, s: e.runner),
    ("served-model-name", "alias", lambda e, s: s.served_model_names),
    ("generation-config", "vllm", lambda e, s: s.generation_config),
])
def test_a_config_file_value_equals_the_flag(parse, tmp_path, flag, value, read):
    """serve() reads every parameter from one namespace that the file fills, so a value from the file
    gives exactly what the flag gives (for flags of several kinds, old and new)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"{flag}: {value}\n")
    assert read(*parse("--config", str(cfg))) == read(*parse(f"--{flag}", value))
    assert read(*parse("--config", str(cfg))) != read(*parse())

def test_dp_flags_and_per_replica_bind(parse):
    """-dp is --data-parallel-size; VLLM_CPU_OMP_THREADS_BIND's '|' lists are one per replica."""
    engine, _ = parse("-dp", "1", "--distributed-executor-backend", "mp")
    assert (engine.data_parallel_size, engine.distributed_executor_backend) == (1, "mp")
    cpus = sorted(threads.one_cpu_per_core(sorted(__import__("os").sched_getaffinity(0))))
    if len(cpus) >= 2:
        bind = f"{cpus[0]}|{cpus[1]}"
        engine, _ = parse("-dp", "2", env={"VLLM_CPU_OMP_THREADS_BIND": bind})
        want, _ = parse("--data-parallel-size", "2", "--omp-threads-bind", bind)
        assert engine == want and engine.data_parallel_size == 2 and engine.omp_threads_bind == bind
    out = parse("-dp", "3", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, expect_code=2)
    assert "VLLM_CPU_OMP_THREADS_BIND='0|1'" in out and "for 3 rank(s)" in out
    out = parse("-dp", "0", expect_code=2)
    assert "--data-parallel-size must be an integer >= 1, got 0" in out
