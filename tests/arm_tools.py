"""The emulated-Arm tooling of the tests, all from scripts/arm64/ (nothing outside the repository):
the aarch64 cross toolchain and qemu (setup.sh, installed on first use), and the Debian arm64 root
with torch's aarch64 CPU wheel (rootfs.sh) in which the appliance itself runs under qemu.

The root is opt-in per run: ``APPLIANCE_ARM64_ROOTFS=DIR`` points at it (``make test`` sets
``~/.cache/appliance/arm64-rootfs``), and ``APPLIANCE_ARM64_BUILD_ROOTFS=1`` lets the tests build it
there when missing or when its recipe changed (~10 minutes on 2 cores the first time, cached after)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARM64_SCRIPTS = REPO / "scripts" / "arm64"
TOOLS = ("aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++", "aarch64-linux-gnu-objdump", "qemu-aarch64-static")
# run.sh's profiles: name -> qemu -cpu
QEMU_CPU = {"v2": "max,sve128=on", "v1": "max,sve256=on", "n1": "neoverse-n1", "max": "max"}
ROOTFS_ENV, BUILD_ENV = "APPLIANCE_ARM64_ROOTFS", "APPLIANCE_ARM64_BUILD_ROOTFS"
# The environment of programs in the root: nothing of the host's (its PYTHONPATH, LD_PRELOAD,
# APPLIANCE_CACHE_DIR, ...) leaks in.
ROOT_PATH = "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def missing() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def ensure_arm_tools() -> None:
    """Install the tools if any is missing (needs root); fail the test with the output if not."""
    if not missing():
        return
    r = subprocess.run(["bash", str(ARM64_SCRIPTS / "setup.sh")], capture_output=True, text=True)
    if missing():
        pytest.fail(f"could not install the Arm cross tools {missing()} with scripts/arm64/setup.sh: "
                    f"{r.stdout[-2000:]}{r.stderr[-2000:]}")


_root_state: dict = {}


def arm64_root() -> Path:
    """The arm64 root (built or refreshed by rootfs.sh when allowed), with this checkout's appliance
    installed in it (install_appliance.py: sources copied, native kernels cross-built). Skips when
    no root was asked for. Once per test session."""
    if "root" in _root_state:
        return _root_state["root"]
    if "error" in _root_state:
        pytest.fail(_root_state["error"])
    where = os.environ.get(ROOTFS_ENV)
    if not where:
        pytest.skip(f"opt-in: set {ROOTFS_ENV}=DIR (an arm64 root from scripts/arm64/rootfs.sh, ~10 min to "
                    f"build; {BUILD_ENV}=1 builds it there) - `make test` does both")
    root = Path(where).expanduser()

    def fail(msg: str):
        _root_state["error"] = msg
        pytest.fail(msg)

    if os.geteuid() != 0:
        fail("the arm64 root is entered with chroot, which needs root")
    if os.environ.get(BUILD_ENV) != "1" and not (root / "opt/venv/bin/python").exists():
        fail(f"{root}: no arm64 root there; build it with scripts/arm64/rootfs.sh {root} or set {BUILD_ENV}=1")
    ensure_arm_tools()
    t0 = time.monotonic()
    # Builds what is missing or stale (its recipe changed); otherwise checks in a few seconds.
    r = subprocess.run(["bash", str(ARM64_SCRIPTS / "rootfs.sh"), str(root)], capture_output=True, text=True,
                       timeout=3600, env=dict(os.environ, PYTHON=sys.executable))
    if r.returncode != 0:
        fail(f"scripts/arm64/rootfs.sh {root} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    t1 = time.monotonic()
    r = subprocess.run([sys.executable, str(ARM64_SCRIPTS / "install_appliance.py"), str(root)],
                       capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        fail(f"scripts/arm64/install_appliance.py failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    info = json.loads(r.stdout.strip().splitlines()[-1])
    _root_state.update(root=root, install=info, seconds={"rootfs": round(t1 - t0, 1), "install": info["seconds"]})
    print(f"\narm64 root {root}: rootfs.sh {t1 - t0:.0f} s, install + native cross build {info['seconds']:.0f} s",
          file=sys.stderr)
    return root


def root_env(**extra: str) -> dict[str, str]:
    """The environment of a program in the root: the appliance's sources and its cache there."""
    info = _root_state["install"]
    env = {"PATH": ROOT_PATH, "HOME": "/root", "LANG": "C.UTF-8", "PYTHONPATH": info["pythonpath"],
           "APPLIANCE_CACHE_DIR": info["cache_dir"], "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    env.update(extra)
    return env


def root_cmd(profile: str, *argv: str) -> list[str]:
    """argv of a command that runs ``argv`` in the root under qemu as ``profile`` (run.sh --root)."""
    return ["bash", str(ARM64_SCRIPTS / "run.sh"), "--cpu", profile, "--root", str(_root_state["root"]), *argv]


def run_in_root(profile: str, *argv: str, timeout: float = 1200, env: dict | None = None
                ) -> subprocess.CompletedProcess:
    """Run ``argv`` in the root as ``profile``; stdout and stderr in one stream (``.stdout``)."""
    t0 = time.monotonic()
    r = subprocess.run(root_cmd(profile, *argv), env=root_env(**(env or {})), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=timeout)
    r.seconds = time.monotonic() - t0  # type: ignore[attr-defined]
    return r
