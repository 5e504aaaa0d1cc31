"""The variant machinery: choice from CPU features, env override, forcing, facade fallback."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from appliance.ops import get_ops, native, reference

PY_PROBE = "from appliance.ops import native; print(native.kernel_variant())"


def cpu_flags() -> set[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def test_available_variants_follow_cpu_features():
    names = native.available_variants()
    assert names[-1] == "generic"
    assert native.kernel_variant() in names
    flags = cpu_flags()
    import platform
    if platform.machine() == "x86_64":
        assert ("avx2" in names) == ({"avx2", "fma"} <= flags)
        assert ("avx512" in names) == ({"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags)
        assert ("avx512bf16" in names) == ("avx512_bf16" in flags and "avx512" in names)
        assert not {"neon", "neon_bf16", "sve"} & set(names)
    elif platform.machine() == "aarch64":
        assert ("sve" in names) == ("sve" in flags)
        assert ("neon_bf16" in names) == ("bf16" in flags)
    # Without an override the best (first) variant is the one in use.
    if not os.environ.get("APPLIANCE_KERNELS"):
        out = subprocess.run([sys.executable, "-c", PY_PROBE], capture_output=True, text=True,
                             env={k: v for k, v in os.environ.items() if k != "APPLIANCE_KERNELS"})
        assert out.stdout.strip() == names[0], out.stderr


@pytest.mark.parametrize("name", ["generic", "bogus"])
def test_env_override(name):
    env = dict(os.environ, APPLIANCE_KERNELS=name, APPLIANCE_KERNELS_LOG="1")
    out = subprocess.run([sys.executable, "-c", PY_PROBE], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    if name == "generic":
        assert out.stdout.strip() == "generic"
        assert "generic selected" in out.stderr
    else:  # unknown: says so, names the choices, keeps the best
        assert out.stdout.strip() == native.available_variants()[0]
        assert "APPLIANCE_KERNELS=bogus" in out.stderr


def test_force_each_variant_and_unknown():
    for name in native.available_variants():
        with native.use_variant(name):
            assert native.kernel_variant() == name
    with pytest.raises(ValueError, match="not available"):
        native.set_variant("no_such_variant")


def test_get_ops_picks_native():
    assert get_ops("native") is native
    assert get_ops("auto") is native
    assert get_ops("reference") is reference


def test_same_api_as_reference():
    import inspect
    for name in ["kv_cache_shape", "reshape_and_cache", "paged_attention", "rms_norm",
                 "fused_add_rms_norm", "rotary_cos_sin_cache", "rotary_embedding", "silu_and_mul",
                 "softmax_scale"]:
        ref_sig = inspect.signature(getattr(reference, name))
        nat_sig = inspect.signature(getattr(native, name))
        assert list(ref_sig.parameters) == list(nat_sig.parameters), name
    assert native.kv_cache_shape(3, 16, 2, 64) == reference.kv_cache_shape(3, 16, 2, 64)


def test_fallbacks_for_uncovered_cases():
    x = torch.randn(4, 64).half()
    w = torch.ones(64).half()
    torch.testing.assert_close(native.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(native.silu_and_mul(x), reference.silu_and_mul(x))


def test_x86_baseline_code_has_no_wider_isa():
    """Inline helpers and templates must not leak AVX/AVX512 code into the generic and avx2
    variants (kernel_common.h is included before each variant's target pragma for this reason):
    a CPU without AVX512 runs those, so their instructions must be within their ISA."""
    import platform
    import re
    import shutil

    if platform.machine() != "x86_64":
        pytest.skip("x86-64 disassembly check")
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils) is needed for this check"
    so = native.build_dir() / f"{native.EXTENSION_NAME}.so"
    text = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", str(so)],
                          capture_output=True, text=True, check=True).stdout
    funcs = re.split(r"\n(?=[0-9a-f]+ <)", text)
    checked = 0
    for f in funcs:
        head = f.split("\n", 1)[0]
        if "appliance_kernels::generic::" in head:
            assert not re.search(r"%[yz]mm", f), head
            checked += 1
        elif "appliance_kernels::avx2::" in head:
            assert "%zmm" not in f, head
            checked += 1
    assert checked > 10
