"""The kernel, linear and model-quality tests again with the ISA capped, so that a host with more
than another host class cannot hide that class's bug (as an AVX512-VNNI host hid oneDNN's int8
saturation on AVX2-only ones). Each cap caps all three dispatchers at once:

- the native kernels' dispatcher (``APPLIANCE_KERNELS``),
- oneDNN (``ONEDNN_MAX_CPU_ISA``: AVX2 has no VNNI; AVX512_CORE is AVX512 without VNNI or BF16),
- ATen's vectorized kernels (``ATEN_CPU_CAPABILITY``: the int4/int8 weight-only kernels, elementwise ops).

Every cap runs the tests below in a fresh process (the caps are read once, at library load) and the
run must pass whole. A cap above what this host has would be the uncapped run again: it is skipped,
saying so. The generic cap leaves out the default-model quality test: the portable kernels take
many minutes over its 2000-token text, and what it checks of the ops is covered by the kernel tests
and the tiny-model parity tests that do run there.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.runtime.cpu_features import detect

REPO = Path(__file__).resolve().parents[2]
KERNEL_AND_LINEAR = ["tests/ops", "tests/quant/test_kernels.py", "tests/quant/test_host_support.py",
                     "tests/quant/test_checkpoints.py", "tests/quant/test_gguf_direct.py",
                     "tests/unit/test_backend_choice.py", "tests/model/test_parity.py",
                     "tests/model/test_gemma_fused.py",
                     "tests/model/test_kv_cache_dtype.py", "tests/model/test_fused_kv_cache_dtype.py",
                     "tests/quant/test_lowbit_native.py",
                     # native float32: the panel kernel at decode rows, torch's batched GEMM over its panels above
                     "tests/model/test_native_prefill_rows.py",
                     "tests/unit/test_linear_methods.py::test_native_f32_takes_prefill_rows_through_a_batched_gemm_over_its_panels",
                     "tests/unit/test_linear_methods.py::test_native_f32_silu_mul_above_the_kernel_rows_matches_the_reference",
                     "tests/quant/test_kquant_scales.py",
                     # K-quant packs of tensor-parallel ranks (finer super-blocks where a rank cuts one)
                     "tests/distributed/test_tp_kquant.py",
                     # the MoE models through ops.moe_experts (the kernels' moe_f32 and every expert kind)
                     "tests/model/test_moe.py::test_greedy_and_logits_match_transformers",
                     "tests/model/test_moe.py::test_quantized_moe_model_in_the_engine",
                     # quantized experts in one region (the kernels' moe_q) against the per-expert path
                     "tests/model/test_moe.py::test_quantized_experts_one_region_gives_the_per_expert_tokens",
                     # a Q4_K_M-style MoE GGUF: K-quant experts in moe_q's one region, tokens as transformers'
                     "tests/model/test_moe.py::test_moe_gguf_kquant_experts_run_in_one_region",
                     # GGUF experts as stored (Q5_0: 5-bit tiles through moe_q)
                     "tests/model/test_moe.py::test_moe_gguf_quantized_experts_load_as_they_are"]

QUALITY = ["tests/quant/test_default_model_quality.py"]
X86 = platform.machine().lower() in ("x86_64", "amd64")

# cap -> (environment, what the host needs for the cap to mean anything, tests)
CAPS = {
    "avx2": ({"APPLIANCE_KERNELS": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
             ("avx2", "fma"), KERNEL_AND_LINEAR + QUALITY),
    "avx512_core": ({"APPLIANCE_KERNELS": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
                     "ATEN_CPU_CAPABILITY": "avx512"},
                    ("avx512f", "avx512bw", "avx512vl", "avx512dq"), KERNEL_AND_LINEAR + QUALITY),
    "generic": ({"APPLIANCE_KERNELS": "generic", "ONEDNN_MAX_CPU_ISA": "SSE41", "ATEN_CPU_CAPABILITY": "default"},
                (), KERNEL_AND_LINEAR),
}


def _capped_env(env: dict) -> dict:
    out = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    out.update(env)
    return out


def _in_force(env: dict) -> dict:
    """What the capped process really runs: the native variant, ATen's capability, and whether
    oneDNN's int8 GEMM is exact (it is not below VNNI)."""
    code = ("import json, torch; from appliance.ops import native; from appliance.layers import quant;"
            "print(json.dumps({'kernels': native.kernel_variant() if native.is_available() else None,"
            "'aten': torch.backends.cpu.get_cpu_capability(), 'int8_exact': quant.onednn_int8_problem() is None}))")
    r = subprocess.run([sys.executable, "-c", code], env=_capped_env(env), capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cap", list(CAPS))
def test_suite_passes_with_isa_capped(cap):
    env, needs, tests = CAPS[cap]
    if not X86:
        pytest.skip(f"the {cap} cap is an x86 ISA; on {platform.machine()} the Arm variants are proven under "
                    "qemu (tests/arm64)")
    missing = [f for f in needs if not detect().has(f)]
    if missing:
        pytest.skip(f"this host lacks {', '.join(missing)}: the {cap} cap would be the uncapped run")
    state = _in_force(env)
    assert state["kernels"] == env["APPLIANCE_KERNELS"], state
    assert state["aten"].lower() == env["ATEN_CPU_CAPABILITY"], state
    assert state["int8_exact"] is False, f"oneDNN below VNNI must fail the int8 probe: {state}"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *tests],
                       env=_capped_env(env), capture_output=True, text=True, timeout=2400, cwd=REPO)
    tail = "\n".join(r.stdout.splitlines()[-40:])
    print(f"--- {cap} cap ({' '.join(f'{k}={v}' for k, v in env.items())}):\n{tail}")
    assert r.returncode == 0, f"tests failed with the {cap} cap:\n{r.stdout[-8000:]}\n{r.stderr[-2000:]}"
    assert " passed" in tail and " failed" not in tail, tail
