"""What this CPU can do, read once. The bottom floor: imports nothing from the rest of the package.

On Linux Arm the truth is ``getauxval(AT_HWCAP/AT_HWCAP2)`` (what the kernel lets user space run;
under qemu it follows the emulated CPU); on x86 the ``flags`` line of /proc/cpuinfo.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
from dataclasses import dataclass, field

# Linux arm64 hwcap bits (arch/arm64/include/uapi/asm/hwcap.h)
_HWCAP = {"asimd": 1 << 1, "atomics": 1 << 8, "asimddp": 1 << 20, "sve": 1 << 22}
_HWCAP2 = {"sve2": 1 << 1, "i8mm": 1 << 13, "bf16": 1 << 14}
_AT_HWCAP, _AT_HWCAP2 = 16, 26


@dataclass(frozen=True)
class CpuFeatures:
    arch: str
    model_name: str
    flags: frozenset = field(default_factory=frozenset)

    def has(self, name: str) -> bool:
        return name in self.flags

    @property
    def native_bf16(self) -> bool:
        """bf16 math in hardware: Arm BF16 (BFMMLA/BFDOT), x86 AVX512-BF16 or AMX-BF16."""
        if self.arch == "aarch64":
            return self.has("bf16")
        return self.has("avx512_bf16") or self.has("amx_bf16")


def _cpuinfo() -> tuple[str, set[str]]:
    name, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu model") and name == "unknown":
                    name = val.strip()
                elif key in ("flags", "features") and not flags:
                    flags = set(val.split())
    except OSError:
        pass
    return name, flags


def _arm_hwcaps() -> set[str]:
    try:
        libc = ctypes.CDLL(None)
        getauxval = libc.getauxval
        getauxval.restype = ctypes.c_ulong
        getauxval.argtypes = [ctypes.c_ulong]
        hw, hw2 = getauxval(_AT_HWCAP), getauxval(_AT_HWCAP2)
    except (OSError, AttributeError):
        return set()
    return {n for n, b in _HWCAP.items() if hw & b} | {n for n, b in _HWCAP2.items() if hw2 & b}


@functools.lru_cache(maxsize=1)
def detect() -> CpuFeatures:
    arch = platform.machine().lower()
    arch = "aarch64" if arch in ("arm64", "aarch64") else arch
    name, flags = _cpuinfo()
    if arch == "aarch64":
        flags = _arm_hwcaps() or flags
    return CpuFeatures(arch=arch, model_name=name, flags=frozenset(flags))


def physical_cores() -> int:
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        return os.cpu_count() or 1
