"""--device resolution and the CUDA KV-cache budget (--gpu-memory-utilization), on any machine: the
GPU's answers are passed in."""
from __future__ import annotations

import pytest
import torch

from appliance.config import EngineConfig
from appliance.engine.device import (activation_reserve_bytes, check_dtype_on_device, gpu_kv_budget_bytes,
                                     resolve_device)
from appliance.errors import InvalidRequestError
from appliance.ops import get_ops, reference

GiB = 1 << 30


def test_auto_follows_cuda_availability():
    assert resolve_device("auto", cuda_available=True) == torch.device("cuda")
    assert resolve_device("auto", cuda_available=False) == torch.device("cpu")
    assert resolve_device("cpu", cuda_available=True) == torch.device("cpu")
    assert resolve_device("cuda", cuda_available=True) == torch.device("cuda")


def test_cuda_without_gpu_is_refused_naming_the_flag_and_torchs_findings():
    with pytest.raises(InvalidRequestError, match=r"--device cuda: no usable CUDA GPU: torch ") as e:
        resolve_device("cuda", cuda_available=False)
    assert e.value.args[0].count(torch.__version__) == 1


def test_engine_refuses_cuda_at_start_without_gpu(llama_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has a usable GPU: --device cuda is accepted here")
    from appliance import LLM

    with pytest.raises(InvalidRequestError, match="--device cuda"):
        LLM(str(llama_dir), device="cuda", num_kv_blocks=8)


@pytest.mark.parametrize("field,value", [("device", "tpu"), ("gpu_memory_utilization", 0.0),
                                         ("gpu_memory_utilization", 1.5)])
def test_config_refuses_bad_values(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        EngineConfig(**{field: value})


def test_gpu_budget_is_utilization_of_total_minus_used_and_reserve():
    total, free = 140 * GiB, 120 * GiB  # 20 GiB in use (weights, other processes)
    assert gpu_kv_budget_bytes(free, total, 0.9, GiB) == int(0.9 * total) - 20 * GiB - GiB
    assert gpu_kv_budget_bytes(free, total, 0.5, 0) == 70 * GiB - 20 * GiB
    with pytest.raises(InvalidRequestError, match=r"gpu_memory_utilization=0.1 .*leaves no KV cache"):
        gpu_kv_budget_bytes(free, total, 0.1, 0)


def test_activation_reserve_grows_with_the_step_budget():
    a = activation_reserve_bytes(896, 4864, 1152, 151936, 2048, 256)
    b = activation_reserve_bytes(896, 4864, 1152, 151936, 4096, 256)
    assert b - a == 4 * 2048 * (3 * 896 + 1152 + 3 * 4864)
    assert a > 4 * 3 * 256 * 151936  # the sampled rows' logits alone


def test_ops_on_a_cuda_device():
    pytest.importorskip("triton", reason="triton is not installed (pip install -e .[test])")
    assert get_ops("auto", "cuda").__name__ == "appliance.ops.cuda_ops"
    assert get_ops("reference", "cuda") is reference
    with pytest.raises(RuntimeError, match="--attention-backend native"):
        get_ops("native", "cuda")


def test_cuda_ops_on_cpu_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="--attention-backend cuda on device cpu"):
        get_ops("cuda", "cpu")


def test_serve_flags_reach_the_engine_config(monkeypatch):
    from typer.testing import CliRunner

    import appliance.server.launcher as launcher
    from appliance.cli import app

    seen = {}

    def fake_serve(engine_config, server_config):
        seen["c"] = engine_config
        return 0

    monkeypatch.setattr(launcher, "serve", fake_serve)
    for k in ("APPLIANCE_DEVICE", "APPLIANCE_GPU_MEMORY_UTILIZATION", "APPLIANCE_ENFORCE_EAGER"):
        monkeypatch.delenv(k, raising=False)
    r = CliRunner().invoke(app, ["serve", "/some/model", "--device", "auto", "--gpu-memory-utilization", "0.5",
                                 "--enforce-eager"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    c = seen["c"]
    assert (c.device, c.gpu_memory_utilization, c.enforce_eager) == ("auto", 0.5, True)
    seen.clear()
    r = CliRunner().invoke(app, ["serve", "/some/model"], catch_exceptions=False)
    assert (seen["c"].device, seen["c"].gpu_memory_utilization, seen["c"].enforce_eager) == ("cpu", 0.9, False)
    r = CliRunner().invoke(app, ["serve", "/some/model", "--gpu-memory-utilization", "2"], catch_exceptions=False)
    assert r.exit_code == 2 and "gpu_memory_utilization" in r.output


def test_auto_dtype_on_cuda_follows_the_gpu(monkeypatch):
    from appliance.engine.llm_engine import resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_dtype("float32", torch.device("cuda")) is torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", torch.device("cuda")) is torch.float32


def test_bfloat16_refused_on_a_gpu_without_it():
    cuda = torch.device("cuda")
    with pytest.raises(InvalidRequestError, match="dtype bfloat16: .* cannot run bfloat16; use --dtype float32"):
        check_dtype_on_device(torch.bfloat16, cuda, bf16_supported=False)
    check_dtype_on_device(torch.bfloat16, cuda, bf16_supported=True)
    check_dtype_on_device(torch.float32, cuda, bf16_supported=False)
    check_dtype_on_device(torch.bfloat16, torch.device("cpu"), bf16_supported=False)  # the CPU: not this check
