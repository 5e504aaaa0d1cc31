"""Every linear backend is offered only where it computes correctly: the oneDNN int8 saturation on
x86 without VNNI (the cause proven, the backend withdrawn and refused by name), the bf16 refusal
on CPUs without native bf16, and `auto` never choosing a withdrawn backend."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch
from helpers import refusal_reason

from appliance import LLM
from appliance.layers import linear, quant
from appliance.runtime.cpu_features import detect

X86 = platform.machine().lower() in ("x86_64", "amd64")
# oneDNN's ISA names in increasing order (ONEDNN_MAX_CPU_ISA takes one of them, or ALL)
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
               "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
               "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "ALL")


def _onednn_allows(isa: str) -> bool:
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return cap not in ONEDNN_ISAS or ONEDNN_ISAS.index(cap) >= ONEDNN_ISAS.index(isa)


def _int8_dot_exact_expected() -> bool:
    """From the CPU flags and oneDNN's cap alone: can oneDNN use an int8 dot product that sums into int32?"""
    if not X86:
        return True  # Arm: s8 x s8 (SDOT, SMMLA) into int32
    f = detect()
    return ((f.has("avx512_vnni") and _onednn_allows("AVX512_CORE_VNNI"))
            or (f.has("avx_vnni") and _onednn_allows("AVX2_VNNI"))
            or (f.has("amx_int8") and _onednn_allows("AVX512_CORE_AMX")))


def _raw_int8_gemm(xu: int, w: int, k: int = 256) -> float:
    """oneDNN's integer GEMM of a row of u8 ``xu`` (s8 ``xu - 128`` on Arm) by weights all ``w``, no
    scales or zero points: exactly ``k * x * w`` when it sums into int32."""
    qw = torch.full((16, k), w, dtype=torch.int8)
    packed = torch.ops.onednn.qlinear_prepack(qw, None)
    if X86:
        x, zp = torch.full((1, k), xu, dtype=torch.uint8), 0
    else:
        x, zp = torch.full((1, k), xu - 128, dtype=torch.int8), 0
    y = torch.ops.onednn.qlinear_pointwise(x, 1.0, zp, packed, torch.ones(16), torch.zeros(16, dtype=torch.int64),
                                           None, 1.0, 0, torch.float32, "none", [], "")
    return y[0, 0].item()


def test_onednn_int8_probe_agrees_with_cpu_flags_and_cap():
    """The probe that withdraws w8a8_onednn finds a problem exactly where the CPU flags and
    ONEDNN_MAX_CPU_ISA say oneDNN has no VNNI-class int8 dot product."""
    problem = quant.onednn_int8_problem()
    assert (problem is None) == _int8_dot_exact_expected(), problem


@pytest.mark.skipif(not X86, reason="x86 only: Arm oneDNN (ACL) takes s8 activations into int32 dot products")
def test_the_cause_is_int16_pair_saturation():
    """Why w8a8_onednn was wrong on AVX2 hosts: each pair of u8 x s8 products is summed into a
    saturating int16 (VPMADDUBSW). 255 * 127 * 2 = 64770 clips to 32767 per pair, so k inputs give
    exactly k/2 * 32767; -64770 clips to -32768; a pair that fits (127 * 127 * 2 = 32258) is exact.
    With VNNI every one of these is exact."""
    k = 256
    if quant.onednn_int8_problem() is None:
        assert _raw_int8_gemm(255, 127, k) == k * 255 * 127
        assert _raw_int8_gemm(255, -127, k) == -k * 255 * 127
        return
    assert _raw_int8_gemm(255, 127, k) == k // 2 * 32767
    assert _raw_int8_gemm(255, -127, k) == k // 2 * -32768
    assert _raw_int8_gemm(127, 127, k) == k * 127 * 127
    assert _raw_int8_gemm(255, 64, k) == k * 255 * 64  # 2 * 255 * 64 = 32640 fits
    assert _raw_int8_gemm(255, 65, k) == k // 2 * 32767  # 2 * 255 * 65 = 33150 does not


@pytest.fixture
def without_vnni(monkeypatch):
    """This host as one whose oneDNN has no exact int8 dot product (what an AVX2 host is)."""
    why = "oneDNN's int8 GEMM is not exact on this CPU (test stand-in): It needs AVX512-VNNI, AVX-VNNI or AMX"
    monkeypatch.setattr(quant, "onednn_int8_problem", lambda: why)
    return why


