#!/usr/bin/env bash
# Builds libgomp with inline LSE atomics (-march=armv8.2-a, no outline-atomics helpers) from GCC's
# sources as Debian ships them (source package gcc-12, upstream 12.2.0), for aarch64.
#   openmp/build_libgomp.sh [--prefix DIR] [--march ARCH] [--native]
#     --prefix  where lib/libgomp.so.1 goes (default ~/.cache/appliance/libgomp-lse)
#     --march   default armv8.2-a (every Neoverse; LSE is part of v8.1+)
#     --native  compile with the host's gcc (on an aarch64 host / in the arm64 image);
#               default: cross-compile with aarch64-linux-gnu-gcc (scripts/arm64/setup.sh installs it)
# Only libgomp is built (about 15 s on 2 cores), configured on its own against the compiler we
# have; the rest of GCC is not. The result is checked with the project's classifier.
# Needs: apt-get (root) for the source package (a deb-src entry is added if none exists), xz, make.
set -euo pipefail
prefix="${HOME}/.cache/appliance/libgomp-lse"
march="armv8.2-a"
cc="aarch64-linux-gnu-gcc"
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix="$2"; shift 2 ;;
    --march) march="$2"; shift 2 ;;
    --native) cc="gcc"; shift ;;
    *) echo "build_libgomp.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
here="$(cd "$(dirname "$0")" && pwd)"
work="${APPLIANCE_CACHE_DIR:-$HOME/.cache/appliance}/gcc-src"
gccver=12.2.0
mkdir -p "$work" "$prefix/lib"
command -v "$cc" >/dev/null || { echo "no $cc: run scripts/arm64/setup.sh (apt-get install gcc-aarch64-linux-gnu)" >&2; exit 1; }

# 1. The source package (cached). Debian's images ship no deb-src entry: add one for the same mirror.
if ! ls "$work"/gcc-12_${gccver}.orig.tar.gz >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-cache showsrc gcc-12 2>/dev/null | grep -q '^Package: gcc-12'; then
    codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")"
    cat > /etc/apt/sources.list.d/appliance-deb-src.sources <<SRC
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: ${codename}
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    apt-get update -qq >/dev/null
  fi
  command -v dpkg-source >/dev/null || apt-get install -y -qq dpkg-dev >/dev/null
  (cd "$work" && apt-get source --download-only gcc-12 >/dev/null 2>&1)
fi
orig="$(ls "$work"/gcc-12_${gccver}.orig.tar.gz | head -1)"

# 2. Only what libgomp's configure and build read: libgomp/, include/, config/, the top-level scripts.
src="$work/src/gcc-${gccver}"
if [ ! -f "$src/libgomp/configure" ]; then
  mkdir -p "$work/src"
  tar xzf "$orig" -C "$work" "gcc-12-${gccver}/gcc-${gccver}-dfsg.tar.xz"
  t="gcc-${gccver}"
  tar xJf "$work/gcc-12-${gccver}/gcc-${gccver}-dfsg.tar.xz" -C "$work/src" \
    "$t/libgomp" "$t/include" "$t/config" "$t/config.guess" "$t/config.sub" "$t/install-sh" \
    "$t/ltmain.sh" "$t/missing" "$t/mkinstalldirs" "$t/config-ml.in" "$t/depcomp" "$t/compile" \
    "$t/multilib.am" "$t/libtool-ldflags" "$t/move-if-change" "$t/config.rpath" "$t/gcc/BASE-VER" \
    "$t/gcc/DATESTAMP" "$t/gcc/DEV-PHASE" "$t/libtool.m4" "$t/ltoptions.m4" "$t/ltsugar.m4" \
    "$t/ltversion.m4" "$t/lt~obsolete.m4"
  rm -f "$work/gcc-12-${gccver}/gcc-${gccver}-dfsg.tar.xz"
fi

# 3. Configure libgomp alone. -mno-outline-atomics keeps GCC from calling __aarch64_* helpers;
#    -march=armv8.2-a makes every __atomic/__sync builtin one LSE instruction.
build="$work/build-${march}"
rm -rf "$build" && mkdir -p "$build"
cd "$build"
"$src/libgomp/configure" --host=aarch64-linux-gnu --build="$(gcc -dumpmachine 2>/dev/null || echo x86_64-linux-gnu)" \
  --target=aarch64-linux-gnu --disable-multilib --enable-shared --disable-static --prefix="$prefix" \
  CC="$cc" FC=no CFLAGS="-O2 -g0 -march=${march} -mno-outline-atomics" > configure.log 2>&1 \
  || { tail -30 configure.log >&2; exit 1; }
make -j"$(nproc)" > make.log 2>&1 || { tail -30 make.log >&2; exit 1; }
install -m 0755 .libs/libgomp.so.1.0.0 "$prefix/lib/libgomp.so.1.0.0"
ln -sf libgomp.so.1.0.0 "$prefix/lib/libgomp.so.1"
echo "built $prefix/lib/libgomp.so.1 (GCC ${gccver} libgomp, -march=${march})"

# 4. Check what we built: it must be inline LSE, no LL/SC.
py="${PYTHON:-python3}"
if (cd "$here/.." && "$py" -c "import appliance" 2>/dev/null); then
  (cd "$here/.." && "$py" -m appliance.runtime.openmp "$prefix/lib/libgomp.so.1")
  (cd "$here/.." && "$py" -c "
import sys; from appliance.runtime.openmp import classify
c = classify(sys.argv[1]); sys.exit(0 if c.verdict == 'inline-lse' and c.llsc == 0 else 1)" "$prefix/lib/libgomp.so.1") \
    || { echo "build_libgomp.sh: the result is not inline-LSE" >&2; exit 1; }
fi
