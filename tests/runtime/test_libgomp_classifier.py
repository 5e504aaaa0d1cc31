"""The libgomp classifier on real binaries: torch's aarch64 wheels, Debian's cross libgomp, the
project's own LSE build, and tiny libraries compiled three ways so each verdict has a known answer."""
from __future__ import annotations

import subprocess

import pytest

from appliance.errors import ApplianceError
from appliance.runtime.openmp import LLSC_RE, LSE_RE, classify, classify_text

from conftest import debian_cross_libgomp, torch_wheel_libgomp

ATOMIC_C = r"""
#include <stdatomic.h>
long counter; int flag; long slot;
__attribute__((visibility("hidden"))) long add(long v) { return __atomic_fetch_add(&counter, v, __ATOMIC_ACQ_REL); }
int cas(int e, int d) { return __atomic_compare_exchange_n(&flag, &e, d, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE); }
long xchg(long v) { return __atomic_exchange_n(&slot, v, __ATOMIC_SEQ_CST); }
long GOMP_loop_dynamic_next(long *istart) { *istart = add(7); return *istart < 100; }
"""


@pytest.mark.parametrize("m,lse", [("ldaddal", True), ("casal", True), ("swpa", True), ("ldsetl", True),
                                   ("ldclrb", True), ("casp", True), ("stadd", True), ("ldxr", False),
                                   ("ldaxr", False), ("stlxr", False), ("ldr", None), ("add", None)])
def test_mnemonic_classes(m, lse):
    assert bool(LSE_RE.match(m)) == (lse is True)
    assert bool(LLSC_RE.match(m)) == (lse is False)


def test_torch_2_13_wheel_libgomp_is_llsc_only(arm_tools):
    c = classify(torch_wheel_libgomp("2.13.0"))
    assert c.verdict == "llsc-only", c.summary()
    assert c.lse == 0 and c.llsc >= 600  # 686 when this was written (GCC 8.5's libgomp)
    assert c.dynamic_path["found"] and c.dynamic_path["lse"] == 0 and c.dynamic_path["llsc"] > 0


def test_torch_2_10_wheel_libgomp_is_outline_atomics(arm_tools):
    c = classify(torch_wheel_libgomp("2.10.0"))
    assert c.verdict == "outline-atomics", c.summary()
    assert c.lse > 0 and c.lse_guarded == c.lse and c.llsc > 0


def test_debian_cross_libgomp_is_outline_atomics(arm_tools):
    c = classify(debian_cross_libgomp())
    assert c.verdict == "outline-atomics", c.summary()
    assert c.lse_guarded == c.lse >= 10
    # The dynamic-schedule path reaches a helper: LSE behind the HWCAP flag, LL/SC as its fallback.
    assert c.dynamic_path["found"] and c.dynamic_path["lse_guarded"] >= 1


def test_project_lse_build_is_inline_lse(lse_libgomp):
    c = classify(lse_libgomp)
    assert c.verdict == "inline-lse", c.summary()
    assert c.llsc == 0 and c.lse >= 100
    assert c.dynamic_path["found"] and c.dynamic_path["lse"] >= 1 and c.dynamic_path["llsc"] == 0


@pytest.mark.parametrize("flags,verdict", [
    (["-march=armv8.1-a"], "inline-lse"),
    (["-march=armv8.2-a", "-mno-outline-atomics"], "inline-lse"),
    (["-march=armv8-a", "-mno-outline-atomics"], "llsc-only"),
    (["-march=armv8-a", "-moutline-atomics"], "outline-atomics"),
])
def test_compiled_library_verdicts(arm_tools, tmp_path, flags, verdict):
    src = tmp_path / "atomics.c"
    src.write_text(ATOMIC_C)
    lib = tmp_path / "libatomics.so"
    # -moutline-atomics calls libgcc's __aarch64_* helpers; -static-libgcc links them into the .so
    subprocess.run(["aarch64-linux-gnu-gcc", "-O2", "-shared", "-fPIC", "-static-libgcc", *flags, str(src),
                    "-o", str(lib)], check=True)
    c = classify(lib)
    assert c.verdict == verdict, (flags, c.summary(), c.by_mnemonic)
    assert c.dynamic_path["found"]  # our stand-in GOMP_loop_dynamic_next calls add() (no PLT: hidden)
    if verdict == "llsc-only":
        assert c.dynamic_path["llsc"] >= 2 and c.dynamic_path["lse"] == 0
    if verdict == "inline-lse":
        assert c.llsc == 0 and c.dynamic_path["lse"] >= 1


def test_rejects_non_aarch64(tmp_path):
    import sys

    with pytest.raises(ApplianceError, match="not an aarch64 binary"):
        classify(sys.executable)
    with pytest.raises(ApplianceError, match="no such file"):
        classify(tmp_path / "missing.so")


def test_classify_text_on_a_handwritten_helper():
    text = """
0000000000001000 <GOMP_loop_dynamic_next@@GOMP_1.0>:
    1000:\t94000004 \tbl\t1010 <x>
    1004:\td65f03c0 \tret
    1010:\t90000170 \tadrp\tx16, 60000 <x>
    1014:\t39634210 \tldrb\tw16, [x16, #2256]
    1018:\t34000070 \tcbz\tw16, 1024 <x>
    101c:\tf8200020 \tldaddal\tx0, x0, [x1]
    1020:\td65f03c0 \tret
    1024:\tc85f7c20 \tldaxr\tx0, [x1]
    1028:\tc80f7c31 \tstlxr\tw15, x17, [x1]
    102c:\td65f03c0 \tret
"""
    c = classify_text(text)
    assert c.verdict == "outline-atomics"
    assert (c.lse, c.lse_guarded, c.llsc) == (1, 1, 2)
    assert c.dynamic_path["instructions"] == 10


def test_mapped_libgomp_is_the_one_torch_uses_not_a_private_wheel_copy():
    """sentencepiece's wheel carries a renamed private libgomp; the report must name the one that
    serves libgomp.so.1 (torch's here), whatever the order of the mappings."""
    import re

    import sentencepiece  # noqa: F401 - maps its private copy
    import torch  # noqa: F401

    from appliance.runtime.openmp import mapped_libgomp

    with open("/proc/self/maps") as f:
        paths = {line.split(None, 5)[5].strip() for line in f if "libgomp" in line and len(line.split(None, 5)) == 6}
    assert any(re.search(r"/libgomp-[0-9a-f]{8}\.so", p) for p in paths), paths  # the case under test
    got = mapped_libgomp()
    assert got in paths and not re.search(r"/libgomp-[0-9a-f]{8}\.so", got), got
