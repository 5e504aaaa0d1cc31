"""Which malloc the engine process runs on: finding libmimalloc, the environment that preloads it
into a child process, and checks (from inside, and of another PID from outside) that it is live.

Why: on Neoverse hosts glibc malloc returns large freed blocks to the kernel and takes them back as
fresh pages on the next step (~16k minor page faults for a 64 MB buffer); mimalloc 3.x keeps them.
torch 2.13 on aarch64 already routes tensor storage through a statically linked mimalloc inside
libc10.so; the preload covers everything else (Python objects, tokenizers, HTTP buffers).

An allocator must be chosen before the process starts (``LD_PRELOAD`` is read by the dynamic
loader), so the parent builds the child's environment with :func:`preload_env` and the child
confirms with :func:`allocator_in_use`.

Kinds:
  ``mimalloc``     LD_PRELOAD=libmimalloc.so (falls back to ``glibc-tuned`` with a warning when no
                   libmimalloc is found)
  ``glibc-tuned``  no preload; glibc tunables that keep freed memory in the heap (mmap and trim
                   thresholds at 4 GiB), which removes most of the page-fault churn
  ``system``       plain glibc malloc, untouched (the opt-out and the benchmark baseline)

Where libmimalloc is looked for, first hit wins: ``$APPLIANCE_MIMALLOC`` (a path), the PyPI package
``cmeel-mimalloc`` (``<site-packages>/cmeel.prefix/lib/libmimalloc.so.3``), the system library
directories (Debian's ``libmimalloc2.0`` is 2.0.9, which did not remove the page faults in our test;
it is used only when nothing newer is there, and reported as such).
"""
from __future__ import annotations

import ctypes
import glob
import logging
import os
import re
import sys
import sysconfig
from pathlib import Path

from appliance.errors import ApplianceError

log = logging.getLogger(__name__)

ALLOCATORS = ("mimalloc", "glibc-tuned", "system")
MIMALLOC_ENV = "APPLIANCE_MIMALLOC"
# Above every per-step buffer the engine allocates: glibc keeps such blocks in its heap instead of
# mmap/munmap'ing them each time, and does not trim the heap top back to the kernel.
GLIBC_TUNED = {"glibc.malloc.mmap_threshold": str(4 << 30), "glibc.malloc.trim_threshold": str(4 << 30)}
_LIB_RE = re.compile(r"libmimalloc[^/]*\.so[.0-9]*$")


def release_free_memory() -> None:
    """Hand the memory malloc holds free back to the kernel, once, after loading: packing the weights
    frees the checkpoint's forms (hundreds of MB), which glibc (``glibc-tuned`` keeps freed blocks on
    purpose, for the per-step buffers) or mimalloc would otherwise keep resident for the life of the
    process. Not for steps: there, keeping freed memory is the point."""
    libc = ctypes.CDLL(None)
    collect = getattr(libc, "mi_collect", None)  # mimalloc preloaded: its own purge
    if collect is not None:
        collect(ctypes.c_bool(True))
    trim = getattr(libc, "malloc_trim", None)  # glibc
    if trim is not None:
        trim(ctypes.c_size_t(0))


