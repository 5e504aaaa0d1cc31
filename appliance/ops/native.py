"""Native CPU kernels (``native/neon_sve``): the same functions, signatures and semantics as
``appliance.ops.reference``, backed by a C++ torch extension.

The kernels are plain C++17 over raw pointers, one portable ``generic`` version plus ISA variants
(x86: ``avx2``, ``avx512``, ``avx512bf16``; Arm: ``neon``, ``neon_bf16`` with BFMMLA, ``sve``).
The extension picks the best variant the CPU supports once, at load time; ``APPLIANCE_KERNELS=<name>``
overrides it. Cases a kernel does not cover (a head size that is not a multiple of 16, float16
tensors, exotic layouts) fall back to the reference, so engines can swap the two modules freely.

Build: ``python -m appliance.ops.native --build`` (no network; needs a C++ compiler; uses ninja through
torch's JIT builder when installed, else calls the compiler directly).
The build is cached under ``$APPLIANCE_CACHE_DIR/native`` (default ``~/.cache/appliance/native``)
in a directory keyed by the torch version, Python, machine and a hash of the kernel sources, so
a source change rebuilds. On import nothing is built unless ``APPLIANCE_NATIVE_BUILD=1``: an
unbuilt extension makes ``is_available()`` false (the engine then uses the reference).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

from appliance.ops import reference
from appliance.ops.reference import kv_cache_shape, rotary_cos_sin_cache, softmax_scale  # noqa: F401
from appliance.ops.reference import kv_cache_is_quantized, kv_scale_shape  # noqa: F401

logger = logging.getLogger(__name__)

EXTENSION_NAME = "appliance_native"
# Prefill with no cached context runs through paged_attention too (attention.Attention): this kernel
# beats SDPA's per-sequence calls there, so the layer needn't special-case it.
PAGED_PREFILL = True
# Models whose every op runs here and whose linear layers are float (native, oneDNN or torch backend)
# may run all their decoder layers in one call (``llama_layers``: the same kernels in the same order,
# without the Python between them). False keeps the per-op path (tests compare the two).
# APPLIANCE_FUSED_LAYERS=0 sets it False in every process that imports this module, tensor-parallel
# workers included (they inherit the environment): how benchmarks and tests compare the paths under TP.
FUSED_LAYERS = os.environ.get("APPLIANCE_FUSED_LAYERS", "1") != "0"
# A row's attention output and its norms are the same bits whatever else the call holds (the
# attention's partitions and softmax chunks lie on fixed grids, tests/ops/test_attention_row_invariance.py):
# what --batch-invariant needs from the ops (the other ops modules do not say so).
ROW_INVARIANT = True
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# KV cache storage the kernels read and write: the float dtypes, and one byte per element with
# per-row float32 scales (reference.quantize_kv)
_KV_DTYPES = _SUPPORTED_DTYPES + (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def kv_scales_ok(cache: torch.Tensor, *scales: torch.Tensor | None) -> bool:
    """A quantized cache's scales as the kernels take them (else the reference runs; the one-call
    decoder stack, models/llama.py ``cached_fused_plan``, is not used); True for a float cache."""
    if not kv_cache_is_quantized(cache.dtype):
        return True
    # checked on every call: plain attribute tests (half the time of a generator over
    # tuple(s.shape) and s.device.type)
    want = kv_scale_shape(cache.shape[0], cache.shape[2], cache.shape[1])
    for s in scales:
        if s is None or s.dtype != torch.float32 or not s.is_cpu or s.shape != want or not s.is_contiguous():
            return False
    return True


def source_dir() -> Path:
    """``native/neon_sve`` of the source tree (``APPLIANCE_NATIVE_SRC`` overrides)."""
    env = os.environ.get("APPLIANCE_NATIVE_SRC")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "native" / "neon_sve"


def _sources(src: Path) -> list[Path]:
    files = [src / "bindings" / "torch_bindings.cpp", src / "dispatch" / "dispatch.cpp"]
    files += sorted((src / "src").glob("*/*.cpp"))
    return files


def _source_hash(src: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(src.rglob("*")):
        # shm/ is its own small library (appliance/distributed/shm_allreduce.py), not part of the extension
        if p.is_file() and p.suffix in (".cpp", ".h", ".inc") and "harness" not in p.parts and "shm" not in p.parts:
            h.update(str(p.relative_to(src)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    cache = Path(os.environ.get("APPLIANCE_CACHE_DIR", Path.home() / ".cache" / "appliance"))
    tag = (
        f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info.major}{sys.version_info.minor}"
        f"-{platform.machine()}-{_source_hash(source_dir())}"
    )
    return cache / "native" / tag


# No -march: variants carry their ISA in target pragmas and the dispatcher checks the CPU, so the
# same build runs on every machine of the architecture.
_CFLAGS = ["-O3", "-fopenmp", "-Wno-maybe-uninitialized"]


def _include_dirs(src: Path) -> list[str]:
    return [str(src / "include"), str(src / "src" / "x86"), str(src / "src" / "neon")]


def build(verbose: bool = False) -> ModuleType:
    """Compile (or reuse) the extension and import it: torch's JIT builder when ninja is
    installed, else a direct compiler invocation (same flags, no ninja needed)."""
    from torch.utils import cpp_extension

    src = source_dir()
    if not (src / "include" / "appliance_kernels.h").exists():
        raise RuntimeError(f"native kernel sources not found at {src} (set APPLIANCE_NATIVE_SRC)")
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    if not cpp_extension.is_ninja_available() or os.environ.get("APPLIANCE_NATIVE_NO_NINJA"):
        _build_without_ninja(src, out, verbose)
        mod = _import_built()
        assert mod is not None
        return mod
    return cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[str(p) for p in _sources(src)],
        extra_include_paths=_include_dirs(src),
        extra_cflags=_CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(out),
        verbose=verbose,
    )


def build_plan(src: Path | None = None, out: Path | None = None, cxx: str | None = None) -> dict:
    """The compiler invocations of a build without ninja, as data: ``{"compile": [argv, ...], "link":
    argv, "tmp": path the link writes, "target": the library it is then renamed to}``. ``cxx``
    defaults to ``$CXX`` or ``c++``. ``python -m appliance.ops.native --build-plan`` prints it as JSON:
    scripts/arm64/cross_build_native.py runs it inside an arm64 root and executes the commands on the
    x86-64 host with the cross compiler, so the root's own torch, Python and cache paths decide them."""
    import sysconfig

    from torch.utils import cpp_extension

    src = src or source_dir()
    out = out or build_dir()
    cxx = cxx or os.environ.get("CXX", "c++")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = [
        "-fPIC", "-std=c++17", *_CFLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-DTORCH_EXTENSION_NAME={EXTENSION_NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
        *[f"-I{d}" for d in _include_dirs(src)],
        *[f"-isystem{d}" for d in cpp_extension.include_paths()],
        f"-isystem{sysconfig.get_paths()['include']}",
    ]
    compiles = [[cxx, *flags, "-c", str(p), "-o", str(out / f"{p.parent.name}_{p.stem}.o")] for p in _sources(src)]
    libs = [f"-L{d}" for d in cpp_extension.library_paths()] + ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    tmp = out / f"{EXTENSION_NAME}.so.tmp{os.getpid()}"
    link = [cxx, "-shared", "-fopenmp", *(c[-1] for c in compiles), *libs, "-o", str(tmp)]
    return {"compile": compiles, "link": link, "tmp": str(tmp), "target": str(out / f"{EXTENSION_NAME}.so")}


def _build_without_ninja(src: Path, out: Path, verbose: bool) -> None:
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    target = out / f"{EXTENSION_NAME}.so"
    if target.exists():  # the directory name already keys the sources
        return
    plan = build_plan(src, out)

    def compile_one(cmd: list[str]) -> None:
        if verbose:
            print(" ".join(cmd), flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"compiling {Path(cmd[cmd.index('-c') + 1]).name} failed:\n{r.stderr[-4000:]}")

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(compile_one, plan["compile"]))
    r = subprocess.run(plan["link"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"linking {EXTENSION_NAME} failed:\n{r.stderr[-4000:]}")
    os.replace(plan["tmp"], target)  # atomic: a concurrent reader never sees a half-written library


def _import_built() -> ModuleType | None:
    path = build_dir() / f"{EXTENSION_NAME}.so"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(EXTENSION_NAME, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_lock = threading.Lock()
_ext: ModuleType | None = None
_reason: str | None = None


def _load() -> ModuleType | None:
    global _ext, _reason
    if _ext is not None or _reason is not None:
        return _ext
    with _lock:
        if _ext is not None or _reason is not None:
            return _ext
        try:
            mod = _import_built()
            if mod is None:
                if os.environ.get("APPLIANCE_NATIVE_BUILD", "0") in ("", "0"):
                    _reason = (
                        f"not built for this source tree ({build_dir()} missing); run "
                        "`python -m appliance.ops.native --build` or set APPLIANCE_NATIVE_BUILD=1"
                    )
                    return None
                mod = build()
            _ext = mod
            logger.info(
                "native kernels: %s selected (available: %s; cpu: %s)",
                mod.kernel_variant(), ", ".join(mod.available_variants()), mod.cpu_features(),
            )
        except Exception as e:  # a failed build or import leaves the reference in charge
            _reason = f"{type(e).__name__}: {e}"
    return _ext


def is_available() -> bool:
    return _load() is not None


def unavailable_reason() -> str:
    _load()
    return _reason or ""


def _require() -> ModuleType:
    mod = _load()
    if mod is None:
        raise RuntimeError(f"native kernels unavailable: {_reason}")
    return mod


def kernel_variant() -> str:
    """Name of the variant in use (``generic``, ``avx2``, ``avx512``, ``avx512bf16``, ``neon``,
    ``neon_bf16``, ``sve``)."""
    return _require().kernel_variant()


def available_variants() -> list[str]:
    """Variants this CPU can run, best first (always ends with ``generic``)."""
    return list(_require().available_variants())


def cpu_features() -> str:
    return _require().cpu_features()


def set_variant(name: str) -> None:
    """Switch the process-wide variant (tests force each one). Raises if the CPU lacks it."""
    if not _require().set_variant(name):
        raise ValueError(
            f"kernel variant {name!r} is not available on this CPU; available: {available_variants()}"
        )


@contextlib.contextmanager
def use_variant(name: str) -> Iterator[None]:
    prev = kernel_variant()
    set_variant(name)
    try:
        yield
    finally:
        set_variant(prev)


def exp_approx(x: torch.Tensor) -> torch.Tensor:
    """The variant's vectorized polynomial exp (float32), exposed to test its error bound."""
    y = x.detach().to(torch.float32).contiguous().clone()
    _require().exp_(y)
    return y


# ---------------------------------------------------------------------------------------------
# The ops: same signatures as reference.py.


def _native_ok(*tensors: torch.Tensor) -> bool:
    return (_ext is not None or _load() is not None) and all(t.device.type == "cpu" for t in tensors)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each token's K and V into its slot. Negative slots are skipped (padding). A quantized
    cache gets codes and per-row scales (``reference.quantize_kv``, bit for bit)."""
    if (
        not _native_ok(key, key_cache)
        or key.dtype not in _SUPPORTED_DTYPES
        or value.dtype != key.dtype
        or key_cache.dtype not in _KV_DTYPES
        or value_cache.dtype != key_cache.dtype
        or key.dim() != 3
        or key.stride(-1) != 1
        or value.stride(-1) != 1
        or not key_cache.is_contiguous()
        or not value_cache.is_contiguous()
        or not kv_scales_ok(key_cache, k_scale, v_scale)
    ):
        return reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    _ext.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping.to(torch.int64).contiguous(),
                           k_scale, v_scale)


def _i32(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous int32, itself when it already is (two attribute tests instead of two dispatches)."""
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context, optionally within a
    sliding window of ``sliding_window`` keys and with soft-capped scores, over a float or quantized
    cache (see ``reference.paged_attention``). ``[num_tokens, num_heads, head_size]`` in query's dtype."""
    head_size = query.shape[-1]
    if (
        not _native_ok(query, key_cache)
        or query.dim() != 3
        or query.dtype not in _SUPPORTED_DTYPES
        or key_cache.dtype not in _KV_DTYPES
        or value_cache.dtype != key_cache.dtype
        or head_size % 16 != 0
        or query.shape[1] % key_cache.shape[1] != 0
        or not key_cache.is_contiguous()
        or not value_cache.is_contiguous()
        or not kv_scales_ok(key_cache, k_scale, v_scale)
    ):
        return reference.paged_attention(
            query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, max_query_len,
            sliding_window, logits_soft_cap, k_scale, v_scale,
        )
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype)
    bt = block_table if block_table.dtype == torch.int32 and block_table.stride(-1) == 1 else (
        block_table.to(torch.int32).contiguous()
    )
    _ext.paged_attention(
        query, key_cache, value_cache, bt,
        _i32(seq_lens), _i32(query_start_loc),
        float(scale), out, int(sliding_window), float(logits_soft_cap), k_scale, v_scale,
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim; math in float32."""
    if not _native_ok(x) or x.dtype not in _SUPPORTED_DTYPES or weight.dtype not in _SUPPORTED_DTYPES:
        return reference.rms_norm(x, weight, eps)
    x = x.contiguous()
    out = torch.empty_like(x)
    _ext.rms_norm(x, weight.contiguous(), float(eps), out)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x; return rms_norm(residual), residual``. Updates ``residual`` in place."""
    if (
        not _native_ok(x, residual)
        or x.dtype not in _SUPPORTED_DTYPES
        or residual.dtype not in _SUPPORTED_DTYPES
        or weight.dtype not in _SUPPORTED_DTYPES
        or not residual.is_contiguous()
        or x.shape != residual.shape
    ):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    out = torch.empty_like(residual)
    _ext.fused_add_rms_norm(x.contiguous(), residual, weight.contiguous(), float(eps), out)
    return out, residual


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``rotary_dim`` dims of q and k (new tensors). neox: halves; gptj: pairs."""
    rot_dim = cos_sin_cache.shape[-1]
    if (
        not _native_ok(query, key)
        or query.dim() != 3
        or key.dim() != 3
        or query.dtype not in _SUPPORTED_DTYPES
        or key.dtype not in _SUPPORTED_DTYPES
        or rot_dim % 2 != 0
        or rot_dim > min(query.shape[-1], key.shape[-1])
    ):
        return reference.rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
    cs = cos_sin_cache if cos_sin_cache.dtype == torch.float32 else cos_sin_cache.float()
    cs = cs.contiguous()
    pos = positions.to(torch.int64).contiguous()
    out = []
    for x in (query, key):
        if x.stride(-1) != 1 or x.stride(1) != x.shape[-1]:  # heads not adjacent: make them so
            x = x.contiguous()
        o = torch.empty(x.shape, dtype=x.dtype)  # one pass: read x (a q/k/v view is fine), write o
        _ext.rotary_embedding(pos, x, cs, bool(is_neox), o)
        out.append(o)
    return out[0], out[1]


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum along the last dim, as ``torch.argmax`` (NaN counts as the maximum).
    float32 rows in parallel, vectorized; torch's own CPU argmax runs ~10x slower on decode logits
    (0.9 ms for 64 x 49152)."""
    if not _native_ok(x) or x.dtype != torch.float32 or x.dim() != 2 or x.shape[-1] == 0 or x.stride(-1) != 1:
        return reference.argmax(x)
    return _ext.argmax_rows(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` where the last dim is ``2d``."""
    if not _native_ok(x) or x.dtype not in _SUPPORTED_DTYPES or x.shape[-1] % 2 != 0:
        return reference.silu_and_mul(x)
    x = x.contiguous()
    out = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype)
    _ext.silu_and_mul(x, out)
    return out


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """``gelu(x[..., :d]) * x[..., d:]`` (see ``reference.gelu_and_mul``). No kernel of its own yet: torch's
    CPU GELU is vectorized already, and the GeGLU models (Gemma) spend their time in the GEMMs."""
    return reference.gelu_and_mul(x, approximate)


def gemm_w8g_a8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, wsum: torch.Tensor, n: int, group: int,
                has_m128: bool) -> torch.Tensor:
    """W8A8 with group-wise weight scales: x [M, K] float32 -> [M, n] float32, over weights packed by
    ``appliance.layers.quant.pack("w8a8_native", ...)`` (layout: ``W8GArgs`` in
    native/neon_sve/include/appliance_kernels.h). No reference fallback: the backend is offered only
    when the extension is available."""
    return _require().gemm_w8g_a8(x, w, scale, wsum, n, group, has_m128)


def gemm_wlow_a8(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                 n: int, group: int, bits: int) -> torch.Tensor:
    """Low-bit (4 or 6 bits) weights with int8 activations: x [M, K] float32 -> [M, n] float32, over
    weights packed by ``appliance.layers.methods.lowbit`` (layout: ``WLowArgs`` in
    native/neon_sve/include/appliance_kernels.h; ``hi`` / ``offset`` empty when unused)."""
    return _require().gemm_wlow_a8(x, lo, hi, scale, offset, n, group, bits)


def gemm_wlow_kq_a8(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, kf: torch.Tensor, k8: torch.Tensor,
                    n: int, group: int, bits: int, super_block: int, centre: int) -> torch.Tensor:
    """``gemm_wlow_a8`` with a GGUF K-quant's own scales (``WLowArgs``' ksuper > 0): ``kf`` float32 (row
    sums, super-block scales and mins), ``k8`` int8 (sub-block scales and mins), as
    ``appliance.layers.methods.lowbit.pack_kquant`` packs them."""
    return _require().gemm_wlow_kq_a8(x, lo, hi, kf, k8, n, group, bits, super_block, centre)


def pack_wlow_planes(q: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``WLowArgs`` planes of a canonical weight ``q`` int8 [N, K] whose values fit ``bits`` (the
    caller checks): (lo uint8 [T, K/8, 16, 4], hi uint8 [T, K/16, 16, 4] or empty for 4 bits, the
    int32 sum of q per group [16 T, K/group], 0 on the padding rows); T = ceil(N / 16)."""
    lo, hi, qsum = _require().pack_wlow_planes(q.contiguous(), bits, group)
    return lo, hi, qsum


SGEMM_PANEL = 32  # output columns per prepacked panel (kSgemmPanel in appliance_kernels.h)


def pack_f32(w: torch.Tensor) -> torch.Tensor:
    """Prepack a float32 weight [N, K] for ``gemm_f32``: panels of 32 output rows, K-major inside
    (``[ceil(N/32), K, 32]``, zero rows past N)."""
    n, k = w.shape
    p = -(-n // SGEMM_PANEL)
    wf = w.detach().to(torch.float32)
    if p * SGEMM_PANEL != n:
        wf = torch.cat([wf, wf.new_zeros(p * SGEMM_PANEL - n, k)])
    return wf.view(p, SGEMM_PANEL, k).transpose(1, 2).contiguous()


def gemm_f32(x: torch.Tensor, wp: torch.Tensor, bias: torch.Tensor | None, n: int,
             silu_mul: bool = False) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for float32 ``x [..., K]`` over ``wp = pack_f32(W)``. ``silu_mul``: W's rows
    were interleaved by ``gate_up_order`` and the result is ``silu(gate) * up`` (``[..., n/2]``), the
    MLP's gate/up projection and ``silu_and_mul`` in one pass. No reference fallback: the backend is
    offered only when the extension is available."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    return _require().gemm_f32(x2, wp, bias, n, silu_mul).view(*lead, n // 2 if silu_mul else n)


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """Prepack a weight [N, K] in bfloat16 for ``gemm_bf16``: panels of 32 output rows with the k steps in
    pairs, ``[ceil(N/32), ceil(K/2), 32, 2]`` (element [p, kk, j, i] = W[32p + j, 2kk + i]; zero past N
    and K). Each (j, kk) pair is one 32-bit word: the operand of the bf16 dot products and, widened with
    a shift and a mask, of fp32 FMAs (``gemm_bf16`` in native/neon_sve/include/appliance_kernels.h)."""
    n, k = w.shape
    p, k2 = -(-n // SGEMM_PANEL), -(-k // 2)
    wb = torch.zeros(p * SGEMM_PANEL, 2 * k2, dtype=torch.bfloat16)
    wb[:n, :k] = w.detach()
    return wb.view(p, SGEMM_PANEL, k2, 2).permute(0, 2, 1, 3).contiguous()


def gemm_bf16(x: torch.Tensor, wp: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x @ W.T (+ bias)`` over ``wp = pack_bf16(W)`` for bfloat16 or float32 ``x [..., K]``, in x's dtype:
    fp32 accumulation (bf16 x bf16 products are exact in fp32), the bias added in fp32, one rounding to
    x's dtype. No reference fallback: the backend is offered only when the extension is available."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    return _require().gemm_bf16(x2, wp, bias, n).view(*lead, n)


def llama_layers(embeds: torch.Tensor, positions: torch.Tensor, layers: list[torch.Tensor], kinds: list[int],
                 windows: list[int], final_norm_w: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate: int, scale: float, cos_sin: torch.Tensor, slot_mapping: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 all_reduce: tuple[int, int] = (0, 0), extras: list[torch.Tensor] = (), act: int = 0,
                 logits_soft_cap: float = 0.0, kv_scales: list[torch.Tensor] = ()) -> torch.Tensor:
    """Every decoder layer of a Llama-family model and its final norm in one native call (see
    ``llama_layers`` in native/neon_sve/bindings/torch_bindings.cpp for the 26 tensors per layer;
    ``kinds``: the ``LinearKind`` and 3 ints of its q/k/v, o, gate/up and down projections, from their linear
    methods' ``fused_descriptor``, appliance/layers/methods; ``windows``: each layer's sliding window,
    0 for full attention). Under tensor parallelism the head counts and ``intermediate`` are this rank's,
    and ``all_reduce`` is the communicator's ``native_all_reduce()`` (function address, handle): the
    stack sums o_proj's and down_proj's partial outputs through it; (0, 0) on one rank.

    Gemma 2/3 (models/gemma.py) add what a Llama call leaves at its default: ``extras``, 3 tensors per layer
    (pre- and post-feed-forward norm factors, the layer's own cos/sin table or an empty tensor for
    ``cos_sin``) making each layer sandwich-normed; ``act`` the gate's activation (``ACT_SILU``,
    ``ACT_GELU_TANH``, ``ACT_GELU``); ``logits_soft_cap`` the attention scores' cap (0: none).

    A quantized KV cache (``--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2``) comes with ``kv_scales``: per layer
    its k_scale then v_scale (``reference.kv_scale_shape``), which the stack writes and reads as the per-op
    path's ``reshape_and_cache`` and ``paged_attention`` do; empty for float caches."""
    return _require().llama_layers(embeds, positions, layers, kinds, windows, final_norm_w, float(eps), num_heads,
                                   num_kv_heads, head_dim, intermediate, float(scale), cos_sin, slot_mapping,
                                   block_table, seq_lens, query_start_loc, int(all_reduce[0]), int(all_reduce[1]),
                                   list(extras), int(act), float(logits_soft_cap), list(kv_scales))


# llama_layers' ``act``: the gate's activation (Activation in native/neon_sve/bindings/torch_bindings.cpp)
ACT_SILU, ACT_GELU_TANH, ACT_GELU = 0, 1, 2


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: list[torch.Tensor],
                kinds: list[int], intermediate: int, per_expert: bool = False) -> torch.Tensor:
    """One mixture-of-experts layer's experts in one native call: ``sum_k weights[t, k] *
    expert[ids[t, k]](x[t])`` for x ``[T, hidden]``, ids and weights ``[T, top_k]`` (see ``moe_experts``
    in native/neon_sve/bindings/torch_bindings.cpp): ``experts`` holds per expert its gate/up then its
    down projection as ``llama_layers`` takes a projection (weight, bias, 3 aux tensors), ``kinds`` their
    ``LinearKind`` and 3 ints, from the linear methods' ``fused_descriptor``.

    Float32 native experts run in one parallel region (the kernels' ``moe_f32``), and so do quantized
    ones on one W8A8 / low-bit kind per projection, GGUF K-quant scales included (``moe_q``: each
    token's activation quantized once, (expert, tile) work items over the threads); others, or all with
    ``per_expert``, run each touched expert's projections once on its rows (the reference the one-region
    paths are tested against)."""
    return _require().moe_experts(x, ids, weights, experts, kinds, int(intermediate), bool(per_expert))


def moe_q_calls() -> int:
    """How many ``moe_experts`` calls ran the quantized one-region path (``moe_q``) in this process."""
    return int(_require().moe_q_calls())


def gate_up_order(intermediate: int) -> torch.Tensor | None:
    """Row order of a fused [gate; up] weight (2 * ``intermediate`` rows) that puts 16 gate rows and
    their 16 up rows in each 32-row panel, for ``gemm_f32(silu_mul=True)``; None when the size does
    not split into such panels."""
    h = SGEMM_PANEL // 2
    if intermediate % h:
        return None
    g = torch.arange(intermediate).view(-1, h)
    return torch.stack([g, g + intermediate], dim=1).reshape(-1)


def _main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m appliance.ops.native", description=__doc__.split("\n")[0])
    p.add_argument("--build", action="store_true", help="compile the extension (cached) and report")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--build-plan", action="store_true",
                   help="print the compile and link commands of a build without ninja as JSON, and exit")
    args = p.parse_args(argv)
    if args.build_plan:
        import json

        print(json.dumps(build_plan()))
        return 0
    global _ext, _reason
    if args.build:
        try:
            _ext, _reason = build(verbose=args.verbose), None
        except Exception as e:
            print(f"native kernels: build failed: {e}", file=sys.stderr)
            return 1
    if not is_available():
        print(f"native kernels: unavailable: {unavailable_reason()}", file=sys.stderr)
        return 1
    print(f"native kernels: {build_dir()}")
    print(f"  cpu: {cpu_features()}")
    print(f"  selected: {kernel_variant()}  available: {', '.join(available_variants())}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
