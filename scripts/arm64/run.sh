#!/usr/bin/env bash
# Runs an aarch64 Linux program on this x86-64 host under qemu user-mode emulation, as one of the Arm
# server cores the appliance targets:
#   run.sh [--cpu PROFILE] PROGRAM [ARGS...]              a program linked against the cross sysroot
#   run.sh [--cpu PROFILE] --root DIR PROGRAM [ARGS...]   a program inside an arm64 root (rootfs.sh)
#
#   profile  stands for                          qemu -cpu        what it has
#   v2       Neoverse V2: Graviton4, Grace       max,sve128=on    SVE/SVE2 at 128 bit, BF16, I8MM, LSE (default)
#   v1       Neoverse V1: Graviton3              max,sve256=on    SVE at 256 bit, BF16, I8MM, LSE
#   n1       Neoverse N1: Graviton2, Altra       neoverse-n1      NEON, dotprod, LSE; no SVE, BF16 or I8MM
#   max      every extension qemu knows          max              SVE at 512 bit
# getauxval(AT_HWCAP/AT_HWCAP2) follows the profile; /proc/cpuinfo keeps showing the host. Executing an
# instruction the profile lacks traps with SIGILL. Emulation shows what is computed and which
# instructions run; its timings mean nothing (torch runs at ~0.1-0.2 GFLOP/s here).
#
# Without --root, dynamically linked programs find their libraries under QEMU_LD_PREFIX (default: the
# cross toolchain's sysroot /usr/aarch64-linux-gnu). With --root, the program runs chrooted in DIR
# (through binfmt_misc, registered by setup.sh), in a private mount namespace holding DIR's /proc,
# /sys and /dev: the mounts vanish with the process, so nothing stays mounted inside DIR. Needs root.
set -euo pipefail
cpu=v2 root=
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) cpu=$2; shift 2 ;;
    --root) root=$2; shift 2 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: run.sh [--cpu v2|v1|n1|max] [--root DIR] PROGRAM [ARGS...]" >&2; exit 2; }
case "$cpu" in
  v2) qcpu="max,sve128=on" ;;
  v1) qcpu="max,sve256=on" ;;
  n1) qcpu="neoverse-n1" ;;
  max) qcpu="max" ;;
  *) echo "run.sh: unknown --cpu '$cpu' (v2, v1, n1 or max)" >&2; exit 2 ;;
esac
if [ -z "$root" ]; then
  exec qemu-aarch64-static -L "${QEMU_LD_PREFIX:-/usr/aarch64-linux-gnu}" -cpu "$qcpu" "$@"
fi

root=$(cd "$root" && pwd)
[ -x "$root/bin/sh" ] || { echo "run.sh: $root is not an arm64 root (build one with scripts/arm64/rootfs.sh)" >&2; exit 2; }
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || bash "$(dirname "$0")/setup.sh" >/dev/null
# binfmt_misc starts qemu without arguments: the CPU comes from QEMU_CPU.
export QEMU_CPU=$qcpu
# torch's cpuinfo counts CPUs in /sys, oneDNN and KleidiAI pick kernels from what it finds; /dev/shm
# carries the server's inter-process queues.
exec unshare --mount --propagation private -- /bin/sh -ec '
  root=$1; shift
  mount -t proc proc "$root/proc"
  mount --rbind /sys "$root/sys"
  mount --rbind /dev "$root/dev"
  exec chroot "$root" "$@"' sh "$root" "$@"
