"""libgomp on aarch64: which atomics a given libgomp uses, which libgomp a process has mapped, and
the preload that replaces torch's bundled copy with an LSE one.

Why: OpenMP dynamic scheduling and barriers are atomic read-modify-writes on shared counters. With
LL/SC (LDXR/STXR retry loops) they collapse under contention on many-core Neoverse hosts; with
ARMv8.1 LSE (LDADD, CAS, SWP, ...) each is one instruction the interconnect resolves. Three kinds
of build exist in the wild (see "The Arm runtime" in README.md):

  ``inline-lse``       built with -march=armv8.1-a or later: LSE instructions inline, no LL/SC
                       (the project's own build, openmp/build_libgomp.sh)
  ``outline-atomics``  GCC's -moutline-atomics (default since GCC 10.1 on Linux): small helpers
                       ``__aarch64_ldadd4_acq_rel`` ... test a flag set from HWCAP_ATOMICS and run
                       the LSE form on LSE cores, LL/SC elsewhere (Debian's libgomp, torch 2.10's)
  ``llsc-only``        no LSE at all (torch 2.13.0's PyPI wheel: GCC 8.5, 686 LL/SC instructions)

The classifier disassembles with ``aarch64-linux-gnu-objdump`` (or ``objdump`` on an aarch64 host),
counts instruction classes, decides whether each LSE instruction sits behind an outline-atomics
flag test (``ldrb w16, [x16, #..]; cbz w16, ..`` just before it), and follows the control flow from
``GOMP_loop_dynamic_next`` (branches and calls, a few levels deep) to show what one dynamic-schedule
chunk request executes.

libtorch_cpu.so needs the unversioned soname ``libgomp.so.1``; a libgomp given in LD_PRELOAD is
found first, so the process ends up with exactly one OpenMP runtime: the preloaded one.
"""
from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from appliance.errors import ApplianceError

LSE_RE = re.compile(r"^(ldadd|ldclr|ldeor|ldset|ldsmax|ldsmin|ldumax|ldumin|stadd|stclr|steor|stset|"
                    r"stsmax|stsmin|stumax|stumin|swp|casp?)(a|al|l)?(b|h)?$")
LLSC_RE = re.compile(r"^(ld|st)(a|l)?xp?(r[bh]?)?$")  # ldxr ldaxr stxr stlxr ldxp ldaxp stxp stlxp (+b/h)
VERDICTS = ("inline-lse", "outline-atomics", "llsc-only", "no-atomics")
_INSN_RE = re.compile(r"^\s*([0-9a-f]+):\s+[0-9a-f]{8}\s+(\S+)\s*(.*)$")
_LABEL_RE = re.compile(r"^([0-9a-f]+) <([^>]+)>:$")
_TARGET_RE = re.compile(r"^([0-9a-f]+)\b")
_BRANCH = {"b", "bl", "cbz", "cbnz", "tbz", "tbnz"}
DYNAMIC_ENTRY_POINTS = ("GOMP_loop_dynamic_next", "GOMP_loop_nonmonotonic_dynamic_next",
                        "GOMP_loop_ull_dynamic_next")


def objdump() -> str:
    """The objdump that reads aarch64 code on this host."""
    for name in ("aarch64-linux-gnu-objdump", "llvm-objdump"):
        if shutil.which(name):
            return name
    if platform.machine() in ("aarch64", "arm64") and shutil.which("objdump"):
        return "objdump"
    raise ApplianceError("no aarch64 objdump: apt-get install binutils-aarch64-linux-gnu "
                         "(or run scripts/arm64/setup.sh)")


