"""Fixtures for the runtime tests: the aarch64 cross tools, and real libgomp binaries fetched from the
registries once and cached under ``$APPLIANCE_CACHE_DIR/test-artifacts`` (default
``~/.cache/appliance/test-artifacts``) so reruns do not download again.

Only ``torch/lib/libgomp.so.1`` is kept from each torch wheel (2.13.0's is a 427 MB download, a few
seconds on CI's link; the wheel is deleted after extraction)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from arm_tools import ensure_arm_tools

REPO = Path(__file__).resolve().parents[2]


def artifact_dir() -> Path:
    base = os.environ.get("APPLIANCE_CACHE_DIR")
    d = (Path(base).expanduser() if base else Path.home() / ".cache" / "appliance") / "test-artifacts"
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def arm_tools() -> None:
    ensure_arm_tools()


def torch_wheel_libgomp(version: str) -> Path:
    """``torch/lib/libgomp.so.1`` of PyPI's torch==version aarch64 wheel (cached)."""
    out = artifact_dir() / f"torch-{version}-aarch64" / "libgomp.so.1"
    if out.is_file():
        return out
    dl = out.parent / "wheel"
    dl.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
                        "--python-version", "3.11", "--platform", "manylinux_2_28_aarch64", f"torch=={version}",
                        "-d", str(dl), "-q", "--disable-pip-version-check"], capture_output=True, text=True)
    wheels = list(dl.glob(f"torch-{version}-*.whl"))
    if r.returncode != 0 or not wheels:
        pytest.fail(f"pip download torch=={version} (aarch64) failed: {r.stderr[-1500:]}")
    with zipfile.ZipFile(wheels[0]) as z:
        names = [n for n in z.namelist() if n.startswith("torch/lib/libgomp") and ".so" in n]
        assert names, f"no torch/lib/libgomp*.so* in {wheels[0].name}"
        tmp = out.with_suffix(".part")
        tmp.write_bytes(z.read(sorted(names, key=len)[0]))
        tmp.rename(out)
    shutil.rmtree(dl)
    return out


def debian_cross_libgomp() -> Path:
    """libgomp.so.1 from Debian's ``libgomp1-arm64-cross`` .deb (apt-get download; cached)."""
    out = artifact_dir() / "libgomp1-arm64-cross" / "libgomp.so.1"
    if out.is_file():
        return out
    d = out.parent
    d.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["apt-get", "download", "-qq", "libgomp1-arm64-cross"], cwd=d, capture_output=True, text=True)
    debs = list(d.glob("libgomp1-arm64-cross_*.deb"))
    if not debs:
        installed = Path("/usr/aarch64-linux-gnu/lib/libgomp.so.1")
        if installed.is_file():  # the same package, installed with the cross toolchain
            return installed
        pytest.fail(f"apt-get download libgomp1-arm64-cross failed: {r.stderr[-1500:]}")
    subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(d / "x")], check=True)
    lib = next((d / "x").rglob("libgomp.so.1.*"))
    shutil.copy2(lib, out)
    shutil.rmtree(d / "x")
    return out


@pytest.fixture(scope="session")
def lse_libgomp(arm_tools) -> Path:
    """The project's own build (openmp/build_libgomp.sh), into the artifact cache."""
    prefix = artifact_dir() / "libgomp-lse"
    lib = prefix / "lib" / "libgomp.so.1"
    if not lib.is_file():
        r = subprocess.run(["bash", str(REPO / "openmp" / "build_libgomp.sh"), "--prefix", str(prefix)],
                           capture_output=True, text=True, env=dict(os.environ, PYTHON=sys.executable), timeout=900)
        if r.returncode != 0 or not lib.is_file():
            pytest.fail(f"openmp/build_libgomp.sh failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return lib
