"""Under emulated Arm (Neoverse V2 profile: SVE 128, BF16, I8MM), the W4A8 layers run through
KleidiAI and the W8A8 and prepacked float layers through non-reference oneDNN kernels, each matching
its fp64 reference. tests/quant/arm_probe.py runs inside the Debian arm64 root with torch 2.10.0's
aarch64 CPU wheel (scripts/arm64/rootfs.sh, see tests/arm_tools.py); ONEDNN_VERBOSE=1 names the
kernels oneDNN ran.

Opt-in: APPLIANCE_ARM64_ROOTFS=DIR points at the root (``make test`` sets it, and
APPLIANCE_ARM64_BUILD_ROOTFS=1 to build it there first: about 10 minutes on a 2-core host, needing root,
binfmt_misc and the Debian and PyPI registries). The probe itself then takes ~10 s."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from arm_tools import arm64_root, run_in_root


@pytest.fixture(scope="module")
def probe():
    arm64_root()
    source = (Path(__file__).parent / "arm_probe.py").read_text()
    # one stream, so oneDNN's verbose lines (stdout) fall between the probe's markers (stderr)
    r = run_in_root("v2", "/opt/venv/bin/python", "-c", source, timeout=900,
                    env={"ONEDNN_VERBOSE": "1", "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stdout[-4000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    return result, r.stdout


def _section(log: str, name: str) -> list[str]:
    m = re.search(rf"=== {re.escape(name)} begin\n(.*?)=== {re.escape(name)} end", log, re.DOTALL)
    assert m, f"no {name} section in the probe's output"
    return [line for line in m.group(1).splitlines() if line.startswith("onednn_verbose") and ",exec," in line]


def test_runs_on_arm_with_kleidiai(probe):
    result, _ = probe
    assert result["machine"] == "aarch64" and result["kleidiai"], result


def test_every_backend_matches_its_reference(probe):
    result, _ = probe
    assert result["checks"] and all(c["ok"] for c in result["checks"].values()), result["checks"]


def test_w4a8_runs_through_kleidiai(probe):
    result, _ = probe
    # KleidiAI packs into its own uint8 layout; torch's non-KleidiAI fallback packs fp32
    for name in ("w4a8_dynquant_g32", "w4a8_dynquant_g256"):
        assert result["checks"][name]["packed_dtype"] == "torch.uint8", result["checks"][name]


@pytest.mark.parametrize("section,primitive,src", [("w8a8_onednn gNone", "matmul", "src:s8"),
                                                   ("onednn_f32", "inner_product", "src:f32")])
def test_onednn_paths_are_not_reference_kernels(probe, section, primitive, src):
    _, log = probe
    lines = [line for line in _section(log, section) if f",{primitive}," in line and src in line]
    assert lines, f"no oneDNN {primitive} with {src} ran in {section}:\n" + "\n".join(_section(log, section))
    for line in lines:
        impl = line.split(",")[6]  # onednn_verbose,v1,primitive,exec,cpu,<primitive>,<implementation>
        assert "ref" not in impl, line