@dataclass
class Classification:
    path: str
    verdict: str  # one of VERDICTS
    lse: int  # LSE instructions anywhere in .text
    llsc: int  # LDXR/STXR-class instructions anywhere in .text
    lse_guarded: int  # LSE instructions right behind an outline-atomics flag test
    by_mnemonic: dict = field(default_factory=dict)
    dynamic_path: dict = field(default_factory=dict)  # what GOMP_loop_dynamic_next reaches
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        d = self.dynamic_path
        dyn = (f"; dynamic-schedule path: {d.get('lse', 0)} LSE, {d.get('llsc', 0)} LL/SC in "
               f"{d.get('instructions', 0)} instructions") if d.get("found") else ""
        return f"{self.verdict}: {self.lse} LSE ({self.lse_guarded} behind a HWCAP test), {self.llsc} LL/SC{dyn}"


def _disassemble(path: str) -> str:
    try:
        r = subprocess.run([objdump(), "-d", str(path)],
                           capture_output=True, text=True, check=False, timeout=300)
    except subprocess.TimeoutExpired as e:
        raise ApplianceError(f"{path}: objdump took longer than 300 s") from e
    if r.returncode != 0:
        raise ApplianceError(f"{path}: objdump failed: {r.stderr.strip()[:300]}")
    return r.stdout


def _parse(text: str) -> tuple[list[tuple[int, str, str]], dict[str, int]]:
    insns: list[tuple[int, str, str]] = []
    labels: dict[str, int] = {}
    for line in text.splitlines():
        m = _INSN_RE.match(line)
        if m:
            insns.append((int(m.group(1), 16), m.group(2), m.group(3)))
            continue
        m = _LABEL_RE.match(line)
        if m:
            name = m.group(2).split("@")[0]
            labels.setdefault(name, int(m.group(1), 16))
    return insns, labels


def _guarded(insns: list[tuple[int, str, str]], i: int) -> bool:
    """Is the LSE instruction at index i the fast path of an outline-atomics helper? GCC's helpers
    load the ``__aarch64_have_lse_atomics`` byte and branch around the LSE form when it is 0."""
    window = insns[max(0, i - 4):i]
    has_test = any(m in ("cbz", "cbnz") for _, m, _ in window)
    has_flag = any(m == "ldrb" for _, m, _ in insns[max(0, i - 6):i])
    return has_test and has_flag


def _walk(insns, index_of, start: int, max_insns: int = 4000, max_depth: int = 4) -> list[int]:
    """Indices of instructions reachable from address ``start`` following branches and calls
    (calls at most ``max_depth`` deep; indirect branches and PLT stubs end a path)."""
    seen: set[int] = set()
    work = [(start, 0)]
    while work and len(seen) < max_insns:
        addr, depth = work.pop()
        i = index_of.get(addr)
        while i is not None and i not in seen and len(seen) < max_insns:
            seen.add(i)
            _, m, ops = insns[i]
            base = m.split(".")[0]
            if m in ("ret", "br", "blr", "braa", "brab", "retaa", "retab") or m.startswith("udf"):
                break
            if base in _BRANCH or m.startswith("b."):
                tgt = _TARGET_RE.match(ops.split(",")[-1].strip())
                if tgt:
                    t = int(tgt.group(1), 16)
                    if base == "bl":
                        if depth < max_depth:
                            work.append((t, depth + 1))
                    else:
                        work.append((t, depth))
                if base == "b":  # unconditional: no fall-through
                    break
            i = i + 1 if i + 1 < len(insns) else None
    return sorted(seen)