def test_withdrawn_backend_is_never_a_candidate(without_vnni):
    lin = linear.Linear(576, 960)
    lin.weight.data = torch.randn(960, 576)
    q = quant.QuantLinear.from_float(lin, "w8a8", None)
    cands = q.candidates(torch.float32, torch.device("cpu"))
    assert "w8a8_onednn" not in cands and "w8a16_int8pack" in cands


def test_auto_never_picks_a_withdrawn_backend_even_from_the_cache(without_vnni, tiny_model_dir, tmp_path, monkeypatch):
    """A choice cached when the backend was valid (another cap, another torch) is measured again."""
    import json

    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path))
    d = tiny_model_dir("llama")
    llm = LLM(str(d), dtype="float32", quantization="w8a8", num_kv_blocks=32)
    chosen = llm.engine.runner.linear_backends
    assert "w8a8_onednn" not in chosen.values()
    cache = tmp_path / "linear_backends.json"
    entries = json.loads(cache.read_text())
    poisoned = {k: ("w8a8_onednn" if "w8a8" in k else v) for k, v in entries.items()}
    cache.write_text(json.dumps(poisoned))
    llm2 = LLM(str(d), dtype="float32", quantization="w8a8", num_kv_blocks=32)
    assert "w8a8_onednn" not in llm2.engine.runner.linear_backends.values()


def test_named_withdrawn_backend_is_refused_with_the_feature_and_alternatives(without_vnni, tiny_model_dir):
    with pytest.raises(ValueError) as e:
        LLM(str(tiny_model_dir("llama")), dtype="float32", quantization="w8a8", linear_backend="w8a8_onednn",
            num_kv_blocks=32)
    msg = str(e.value)
    assert "linear_backend=w8a8_onednn" in msg and "AVX512-VNNI" in msg and without_vnni in msg
    assert "Available here: " in msg and "w8a8_native" in msg.split("Available here: ")[1]


def test_bf16_onednn_refused_where_the_cpu_lacks_bf16(tiny_model_dir):
    """oneDNN's bf16 GEMM runs where the CPU computes bf16; elsewhere asking for it is refused, naming
    the feature (on this host: the one the running CPU has or lacks)."""
    has = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    why = refusal_reason("onednn", torch.bfloat16)
    assert (why is None) == has
    if why is not None:
        assert "AVX512-BF16" in why and "BF16" in why
        with pytest.raises(ValueError, match="linear_backend=onednn .*AVX512-BF16"):
            LLM(str(tiny_model_dir("qwen2", False, 2)), dtype="bfloat16", linear_backend="onednn", num_kv_blocks=32)


def test_cli_refuses_a_backend_missing_here_at_start(tiny_model_dir, tmp_path):
    """`appliance generate --linear-backend X` for an X this host cannot run: exit 2 before serving,
    the message naming X, what it needs and what is available. Uses a backend missing on every host:
    native with bfloat16 weights."""
    r = subprocess.run([sys.executable, "-m", "appliance.cli", "generate", "--model", str(tiny_model_dir("llama")),
                        "--prompt", "hi", "--max-tokens", "2", "--dtype", "bfloat16", "--linear-backend", "native"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    err = " ".join(r.stderr.split())
    assert "linear_backend=native" in err and "float32" in err and "Available here: " in err, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def test_doctor_reports_every_backend_with_its_reason():
    from appliance.doctor import doctor_report

    r = doctor_report()["linear_backends"]
    assert set(quant.QUANT_BACKENDS) <= set(r) and {"torch", "onednn", "native", "onednn:bfloat16"} <= set(r)
    assert r["w8a8_onednn"]["available"] == (quant.onednn_int8_problem() is None)
    assert r["w8a8_onednn"]["reason"] == quant.onednn_int8_problem()
    assert r["onednn:bfloat16"]["available"] == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    # the bf16 panel GEMM is checked for the dtype it runs (bfloat16), wherever the native kernels are built
    assert r["native_bf16"]["dtype"] == "bfloat16" and r["native_bf16"]["available"] == r["native"]["available"]
