"""Under emulated Arm (Neoverse V2 profile: SVE 128, BF16, I8MM), the W4A8 layers run through
KleidiAI and the W8A8 and prepacked float layers through non-reference oneDNN kernels, each matching
its fp64 reference. tests/quant/arm_probe.py runs inside a Debian arm64 root with torch 2.10.0's
aarch64 CPU wheel (../shared/arm64/rootfs.sh); ONEDNN_VERBOSE=1 names the kernels oneDNN ran.

Opt-in: building the root debootstraps Debian arm64 and installs the torch wheel under qemu, about
10 minutes on a 2-core host (measured 2026-11-30: 15:44 -> 15:54), needing root, binfmt_misc and the
Debian and PyPI registries. Point APPLIANCE_ARM64_ROOTFS at a built root (the probe itself then
takes ~10 s), or also set APPLIANCE_ARM64_BUILD_ROOTFS=1 to build it there first."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTFS_SH = REPO.parent / "shared" / "arm64" / "rootfs.sh"
ROOT = os.environ.get("APPLIANCE_ARM64_ROOTFS")
V2 = "max,sve128=on"

pytestmark = pytest.mark.skipif(
    not ROOT, reason="opt-in: set APPLIANCE_ARM64_ROOTFS=DIR (an arm64 root from ../shared/arm64/rootfs.sh, "
                     "~10 min to build; APPLIANCE_ARM64_BUILD_ROOTFS=1 builds it)")


@pytest.fixture(scope="module")
def probe():
    root = Path(ROOT)
    if os.geteuid() != 0:
        pytest.fail("the arm64 root is entered with chroot, which needs root")
    if not (root / "opt/venv/bin/python").exists() and os.environ.get("APPLIANCE_ARM64_BUILD_ROOTFS") != "1":
        pytest.fail(f"{root}: no arm64 root there; build it with {ROOTFS_SH} {root} "
                    f"or set APPLIANCE_ARM64_BUILD_ROOTFS=1")
    # builds when missing; otherwise only registers binfmt_misc and mounts /proc, /sys, /dev (seconds)
    subprocess.run(["bash", str(ROOTFS_SH), str(root)], check=True, capture_output=True, timeout=3600)
    src = root / "opt" / "appliance_src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(REPO / "appliance", src / "appliance", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(Path(__file__).parent / "arm_probe.py", src / "arm_probe.py")
    env = dict(os.environ, QEMU_CPU=V2, ONEDNN_VERBOSE="1", OMP_NUM_THREADS="2", PYTHONPATH="/opt/appliance_src")
    # one stream, so oneDNN's verbose lines (stdout) fall between the probe's markers (stderr)
    r = subprocess.run(["chroot", str(root), "/bin/sh", "-c", "/opt/venv/bin/python /opt/appliance_src/arm_probe.py 2>&1"],
                       env=env, capture_output=True, text=True, timeout=900, check=False)
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