# -- finding the library -------------------------------------------------------------------------
def _site_dirs() -> list[Path]:
    dirs = [sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib")]
    dirs += [p for p in sys.path if p.endswith("site-packages")]
    out: list[Path] = []
    for d in dirs:
        if d and Path(d) not in out:
            out.append(Path(d))
    return out


def find_mimalloc() -> Path | None:
    """The libmimalloc.so to preload, or None. See the module doc for the search order."""
    env = os.environ.get(MIMALLOC_ENV)
    if env:
        p = Path(env)
        if not p.is_file():
            raise ApplianceError(f"{MIMALLOC_ENV}={env}: no such file (unset it or point it at libmimalloc.so)")
        return p
    for d in _site_dirs():
        for name in ("libmimalloc.so.3", "libmimalloc.so"):
            p = d / "cmeel.prefix" / "lib" / name
            if p.is_file():
                return p.resolve()
    for pattern in ("/usr/lib/*-linux-gnu/libmimalloc.so.*", "/usr/lib/libmimalloc.so.*",
                    "/usr/local/lib/libmimalloc.so*"):
        hits = sorted(glob.glob(pattern), key=lambda s: [int(x) for x in re.findall(r"\d+", s)])
        if hits:
            return Path(hits[-1]).resolve()
    return None


def library_version(path: str | os.PathLike) -> int | None:
    """mimalloc's own version number (e.g. 30403 for 3.4.3) by loading the file with ctypes: safe,
    since a library that is loaded but not preloaded does not take over malloc."""
    try:
        fn = ctypes.CDLL(str(path)).mi_version
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return int(fn())


def format_version(v: int | None) -> str:
    return "unknown" if v is None else f"{v // 10000}.{v // 100 % 100}.{v % 100}"


# -- the child's environment ---------------------------------------------------------------------
def _merge_tunables(existing: str | None, extra: dict[str, str]) -> str:
    items = dict(kv.split("=", 1) for kv in (existing or "").split(":") if "=" in kv)
    for k, v in extra.items():
        items.setdefault(k, v)  # a value the user set wins
    return ":".join(f"{k}={v}" for k, v in items.items())


def prepend_preload(existing: str | None, lib: str) -> str:
    """LD_PRELOAD with ``lib`` first and no duplicate (entries are separated by ':' or spaces)."""
    parts = [p for p in re.split(r"[:\s]+", existing or "") if p and p != lib]
    return ":".join([lib, *parts])


def preload_env(kind: str = "mimalloc", base: dict | None = None) -> dict[str, str]:
    """Environment variables to add to a child process's environment so it runs on ``kind``.

    Returns only the additions (``LD_PRELOAD``, ``GLIBC_TUNABLES``, ``APPLIANCE_ALLOCATOR``), merged
    with what ``base`` (default: ``os.environ``) already has. ``system`` returns only the marker.
    """
    if kind not in ALLOCATORS:
        raise ApplianceError(f"--allocator must be one of {', '.join(ALLOCATORS)}; got {kind!r}")
    base = os.environ if base is None else base
    env = {"APPLIANCE_ALLOCATOR": kind}
    if kind == "mimalloc":
        lib = find_mimalloc()
        if lib is not None:
            env["LD_PRELOAD"] = prepend_preload(base.get("LD_PRELOAD"), str(lib))
            return env
        log.warning("no libmimalloc found (pip install cmeel-mimalloc, or set %s); "
                    "using glibc with tunables instead", MIMALLOC_ENV)
        env["APPLIANCE_ALLOCATOR"] = kind = "glibc-tuned"
    if kind == "glibc-tuned":
        env["GLIBC_TUNABLES"] = _merge_tunables(base.get("GLIBC_TUNABLES"), GLIBC_TUNED)
    return env


# -- checks --------------------------------------------------------------------------------------
class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _malloc_owner() -> str | None:
    """The file that the process's global ``malloc`` symbol resolves into (dladdr)."""
    try:
        libc = ctypes.CDLL(None)
        addr = ctypes.cast(libc.malloc, ctypes.c_void_p).value
        info = _DlInfo()
        dladdr = libc.dladdr
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        if dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) and info.dli_fname:
            return os.fsdecode(info.dli_fname)
    except (OSError, AttributeError):
        pass
    return None


