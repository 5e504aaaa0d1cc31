"""The aarch64 cross toolchain and qemu for the emulated-Arm tests, installed on first use."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

TOOLS = ("aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++", "aarch64-linux-gnu-objdump", "qemu-aarch64-static")
# In CI shared/ sits beside the clone; its setup.sh apt-gets the same packages.
SHARED_ARM64 = Path(__file__).resolve().parents[1].parent / "shared" / "arm64"


def missing() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def ensure_arm_tools() -> None:
    """Install the tools if any is missing (needs root); fail the test with apt's output if not."""
    if not missing():
        return
    setup = SHARED_ARM64 / "setup.sh"
    if setup.exists():
        r = subprocess.run(["bash", str(setup)], capture_output=True, text=True)
    else:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        r = subprocess.run("apt-get update -qq && apt-get install -y -qq g++-aarch64-linux-gnu "
                           "binutils-aarch64-linux-gnu qemu-user-static", shell=True, env=env,
                           capture_output=True, text=True)
    if missing():
        pytest.fail(f"could not install the Arm cross tools {missing()}: {r.stdout[-2000:]}{r.stderr[-2000:]}")