def classify_text(text: str, path: str = "<text>") -> Classification:
    insns, labels = _parse(text)
    counts: Counter = Counter()
    lse = llsc = guarded = 0
    for i, (_, m, _) in enumerate(insns):
        if LSE_RE.match(m):
            lse += 1
            counts[m] += 1
            guarded += _guarded(insns, i)
        elif LLSC_RE.match(m):
            llsc += 1
            counts[m] += 1
    if lse == 0:
        verdict = "llsc-only" if llsc else "no-atomics"
    elif guarded >= lse / 2 and llsc:
        # Helpers: every guarded LSE has its LL/SC twin. Unguarded LSE beside them would be inline.
        verdict = "outline-atomics" if lse - guarded <= guarded else "inline-lse"
    else:
        verdict = "inline-lse"
    dyn: dict = {"found": False}
    entry = next((labels[n] for n in DYNAMIC_ENTRY_POINTS if n in labels), None)
    if entry is not None:
        index_of = {a: k for k, (a, _, _) in enumerate(insns)}
        reach = _walk(insns, index_of, entry)
        dl = sum(1 for k in reach if LSE_RE.match(insns[k][1]))
        dx = sum(1 for k in reach if LLSC_RE.match(insns[k][1]))
        dg = sum(1 for k in reach if LSE_RE.match(insns[k][1]) and _guarded(insns, k))
        mnems = Counter(insns[k][1] for k in reach if LSE_RE.match(insns[k][1]) or LLSC_RE.match(insns[k][1]))
        dyn = {"found": True, "entry": next(n for n in DYNAMIC_ENTRY_POINTS if n in labels),
               "instructions": len(reach), "lse": dl, "lse_guarded": dg, "llsc": dx,
               "by_mnemonic": dict(sorted(mnems.items()))}
    notes = {
        "inline-lse": "LSE atomics inline: one instruction per atomic on every ARMv8.1+ core",
        "outline-atomics": "LSE chosen at run time from HWCAP_ATOMICS (a call + flag test per atomic)",
        "llsc-only": "no LSE: every atomic is an LDXR/STXR retry loop (slow under contention)",
        "no-atomics": "no atomic instructions found (not an aarch64 libgomp?)",
    }
    return Classification(path=str(path), verdict=verdict, lse=lse, llsc=llsc, lse_guarded=guarded,
                          by_mnemonic=dict(sorted(counts.items())), dynamic_path=dyn, note=notes[verdict])


@functools.lru_cache(maxsize=32)
def _classify_cached(path: str, mtime: float, size: int) -> Classification:
    return classify_text(_disassemble(path), path)


def classify(path: str | os.PathLike) -> Classification:
    """Classify the aarch64 shared library (or object / executable) at ``path``."""
    p = Path(path)
    if not p.is_file():
        raise ApplianceError(f"{path}: no such file")
    with open(p, "rb") as f:
        head = f.read(20)
    if head[:4] != b"\x7fELF":
        raise ApplianceError(f"{path}: not an ELF file")
    if int.from_bytes(head[18:20], "little") != 183:  # EM_AARCH64
        raise ApplianceError(f"{path}: not an aarch64 binary (e_machine {int.from_bytes(head[18:20], 'little')})")
    st = p.stat()
    return _classify_cached(str(p.resolve()), st.st_mtime, st.st_size)


# -- what the process has, and the preload -------------------------------------------------------
def mapped_libgomp(pid: int | str = "self") -> str | None:
    """The libgomp file mapped into process ``pid`` that serves ``libgomp.so.1`` (torch's OpenMP, or
    the preloaded one); None if OpenMP is not loaded yet.

    Wheels repaired by auditwheel carry private, renamed copies (``libgomp-<hash>.so.1.0.0``, e.g.
    sentencepiece's) that only their own extension calls; they are reported only when nothing else
    is mapped."""
    found = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and re.search(r"/libgomp[^/]*\.so[.0-9]*$", parts[5].strip()):
                path = parts[5].strip()
                if path not in found:
                    found.append(path)
    main = [p for p in found if not re.search(r"/libgomp-[0-9a-f]{8}\.so", p)]
    return (main or found or [None])[0]


