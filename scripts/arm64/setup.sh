#!/usr/bin/env bash
# The tools to build and run aarch64 code on an x86-64 Debian/Ubuntu host, from the distribution's apt:
#   g++-aarch64-linux-gnu        the GNU cross compiler (Debian 12: GCC 12.2) and its arm64 sysroot
#   binutils-aarch64-linux-gnu   aarch64-linux-gnu-objdump (which instructions a build emitted)
#   qemu-user-static             qemu-aarch64-static: runs aarch64 Linux programs (user-mode emulation)
#   debootstrap                  builds the Debian arm64 root (rootfs.sh)
# and registers qemu with the kernel's binfmt_misc, so that aarch64 programs inside a chroot run.
# Idempotent (a second run only checks); needs root. Prints the versions it ends up with.
set -euo pipefail
need=()
command -v aarch64-linux-gnu-g++ >/dev/null || need+=(g++-aarch64-linux-gnu)
command -v aarch64-linux-gnu-objdump >/dev/null || need+=(binutils-aarch64-linux-gnu)
command -v qemu-aarch64-static >/dev/null || need+=(qemu-user-static)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { echo "scripts/arm64/setup.sh: needs root to apt-get install ${need[*]}" >&2; exit 1; }
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# binfmt_misc: the kernel hands aarch64 ELF files to qemu (flag F: the interpreter is opened now, so it
# also works inside a chroot that has no qemu of its own). Needed by debootstrap's second stage and by
# every program run in the root; plain `qemu-aarch64-static PROGRAM` does not need it.
if [ "$(id -u)" = 0 ] && [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
  [ -e /proc/sys/fs/binfmt_misc/register ] || mount binfmt_misc -t binfmt_misc /proc/sys/fs/binfmt_misc
  conf=/usr/lib/binfmt.d/qemu-aarch64.conf
  if [ -r "$conf" ]; then
    cat "$conf" > /proc/sys/fs/binfmt_misc/register
  else
    echo "scripts/arm64/setup.sh: $conf missing (is qemu-user-static installed?)" >&2; exit 1
  fi
fi

aarch64-linux-gnu-g++ --version | head -1
qemu-aarch64-static --version | head -1