def _owns_malloc(lib: str) -> bool:
    """Whether the mapped libmimalloc ``lib`` serves the process's ``malloc``: a block from ``malloc``
    that lies in mimalloc's heap. Needed where dladdr cannot say: a non-PIE python (Debian's
    /usr/bin/python3.x) has a canonical PLT entry for ``malloc``, so the global symbol resolves into
    the executable itself whichever library the calls reach."""
    try:
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
        in_heap = ctypes.CDLL(lib).mi_is_in_heap_region  # already mapped: the same handle
        in_heap.restype, in_heap.argtypes = ctypes.c_bool, [ctypes.c_void_p]
    except (OSError, AttributeError):
        return False
    block = libc.malloc(64)
    try:
        return bool(block) and bool(in_heap(block))
    finally:
        libc.free(block)


def mapped_libraries(pid: int | str = "self") -> list[str]:
    """Paths of the files mapped into a process (``/proc/PID/maps``), in first-mapped order."""
    seen: dict[str, None] = {}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/"):
                seen.setdefault(parts[5].strip().removesuffix(" (deleted)"), None)
    return list(seen)


def mimalloc_mapped(pid: int | str = "self") -> str | None:
    """The libmimalloc file mapped into process ``pid``, or None. Works for any process this user
    can read /proc/PID/maps of (check from outside that a server really runs on mimalloc)."""
    return next((p for p in mapped_libraries(pid) if _LIB_RE.search(p)), None)


def allocator_in_use() -> dict:
    """What this process allocates with, checked from inside.

    ``name`` is ``mimalloc`` when the global ``malloc`` resolves into a libmimalloc (preloaded),
    else ``glibc``. ``mimalloc_version`` comes from the ``mi_version`` symbol of the mapped library;
    ``tunables`` is GLIBC_TUNABLES as the process saw it at start; ``requested`` is what the parent
    asked for (``APPLIANCE_ALLOCATOR``) so a silent fallback shows."""
    mapped = mimalloc_mapped()
    owner = _malloc_owner()
    version = None
    if mapped:
        try:
            fn = ctypes.CDLL(mapped).mi_version  # already mapped: dlopen returns the same handle
            fn.restype = ctypes.c_int
            version = int(fn())
        except (OSError, AttributeError):
            pass
    live = bool(mapped) and owner is not None and _LIB_RE.search(owner) is not None
    if mapped and not live and _owns_malloc(mapped):  # dladdr was answered by the executable's PLT entry
        live, owner = True, mapped
    name = "mimalloc" if live else "glibc"
    return {
        "name": name,
        "requested": os.environ.get("APPLIANCE_ALLOCATOR"),
        "malloc_from": owner,
        "mimalloc_mapped": mapped,
        "mimalloc_version": format_version(version) if version else None,
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
    }


def describe(info: dict | None = None) -> str:
    """One line for a start-up banner: ``mimalloc 3.4.3 (preloaded)`` / ``glibc (tunables: ...)``."""
    info = info or allocator_in_use()
    if info["name"] == "mimalloc":
        s = f"mimalloc {info['mimalloc_version'] or '?'} (preloaded)"
    elif info["glibc_tunables"]:
        s = f"glibc malloc (GLIBC_TUNABLES={info['glibc_tunables']})"
    else:
        s = "glibc malloc"
    if info["requested"] == "mimalloc" and info["name"] != "mimalloc":
        s += " [mimalloc was requested but is not live]"
    return s


def _main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m appliance.runtime.allocator",
                                 description="Find libmimalloc; check which allocator a process runs on.")
    ap.add_argument("--pid", type=int, help="check this process's /proc/PID/maps instead of this one")
    ap.add_argument("--env", choices=ALLOCATORS, help="print the environment additions for this kind")
    a = ap.parse_args(argv)
    if a.env:
        for k, v in preload_env(a.env).items():
            print(f"{k}={v}")
        return 0
    if a.pid:
        lib = mimalloc_mapped(a.pid)
        print(json.dumps({"pid": a.pid, "mimalloc_mapped": lib}))
        return 0 if lib else 1
    lib = find_mimalloc()
    print(json.dumps({"found": str(lib) if lib else None,
                      "version": format_version(library_version(lib)) if lib else None,
                      "this_process": allocator_in_use()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