def torch_bundled_libgomp() -> Path | None:
    """torch's own copy (``torch/lib/libgomp.so.1`` on aarch64 wheels), found without importing torch."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        for name in ("libgomp.so.1", *sorted(p.name for p in (Path(d) / "lib").glob("libgomp*.so*"))):
            p = Path(d) / "lib" / name
            if p.is_file():
                return p
    return None


LIBGOMP_ENV = "APPLIANCE_LIBGOMP"
_CANDIDATES = (
    "/opt/appliance/lib/libgomp.so.1",  # the image's LSE build (Dockerfile.arm64)
    "~/.cache/appliance/libgomp-lse/lib/libgomp.so.1",  # openmp/build_libgomp.sh's default prefix
    "/usr/lib/aarch64-linux-gnu/libgomp.so.1",  # the distro's (outline atomics on Debian 12)
)


def choose_libgomp() -> tuple[Path | None, str]:
    """The libgomp an aarch64 engine process should preload, and why. First of: ``$APPLIANCE_LIBGOMP``
    (``none`` disables), the project's LSE build, the distro's. None off aarch64 or when torch's
    bundled copy is already no worse."""
    env = os.environ.get(LIBGOMP_ENV)
    if env == "none":
        return None, f"{LIBGOMP_ENV}=none"
    if env:
        if not Path(env).is_file():
            raise ApplianceError(f"{LIBGOMP_ENV}={env}: no such file (unset it, or 'none' to keep torch's)")
        return Path(env), f"from {LIBGOMP_ENV}"
    if platform.machine() not in ("aarch64", "arm64"):
        return None, "not aarch64: libgomp's atomics are not the issue here"
    for c in _CANDIDATES:
        p = Path(c).expanduser()
        if p.is_file():
            return p, "project LSE build" if "appliance" in c else "distro build"
    return None, "no replacement libgomp found (run openmp/build_libgomp.sh)"


def preload_env(lib: str | os.PathLike | None = "auto", base: dict | None = None) -> dict[str, str]:
    """Environment additions that preload ``lib`` (``auto``: :func:`choose_libgomp`) in a child
    process. Empty when there is nothing to preload."""
    base = os.environ if base is None else base
    if lib == "auto":
        lib, _ = choose_libgomp()
    if lib is None:
        return {}
    from appliance.runtime.allocator import prepend_preload

    return {"LD_PRELOAD": prepend_preload(base.get("LD_PRELOAD"), str(lib))}


def verify_preloaded(expected: str | os.PathLike, pid: int | str = "self") -> tuple[bool, str | None]:
    """Is ``expected`` the libgomp that process ``pid`` has mapped? Returns (ok, mapped path)."""
    mapped = mapped_libgomp(pid)
    if mapped is None:
        return False, None
    return os.path.realpath(mapped) == os.path.realpath(expected), mapped


def libgomp_report() -> dict:
    """The libgomp this process maps (or torch would map), its classification, and the choice."""
    mapped = mapped_libgomp()
    bundled = torch_bundled_libgomp()
    chosen, why = choose_libgomp()
    out: dict = {"mapped": mapped, "torch_bundled": str(bundled) if bundled else None,
                 "preload_choice": str(chosen) if chosen else None, "preload_reason": why,
                 "classification": None}
    target = mapped or (str(bundled) if bundled else None)
    if target and platform.machine() in ("aarch64", "arm64"):
        try:
            out["classification"] = classify(target).as_dict()
        except ApplianceError as e:
            out["classification_error"] = str(e)
    elif target:
        out["classification_error"] = f"{platform.machine()} host: the LSE question applies to aarch64 only"
    return out


def _main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m appliance.runtime.openmp",
                                 description="Classify the atomics of aarch64 libgomp builds.")
    ap.add_argument("paths", nargs="*", help="libgomp files (default: the one this process maps after importing torch)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    paths = a.paths
    if not paths:
        import torch  # noqa: F401 - maps torch's OpenMP runtime

        torch.zeros(1).add_(1)
        m = mapped_libgomp()
        if m is None:
            print("no libgomp mapped in this process", file=sys.stderr)
            return 1
        paths = [m]
    rc = 0
    for p in paths:
        try:
            c = classify(p)
        except ApplianceError as e:
            print(f"{p}: {e}", file=sys.stderr)
            rc = 1
            continue
        print(json.dumps(c.as_dict(), indent=2) if a.json else f"{p}: {c.summary()}")
    return rc


if __name__ == "__main__":
    sys.exit(_main())
