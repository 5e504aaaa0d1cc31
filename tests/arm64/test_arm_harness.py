"""Arm verification on an x86-64 host: cross-compile the kernels (native/neon_sve) with the
standalone harness for aarch64, run it under qemu as Neoverse V2 (SVE 128, BF16, I8MM), V1 (SVE 256)
and N1 (no SVE/BF16: executing either would trap with SIGILL), plus qemu's max (SVE 512), and check with objdump that the
BF16 variant really contains BFMMLA and the SVE variant SVE instructions.

The harness holds every variant the emulated CPU supports against the generic version (and the
generic attention against a naive double-precision one); see native/neon_sve/harness/harness.cpp.
Tools come from scripts/arm64/setup.sh (apt-get); programs run through scripts/arm64/run.sh.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from arm_tools import ARM64_SCRIPTS, ensure_arm_tools

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "native" / "neon_sve"
CXXFLAGS = ["-std=c++17", "-O3",  # as the torch extension is built
            "-fopenmp", "-Wall", "-Wno-maybe-uninitialized",
            f"-I{SRC / 'include'}", f"-I{SRC / 'src' / 'x86'}", f"-I{SRC / 'src' / 'neon'}"]

# profile -> (variants the dispatcher must offer, best first; the one it must pick)
PROFILES = {
    "v2": ("neon_bf16,sve,neon,generic", "neon_bf16"),
    "v1": ("sve,neon_bf16,neon,generic", "sve"),
    "n1": ("neon,generic", "neon"),
    "max": ("sve,neon_bf16,neon,generic", "sve"),  # SVE at 512 bit: vector-length agnostic code
}


@pytest.fixture(scope="session")
def toolchain() -> None:
    ensure_arm_tools()


@pytest.fixture(scope="session")
def arm_build(toolchain, tmp_path_factory) -> Path:
    """Objects of every kernel TU plus the statically linked harness, for aarch64."""
    out = tmp_path_factory.mktemp("arm64")
    sources = sorted((SRC / "src").glob("*/*.cpp")) + [SRC / "dispatch" / "dispatch.cpp",
                                                       SRC / "harness" / "harness.cpp"]
    procs = []
    for src in sources:
        obj = out / f"{src.stem}.o"
        procs.append((src, subprocess.Popen(["aarch64-linux-gnu-g++", *CXXFLAGS, "-c", str(src), "-o", str(obj)],
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for src, p in procs:
        log, _ = p.communicate()
        assert p.returncode == 0, f"cross-compiling {src.name} failed:\n{log}"
    link = subprocess.run(["aarch64-linux-gnu-g++", "-static", "-fopenmp", *sorted(map(str, out.glob("*.o"))),
                           "-o", str(out / "harness")], capture_output=True, text=True)
    assert link.returncode == 0, link.stderr
    return out


def run_qemu(profile: str, program: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ARM64_SCRIPTS / "run.sh"), "--cpu", profile, str(program), *args],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="2"))


@pytest.mark.parametrize("profile", list(PROFILES))
def test_harness_under_qemu(arm_build, profile):
    variants, selected = PROFILES[profile]
    r = run_qemu(profile, arm_build / "harness", "--expect-variants", variants, "--expect-selected", selected)
    failures = [line for line in r.stdout.splitlines() if line.startswith("FAIL")]
    assert r.returncode == 0 and "RESULT: OK" in r.stdout, (
        f"profile {profile} (rc {r.returncode}):\n" + "\n".join(failures) + r.stdout[-3000:] + r.stderr[-2000:])
    # Every variant was compared with generic on attention (bf16 caches included), and ran the W8A8
    # group-scale GEMM against its double-precision reference (SDOT where the CPU has dotprod: all
    # four profiles here; SMMLA for token pairs where it has I8MM: all but n1).
    for v in variants.split(","):
        if v != "generic":
            assert re.search(rf"^PASS {v}\s+attn .*kv:bf16", r.stdout, re.M), v
        assert len(re.findall(rf"^PASS {v}\s+w8g ", r.stdout, re.M)) == 8, v  # 3 of them the overflow worst cases, 2 group 16
        # low-bit weights: fp32 group scales (13: 4/6 bits 8, 2 of them extremes; 5 bits 5, 2 of them
        # extremes) and a GGUF K-quant's own scales (8, 2 of them at super-blocks of 128 and 64)
        assert len(re.findall(rf"^PASS {v}\s+wlow M", r.stdout, re.M)) == 13, v
        assert len(re.findall(rf"^PASS {v}\s+wlow M.*bits=5", r.stdout, re.M)) == 5, v
        assert len(re.findall(rf"^PASS {v}\s+wlow-kquant ", r.stdout, re.M)) == 8, v
        assert len(re.findall(rf"^PASS {v}\s+gemm_f32 M", r.stdout, re.M)) == 5, v  # the float panel GEMM
        assert len(re.findall(rf"^PASS {v}\s+gemm_f32 silu_mul ", r.stdout, re.M)) == 2, v  # + silu(gate) * up
        # quantized KV cache: int8 / fp8 e4m3 / e5m2 writes bit for bit against the oracle, and attention
        # over such caches (decode, chunked prefill, GQA/MHA, window, soft cap) against naive double
        assert len(re.findall(rf"^PASS {v}\s+kv write ", r.stdout, re.M)) == 3, v
        assert len(re.findall(rf"^PASS {v}\s+attn .*kv:(int8|fp8_e4m3|fp8_e5m2) ", r.stdout, re.M)) == 15, v
        assert re.search(rf"^PASS {v}\s+argmax_rows ", r.stdout, re.M), v  # greedy sampling's row argmax
        # a chunk's attention rows bit for bit its decode steps (f32 / bf16 caches, 8 shapes each:
        # partition-grid crossings, prefill tiles, windows)
        assert len(re.findall(rf"^PASS {v}\s+attn rows == decode steps ", r.stdout, re.M)) == 16, v
        # a quantized MoE layer in one region (moe_q) bit for bit the per-expert calls: W8G, 4-bit with
        # offsets, 6-bit, GGUF K-quant experts (Q4_K-like gate/up, Q6_K-like down) and 5-bit
        assert len(re.findall(rf"^PASS {v}\s+moe_q ", r.stdout, re.M)) == 5, v
        assert re.search(rf"^PASS {v}\s+moe_q .*K-quant", r.stdout, re.M), v
        assert re.search(rf"^PASS {v}\s+moe_q .*5-bit", r.stdout, re.M), v
        # issue 19's GEMM grid (M 1/3/4/7/8/17/64 x K 64/576/1000/1001, N 100, and two large-magnitude
        # cancelling cases) for the float panel GEMM and the bf16 one with fp32 and bf16 activations
        # (BFDOT where the profile has BF16: v2, v1, max)
        for what in ("gemm_f32 grid", "gemm_bf16 x:f32", "gemm_bf16 x:bf16"):
            assert len(re.findall(rf"^PASS {v}\s+{what} M", r.stdout, re.M)) == 30, (v, what)
        # --batch-invariant: every GEMM's rows the same bits computed one at a time (each case of more
        # than one row above: the float grid's 26 per kernel, W8G's 7, low-bit 9 and K-quant 6)
        for what, n in (("gemm_f32 grid", 26), ("gemm_bf16 x:f32", 26), ("gemm_bf16 x:bf16", 26), ("w8g", 7),
                        ("wlow M", 9), ("wlow-kquant", 6)):
            assert len(re.findall(rf"^PASS {v}\s+rows == alone {what}[ =]", r.stdout, re.M)) == n, (v, what)


def disassemble(obj: Path) -> str:
    r = subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(obj)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


SVE_INSN = re.compile(r"\t(?:ld1w|ld1h|st1w|fmla|fmad|fmul|whilelo|faddv|ptrue)\s+[{]?z|\tptrue\s|\twhilelo\s")


def function_text(text: str, name: str) -> str:
    """The disassembly (objdump -d -C) of every function whose demangled name contains ``name``."""
    parts = re.split(r"\n(?=[0-9a-f]+ <)", text)
    return "\n".join(p for p in parts if name in p.split("\n", 1)[0])


def disassemble_demangled(obj: Path) -> str:
    r = subprocess.run(["aarch64-linux-gnu-objdump", "-d", "-C", "--no-show-raw-insn", str(obj)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


FMLA_LANE = re.compile(r"\tfmla\s+v\d+\.4s, v\d+\.4s, v\d+\.s\[[1-3]\]")
Q_STACK = re.compile(r"\t(?:ldr|str|ldp|stp)\s+q\d+,.*\[sp")


def test_panel_gemms_are_neon_micro_kernels(arm_build):
    """gemm_f32's and gemm_bf16's blocks are the explicit NEON micro-kernels of gemm_neon.inc in every Arm
    variant: FMLA by lane (k steps 1-3 of an activation register), the bf16 words widened by SHL and
    AND, and BFDOT by element in neon_bf16 and sve, with the accumulators in registers through the k loop
    (no q register stored to or loaded from the stack but the partial-panel epilogue's stores)."""
    for name in ("kernels_neon.o", "kernels_neon_bf16.o", "kernels_sve.o"):
        text = disassemble_demangled(arm_build / name)
        sg = function_text(text, "::sgemm_rows<2>")
        assert len(FMLA_LANE.findall(sg)) >= 3 * 16, name  # lanes 1..3 of 4 k steps x 8 columns x 2 rows
        assert len(Q_STACK.findall(sg)) <= 16, name  # only the tail's float t[32] (8 q per row)
        # the 2-row micro-kernel: a function of its own, or inlined into the block
        bg = function_text(text, "::bgemm_rows<2>") or function_text(text, "::bgemm_block<2>")
        assert re.search(r"\tshl\s+v\d+\.4s, v\d+\.4s, #16", bg), name
        assert re.search(r"\tand\s+v\d+\.16b", bg), name
        # 8 columns x 2 rows x 2 halves; GCC 12 keeps the first by lane and broadcasts x for the rest
        assert len(re.findall(r"\tfmla\s+v\d+\.4s, v\d+\.4s, v\d+\.(?:4s|s\[[01]\])", bg)) >= 32, name
        assert not Q_STACK.findall(bg), name
    # BFDOT: neon_bf16, and sve (in functions of their own +bf16 target, run where the CPU has BF16)
    for name in ("kernels_neon_bf16.o", "kernels_sve.o"):
        text = disassemble_demangled(arm_build / name)
        dot = function_text(text, "::bgemm_dot_rows<2>") or function_text(text, "::bgemm_block_dot<2>")
        assert len(re.findall(r"\tbfdot\s+v\d+\.4s, v\d+\.8h, v\d+\.2h\[[0-3]\]", dot)) >= 64, name
        assert not Q_STACK.findall(dot), name


def test_bf16_build_contains_bfmmla(arm_build):
    text = disassemble(arm_build / "kernels_neon_bf16.o")
    assert len(re.findall(r"\tbfmmla\s", text)) >= 4


def test_sve_build_contains_sve(arm_build):
    text = disassemble(arm_build / "kernels_sve.o")
    assert len(SVE_INSN.findall(text)) >= 20
    assert re.search(r"\tld1h\s+\{z\d+\.s\}", text)  # bf16 cache widened by LD1H


def test_arm_variants_contain_sdot_and_smmla(arm_build):
    """gemm_w8g_a8's inner products are SDOT (by-element form) and SMMLA in every Arm variant (run only
    when the CPU reports dotprod / i8mm; see native/neon_sve/src/neon/w8g_neon.inc)."""
    for name in ("kernels_neon.o", "kernels_neon_bf16.o", "kernels_sve.o"):
        text = disassemble(arm_build / name)
        assert len(re.findall(r"\tsdot\s+v\d+\.4s, v\d+\.16b, v\d+\.4b\[\d\]", text)) >= 16, name
        assert len(re.findall(r"\tsmmla\s+v\d+\.4s, v\d+\.16b, v\d+\.16b", text)) >= 8, name


def test_baseline_objects_have_no_sve_or_bf16(arm_build):
    """generic, neon and the dispatcher run on every core (N1 included): no SVE, no BF16."""
    for name in ("kernels_generic.o", "kernels_neon.o", "dispatch.o"):
        text = disassemble(arm_build / name)
        assert not SVE_INSN.search(text), name
        assert not re.search(r"\t(?:bfmmla|bfdot|bfcvt|bfcvtn)\s", text), name
