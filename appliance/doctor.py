"""``appliance doctor [--json]``: what this machine, this torch and this install give the engine, and
each problem with the exact command that fixes it.

It reports on every floor (CPU, runtime, torch build, kernel choice), so it sits at the top of the
package and imports lazily: a broken torch or an unbuilt native extension is a finding, not a crash.
``doctor_report()`` returns a dict that validates against ``SCHEMA`` (checked by ``validate``, a
small JSON-Schema subset: type, properties, required, additionalProperties, items, enum).
"""
from __future__ import annotations

import ctypes
import os
import platform
import re
import sys
from pathlib import Path

ARM_FEATURES = ("asimd", "asimddp", "bf16", "i8mm", "sve", "sve2", "atomics")
X86_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
SEVERITIES = ("error", "warning", "info")

_S, _I, _B, _N = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "null"}


def _opt(t: dict) -> dict:
    return {"anyOf": [t, _N]}


def _obj(props: dict, required: list[str] | None = None, extra: bool = False) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": extra}


SCHEMA: dict = _obj({
    "schema_version": {"type": "integer", "enum": [1]},
    "cpu": _obj({
        "arch": _S, "model": _S,
        "features": {"type": "object", "additionalProperties": _B},
        "sve_vector_bits": _opt(_I),
        "native_bf16": _B,
    }),
    "cores": _obj({
        "logical": _I, "physical": _I, "usable": {"type": "array", "items": _I},
        "numa_nodes": {"type": "object", "additionalProperties": {"type": "array", "items": _I}},
    }),
    "memory": _obj({"total_gib": {"type": "number"}, "available_gib": {"type": "number"}}),
    "torch": _obj({
        "version": _opt(_S), "cuda": _opt(_S), "cpu_capability": _opt(_S), "mkldnn": _opt(_B),
        "mkldnn_bf16": _opt(_B), "acl": _opt(_B), "kleidiai": _opt(_B), "mimalloc_static": _opt(_B),
        "openmp": _opt(_S), "num_threads": _opt(_I), "build_settings": {"type": "object"},
        "error": _opt(_S),
    }),
    "onednn": _obj({"implementation": _opt(_S), "isa": _opt(_S), "error": _opt(_S)}),
    "kernels": _obj({"available": _B, "variant": _opt(_S), "variants": {"type": "array", "items": _S},
                     "reason": _opt(_S)}),
    "linear_backends": {"type": "object", "additionalProperties": _obj({
        "dtype": _S, "available": _B, "reason": _opt(_S)})},
    "allocator": _obj({
        "this_process": {"type": "object"},
        "mimalloc_found": _opt(_S), "mimalloc_version": _opt(_S), "serve_default": _S,
    }),
    "libgomp": {"type": "object", "required": ["mapped", "torch_bundled", "preload_choice", "classification"]},
    "omp": _obj({"env": {"type": "object", "additionalProperties": _opt(_S)},
                 "recommended": _obj({"spec": _S, "num_threads": _I, "cpus": _opt({"type": "array", "items": _I}),
                                      "env": {"type": "object", "additionalProperties": _S},
                                      "warnings": {"type": "array", "items": _S}})}),
    "ranks": _obj({"numa_nodes": _I, "memory_binding": _S, "error": _opt(_S),
                   "auto_2_ranks": _opt({"type": "array", "items": _obj({
                       "rank": _I, "num_threads": _I, "cpus": _opt({"type": "array", "items": _I}),
                       "numa_node": _opt(_I), "bind_memory": _B})})}),
    "placement": _obj({"tensor_parallel_size": _opt(_I), "data_parallel_size": _opt(_I),
                       "omp_threads_bind": _opt(_S), "num_threads": _opt(_I), "error": _opt(_S),
                       "ranks": {"type": "array", "items": _obj({
                           "replica": _I, "rank": _I, "num_threads": _I,
                           "cpus": _opt({"type": "array", "items": _I}), "numa_node": _opt(_I), "bind_memory": _B,
                           "omp_places": _opt(_S), "describe": _S})}}),
    "problems": {"type": "array", "items": _obj({"severity": {"type": "string", "enum": list(SEVERITIES)},
                                                 "what": _S, "fix": _S})},
})


def validate(instance, schema: dict = SCHEMA, path: str = "$") -> list[str]:
    """Errors of ``instance`` against ``schema`` (the subset SCHEMA uses); empty when valid."""
    errs: list[str] = []
    if "anyOf" in schema:
        if all(validate(instance, s, path) for s in schema["anyOf"]):
            errs.append(f"{path}: matches none of {schema['anyOf']}")
        return errs
    t = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if t == "integer":
        ok = isinstance(instance, int) and not isinstance(instance, bool)
    elif t == "number":
        ok = isinstance(instance, (int, float)) and not isinstance(instance, bool)
    elif t is not None:
        ok = isinstance(instance, types[t])
    else:
        ok = True
    if not ok:
        return [f"{path}: expected {t}, got {type(instance).__name__}"]
    if "enum" in schema and instance not in schema["enum"]:
        errs.append(f"{path}: {instance!r} not in {schema['enum']}")
    if isinstance(instance, dict):
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            if k not in instance:
                errs.append(f"{path}: missing {k!r}")
        extra = schema.get("additionalProperties", True)
        for k, v in instance.items():
            if k in props:
                errs += validate(v, props[k], f"{path}.{k}")
            elif extra is False:
                errs.append(f"{path}: unexpected key {k!r}")
            elif isinstance(extra, dict):
                errs += validate(v, extra, f"{path}.{k}")
    if isinstance(instance, list) and "items" in schema:
        for i, v in enumerate(instance):
            errs += validate(v, schema["items"], f"{path}[{i}]")
    return errs


# -- the sections --------------------------------------------------------------------------------
def _sve_vector_bits() -> int | None:
    if platform.machine() not in ("aarch64", "arm64"):
        return None
    try:
        prctl = ctypes.CDLL(None).prctl
        vl = prctl(51, 0, 0, 0, 0)  # PR_SVE_GET_VL: low 16 bits are the vector length in bytes
    except (OSError, AttributeError):
        return None
    return (vl & 0xFFFF) * 8 if vl > 0 else None


def _cpu() -> dict:
    from appliance.runtime.cpu_features import detect

    c = detect()
    names = ARM_FEATURES if c.arch == "aarch64" else X86_FEATURES
    return {"arch": c.arch, "model": c.model_name, "features": {n: c.has(n) for n in names},
            "sve_vector_bits": _sve_vector_bits() if c.has("sve") else None, "native_bf16": c.native_bf16}


def _cores() -> dict:
    from appliance.runtime.threads import numa_nodes, one_cpu_per_core

    usable = sorted(os.sched_getaffinity(0))
    return {"logical": os.cpu_count() or len(usable), "physical": len(one_cpu_per_core(list(range(os.cpu_count() or 1)))),
            "usable": usable, "numa_nodes": {str(k): v for k, v in numa_nodes().items()}}


def _memory() -> dict:
    try:
        import psutil

        vm = psutil.virtual_memory()
        return {"total_gib": round(vm.total / 2**30, 2), "available_gib": round(vm.available / 2**30, 2)}
    except ImportError:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        kib = lambda k: int(info.get(k, "0 kB").split()[0])  # noqa: E731
        return {"total_gib": round(kib("MemTotal") / 2**20, 2), "available_gib": round(kib("MemAvailable") / 2**20, 2)}


def _build_settings(show: str) -> dict:
    m = re.search(r"Build settings: (.*)", show)
    if not m:
        return {}
    return {k.strip(): v.strip() for k, _, v in (kv.partition("=") for kv in m.group(1).split(", ")) if k.strip()}


def _torch() -> dict:
    out = {"version": None, "cuda": None, "cpu_capability": None, "mkldnn": None, "mkldnn_bf16": None,
           "acl": None, "kleidiai": None, "mimalloc_static": None, "openmp": None, "num_threads": None,
           "build_settings": {}, "error": None}
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - an unimportable torch is the finding
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    show = torch.__config__.show()
    settings = _build_settings(show)
    keep = ("BLAS_INFO", "TORCH_VERSION", "USE_CUDA", "USE_MKL", "USE_MKLDNN", "USE_MKLDNN_ACL", "USE_OPENMP",
            "USE_KLEIDIAI", "USE_MIMALLOC", "USE_MIMALLOC_ON_MKL", "CXX_COMPILER", "LAPACK_INFO")
    out["build_settings"] = {k: v for k, v in settings.items() if k in keep}
    out["version"] = torch.__version__
    out["cuda"] = torch.version.cuda
    try:
        out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001
        pass
    out["mkldnn"] = bool(torch.backends.mkldnn.is_available())
    try:
        out["mkldnn_bf16"] = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001
        pass
    # aarch64 wheels whose build settings do not say (2.10.0's) ship ACL as torch/lib/libarm_compute*.so
    out["acl"] = (("acl" in show.lower()) or settings.get("USE_MKLDNN_ACL") in ("1", "ON")
                  or any((Path(torch.__file__).parent / "lib").glob("libarm_compute*")))
    kl = getattr(torch.backends, "kleidiai", None)
    out["kleidiai"] = bool(kl.is_available()) if kl is not None and hasattr(kl, "is_available") else None
    mim = settings.get("USE_MIMALLOC")
    if mim is not None:
        out["mimalloc_static"] = mim in ("1", "ON")
    else:
        libc10 = Path(torch.__file__).parent / "lib" / "libc10.so"
        try:
            out["mimalloc_static"] = b"mi_malloc" in libc10.read_bytes()
        except OSError:
            pass
    m = re.search(r"OpenMP (\d+[^\n]*)", show)
    out["openmp"] = m.group(1).strip() if m else None
    out["num_threads"] = torch.get_num_threads()
    return out


def _onednn() -> dict:
    """The implementation oneDNN runs for the ``onednn`` linear backend (a prepacked float32 linear) on
    this CPU, and the ISA it says it targets, from its verbose log: ``acl`` on Arm (the Arm Compute
    Library), ``brg_matmul:avx2`` and the like on x86; a ``ref`` one would be its slow reference."""
    out: dict = {"implementation": None, "isa": None, "error": None}
    try:
        import tempfile

        import torch

        if not torch.backends.mkldnn.is_available():
            out["error"] = "torch is built without oneDNN (mkldnn)"
            return out
        w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 64), 32)
        x = torch.randn(4, 64)
        libc = ctypes.CDLL(None)
        sys.stdout.flush()
        saved = os.dup(1)
        with tempfile.TemporaryFile() as f:
            os.dup2(f.fileno(), 1)  # oneDNN prints its verbose lines to the C stdout
            try:
                with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            finally:
                libc.fflush(None)
                os.dup2(saved, 1)
                os.close(saved)
            f.seek(0)
            log = f.read().decode(errors="replace")
    except Exception as e:  # noqa: BLE001 - a failing probe is the finding
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    for line in log.splitlines():
        fields = line.split(",")
        if fields[0] != "onednn_verbose":
            continue
        if "exec" in fields and out["implementation"] is None:
            i = fields.index("exec")  # onednn_verbose,v1,primitive,exec,cpu,<primitive>,<implementation>,...
            if len(fields) > i + 3:
                out["implementation"] = fields[i + 3]
        elif len(fields) > 1 and fields[-1].startswith("isa:"):
            out["isa"] = fields[-1][4:].strip()
    if out["implementation"] is None:
        out["error"] = "oneDNN logged no primitive execution"
    return out


def _kernels() -> dict:
    try:
        from appliance.ops import native
    except Exception as e:  # noqa: BLE001 - not built / not importable is the finding
        return {"available": False, "variant": None, "variants": [], "reason": f"not importable: {e}"}
    try:
        if not native.is_available():
            return {"available": False, "variant": None, "variants": [], "reason": native.unavailable_reason()}
        return {"available": True, "variant": native.kernel_variant(), "variants": list(native.available_variants()),
                "reason": None}
    except Exception as e:  # noqa: BLE001
        return {"available": False, "variant": None, "variants": [], "reason": f"{type(e).__name__}: {e}"}


def _linear_backends() -> dict:
    """Every linear backend: whether it can run on this host (its dtype: float32 for the quantized
    ones, which take float32 activations), and if not, why. A withdrawn backend is never a candidate
    of ``auto`` and is refused when named."""
    try:
        import torch

        from appliance.config import LINEAR_BACKENDS
        from appliance.layers.linear import host_problem
    except Exception as e:  # noqa: BLE001 - a broken torch is reported under "torch"
        return {"error": {"dtype": "", "available": False, "reason": f"{type(e).__name__}: {e}"}}
    out = {}
    for name in LINEAR_BACKENDS[1:]:
        # native_bf16 runs bfloat16 layers only: reported under its own name with that dtype
        dtypes = ((torch.float32, torch.bfloat16) if name in ("torch", "onednn", "native")
                  else (torch.bfloat16,) if name == "native_bf16" else (torch.float32,))
        for dtype in dtypes:
            why = host_problem(name, dtype, torch.device("cpu"))
            key = name if dtype == dtypes[0] else f"{name}:bfloat16"
            out[key] = {"dtype": str(dtype).removeprefix("torch."), "available": why is None, "reason": why}
    return out


def _allocator() -> dict:
    from appliance.runtime import allocator as a

    try:
        lib = a.find_mimalloc()
    except Exception:  # noqa: BLE001 - a bad APPLIANCE_MIMALLOC is reported as not found
        lib = None
    # In-process check first: loading the file for its version maps it (without making it live).
    this = a.allocator_in_use()
    return {"this_process": this, "mimalloc_found": str(lib) if lib else None,
            "mimalloc_version": a.format_version(a.library_version(lib)) if lib else None,
            "serve_default": "mimalloc" if lib else "glibc-tuned"}


def _omp() -> dict:
    from appliance.runtime import threads

    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "OMP_SCHEDULE",
                                           "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LD_PRELOAD")}
    p = threads.resolve("auto")
    return {"env": env, "recommended": {"spec": p.spec, "num_threads": p.num_threads,
                                        "cpus": list(p.cpus) if p.cpus else None,
                                        "env": threads.omp_env(p), "warnings": list(p.warnings)}}


def _ranks() -> dict:
    """What ``--omp-threads-bind auto`` would give 2 tensor/data parallel ranks on this host."""
    from appliance.errors import ApplianceError
    from appliance.runtime import threads

    out = {"numa_nodes": len(threads.numa_nodes()), "memory_binding": threads.memory_binding_support(),
           "error": None, "auto_2_ranks": None}
    try:
        out["auto_2_ranks"] = [{"rank": i, "num_threads": p.num_threads, "cpus": list(p.cpus) if p.cpus else None,
                                "numa_node": p.numa_node, "bind_memory": p.bind_memory}
                               for i, p in enumerate(threads.resolve_ranks("auto", 2))]
    except ApplianceError as e:
        out["error"] = str(e)
    return out


def placement_plan(tensor_parallel_size: int | None = None, data_parallel_size: int | None = None,
                   omp_threads_bind: str | None = None, num_threads: int | None = None) -> dict:
    """Each rank's placement as ``appliance serve`` with these flags would make it on this host (one
    row per data-parallel replica x tensor-parallel rank; the flags not given come from APPLIANCE_* and
    VLLM_CPU_OMP_THREADS_BIND / VLLM_CPU_NUM_OF_RESERVED_CPU as serve reads them), or the error serve
    would refuse them with. Ranks Ray places on other hosts are planned there, at start (not shown)."""
    from appliance import vllm_compat
    from appliance.config import EngineConfig
    from appliance.errors import ApplianceError
    from appliance.runtime import threads
    from appliance.server.dp_client import replica_rank_groups

    given = {"tensor_parallel_size": tensor_parallel_size, "data_parallel_size": data_parallel_size,
             "omp_threads_bind": omp_threads_bind, "num_threads": num_threads}
    out: dict = {**given, "error": None, "ranks": []}
    try:
        kw = {k: v for k, v in given.items() if v is not None}
        kw.update(vllm_compat.vllm_env_engine_kwargs(given))
        cfg = EngineConfig.from_kwargs(**kw)
        out.update(tensor_parallel_size=cfg.tensor_parallel_size, data_parallel_size=cfg.data_parallel_size,
                   omp_threads_bind=cfg.omp_threads_bind, num_threads=cfg.num_threads)
        if cfg.data_parallel_size == 1:  # one engine: serve resolves its ranks as engine_placement does
            groups = [threads.resolve_ranks(cfg.omp_threads_bind, cfg.tensor_parallel_size, cfg.num_threads)]
        else:
            groups = replica_rank_groups(cfg)
    except (ApplianceError, ValueError, TypeError) as e:
        out["error"] = str(e)
        return out
    out["ranks"] = [{"replica": i, "rank": r, "num_threads": p.num_threads, "cpus": list(p.cpus) if p.cpus else None,
                     "numa_node": p.numa_node, "bind_memory": p.bind_memory,
                     "omp_places": threads.omp_env(p).get("OMP_PLACES"), "describe": p.describe()}
                    for i, g in enumerate(groups) for r, p in enumerate(g)]
    return out


def _libgomp() -> dict:
    from appliance.runtime import openmp

    try:
        return openmp.libgomp_report()
    except Exception as e:  # noqa: BLE001
        return {"mapped": None, "torch_bundled": None, "preload_choice": None, "classification": None,
                "error": f"{type(e).__name__}: {e}"}


def _problems(r: dict) -> list[dict]:
    P: list[dict] = []

    def add(sev: str, what: str, fix: str) -> None:
        P.append({"severity": sev, "what": what, "fix": fix})

    arm = r["cpu"]["arch"] == "aarch64"
    f = r["cpu"]["features"]
    t = r["torch"]
    if t["error"]:
        add("error", f"torch does not import: {t['error']}", "pip install -e . (pins torch 2.13.0; see README)")
    elif arm and t["cuda"]:
        add("warning", f"torch {t['version']} is a CUDA build (CUDA {t['cuda']}) on a CPU-only Arm host: a GB of "
            "CUDA libraries and an LL/SC-only libgomp", "pip install torch==2.13.0 --index-url "
            "https://download.pytorch.org/whl/cpu  (or torch==2.10.0 from PyPI, a CPU build)")
    if arm and not f.get("atomics"):
        add("warning", "this CPU has no LSE atomics (pre-ARMv8.1): OpenMP atomics are LL/SC loops whatever libgomp",
            "nothing to fix in software; prefer a Neoverse N1/V1/V2 host")
    if not arm and r["cpu"]["arch"] == "x86_64" and not f.get("avx2"):
        add("warning", "no AVX2: kernels run the generic C++ path", "use a Haswell-or-newer x86 host")
    if not r["kernels"]["available"]:
        add("warning", f"native kernels not available ({r['kernels']['reason']}): the engine uses the pure-torch "
            "reference ops", "python -m appliance.ops.native --build")
    lb = r["linear_backends"]
    if lb.get("w8a8_onednn", {}).get("available") is False and not t["error"]:
        add("info", f"linear backend w8a8_onednn is withdrawn on this host: {lb['w8a8_onednn']['reason']}",
            "nothing to do: W8A8 layers run on w8a8_native (auto never picks a withdrawn backend)")
    al = r["allocator"]
    if al["mimalloc_found"] is None:
        add("warning", "no libmimalloc found: `appliance serve` falls back to glibc malloc with tunables",
            "pip install cmeel-mimalloc==3.4.3")
    elif al["mimalloc_version"] and al["mimalloc_version"].startswith("2."):
        add("info", f"libmimalloc {al['mimalloc_version']} ({al['mimalloc_found']}) is 2.x; 3.x removed the page "
            "faults glibc takes in our test, 2.0.9 did not", "pip install cmeel-mimalloc==3.4.3")
    g = r["libgomp"]
    verdict = (g.get("classification") or {}).get("verdict")
    if arm and verdict == "llsc-only":
        fix = (f"it is preloaded by `appliance serve` automatically ({g['preload_choice']})" if g.get("preload_choice")
               else "bash openmp/build_libgomp.sh  (builds GCC 12's libgomp with -march=armv8.2-a into "
                    "~/.cache/appliance/libgomp-lse), or apt-get install libgomp1 (outline atomics)")
        add("error" if not g.get("preload_choice") else "info",
            f"the libgomp torch loads ({g.get('mapped') or g.get('torch_bundled')}) has no LSE atomics: "
            f"{g['classification']['llsc']} LDXR/STXR-class instructions", fix)
    elif arm and verdict == "outline-atomics" and not (g.get("preload_choice") or "").startswith("/opt/appliance"):
        add("info", "libgomp uses outline atomics (LSE after a run-time flag test per atomic)",
            "bash openmp/build_libgomp.sh for inline LSE (export APPLIANCE_LIBGOMP=<its path>)")
    omp_n = r["omp"]["env"].get("OMP_NUM_THREADS")
    phys = r["cores"]["physical"]
    if omp_n and omp_n.isdigit() and int(omp_n) > phys:
        add("warning", f"OMP_NUM_THREADS={omp_n} exceeds the {phys} physical cores: threads time-share and "
            "barriers stall", f"unset OMP_NUM_THREADS (appliance picks {r['omp']['recommended']['num_threads']}) "
            f"or export OMP_NUM_THREADS={phys}")
    if t.get("num_threads") and t["num_threads"] > phys:
        add("info", f"torch defaults to {t['num_threads']} threads on {phys} physical cores (SMT siblings)",
            "appliance serve --omp-threads-bind auto (the default) uses one thread per physical core")
    for w in r["omp"]["recommended"]["warnings"]:
        add("warning", w, "appliance serve --omp-threads-bind <one NUMA node's cores, e.g. 0-31>")
    return P


# ``doctor --model``: the loaded model's weights per layer group (appliance.layers.weight_report);
# absent from the report without --model
SCHEMA["properties"]["model_weights"] = _obj({
    "model": _S, "quantization": _S,
    "groups": {"type": "array", "items": _obj({"role": _S, "stored": _S, "method": _S, "layers": _I, "bytes": _I})},
    "total_bytes": _I,
})


def model_weights(model: str, quantization: str = "none") -> dict:
    """Load ``model`` as ``appliance serve`` would (with ``quantization``; a small KV cache) and report
    its weights per layer group: stored format, method, layers, resident bytes."""
    from appliance import LLM
    from appliance.layers.weight_report import as_dicts, total_bytes, weight_groups

    llm = LLM(model, quantization=quantization, num_kv_blocks=16, enable_prefix_caching=False)
    groups = weight_groups(llm.engine.runner.model)
    return {"model": str(model), "quantization": quantization, "groups": as_dicts(groups),
            "total_bytes": total_bytes(groups)}


def doctor_report(placement: dict | None = None) -> dict:
    """Everything ``appliance doctor`` knows, as a JSON-safe dict that validates against SCHEMA.
    ``placement``: the ``placement_plan`` arguments (serve's flags) whose per-rank placement to show."""
    r = {"schema_version": 1, "cpu": _cpu(), "cores": _cores(), "memory": _memory(), "torch": _torch(),
         "kernels": _kernels(), "linear_backends": _linear_backends(), "allocator": _allocator(),
         "libgomp": _libgomp(), "omp": _omp(), "ranks": _ranks(), "placement": placement_plan(**(placement or {}))}
    r["onednn"] = _onednn()
    r["problems"] = _problems(r)
    return r


def run_doctor(json: bool = False, model: str | None = None, quantization: str = "none",
               placement: dict | None = None) -> int:
    """Print the report (a rich table, or JSON with ``json=True``). Returns the exit code: 1 when a
    problem of severity ``error`` was found, else 0. ``model``: also load it (with ``quantization``)
    and report its weights per layer group; a model that does not load is an error problem.
    ``placement``: serve's placement flags (``placement_plan``); flags serve would refuse are an error problem."""
    r = doctor_report(placement)
    if r["placement"]["error"]:
        r["problems"].append({"severity": "error", "what": f"placement: {r['placement']['error']}",
                              "fix": "change the flag named (appliance serve refuses the same)"})
    if model is not None:
        from appliance.errors import ApplianceError

        try:
            r["model_weights"] = model_weights(model, quantization)
        except (ApplianceError, ValueError, OSError) as e:
            r["problems"].append({"severity": "error", "what": f"--model {model} does not load: {e}",
                                  "fix": "check the path and --quantization (appliance serve gives the same error)"})
    rc = 1 if any(p["severity"] == "error" for p in r["problems"]) else 0
    if json:
        import json as _json

        print(_json.dumps(r, indent=2, default=str))
        return rc
    from rich.console import Console
    from rich.table import Table

    c, t = r["cpu"], r["torch"]
    feats = " ".join(n for n, v in c["features"].items() if v) or "none of the tracked ones"
    if c["sve_vector_bits"]:
        feats += f" (SVE {c['sve_vector_bits']}-bit)"
    g = r["libgomp"]
    cls = g.get("classification")
    gomp = g.get("mapped") or g.get("torch_bundled") or "not loaded"
    if cls:
        gomp += f"  [{cls['verdict']}: {cls['lse']} LSE, {cls['llsc']} LL/SC]"
    elif g.get("classification_error"):
        gomp += f"  [dim]({g['classification_error']})[/]"
    if g.get("preload_choice"):
        gomp += f"\nserve preloads {g['preload_choice']} ({g['preload_reason']})"
    a = r["allocator"]
    rec = r["omp"]["recommended"]
    lin = ", ".join(n for n, v in r["linear_backends"].items() if v["available"])
    lin += "".join(f"\n[yellow]not here[/]: {n}: {v['reason']}" for n, v in r["linear_backends"].items()
                   if not v["available"])
    tab = Table(title="appliance doctor", show_header=False, expand=False)
    tab.add_column(style="bold cyan")
    tab.add_column()
    tab.add_row("cpu", f"{c['model']} ({c['arch']})\n{feats}")
    tab.add_row("cores", f"{r['cores']['physical']} physical / {r['cores']['logical']} logical, "
                         f"{len(r['cores']['numa_nodes'])} NUMA node(s)")
    tab.add_row("memory", f"{r['memory']['available_gib']} GiB available of {r['memory']['total_gib']} GiB")
    tab.add_row("torch", f"{t['version']}" + (f" CUDA {t['cuda']}" if t["cuda"] else " CPU") +
                f", capability {t['cpu_capability']}, oneDNN {t['mkldnn']} (bf16 {t['mkldnn_bf16']}), "
                f"ACL {t['acl']}, KleidiAI {t['kleidiai']}, static mimalloc {t['mimalloc_static']}"
                if not t["error"] else f"[red]{t['error']}[/]")
    o = r["onednn"]
    tab.add_row("oneDNN", f"{o['implementation']} ({o['isa']})" if o["implementation"] else f"[dim]{o['error']}[/]")
    k = r["kernels"]
    tab.add_row("kernels", f"{k['variant']} (of {', '.join(k['variants'])})" if k["available"] else f"reference ({k['reason']})")
    tab.add_row("linear backends", lin)
    tab.add_row("allocator", f"this process: {a['this_process']['name']}; serve uses {a['serve_default']}"
                + (f" ({a['mimalloc_found']}, {a['mimalloc_version']})" if a["mimalloc_found"] else ""))
    tab.add_row("libgomp", gomp)
    tab.add_row("openmp", f"{rec['num_threads']} threads on CPUs {rec['cpus']}; env " +
                " ".join(f"{k}={v}" for k, v in r["omp"]["env"].items() if v))
    rk = r["ranks"]
    tab.add_row("2 ranks (auto)", (rk["error"] or "; ".join(
        f"rank {x['rank']}: CPUs {x['cpus']}" + (f" on node {x['numa_node']}" if x["numa_node"] is not None else "")
        + (", memory bound" if x["bind_memory"] else "") for x in rk["auto_2_ranks"]))
        + f"\n{rk['numa_nodes']} NUMA node(s); memory binding: {rk['memory_binding']}")
    pl = r["placement"]
    tab.add_row(f"placement (-tp {pl['tensor_parallel_size']} -dp {pl['data_parallel_size']}, "
                f"--omp-threads-bind {pl['omp_threads_bind']})",
                f"[red]{pl['error']}[/]" if pl["error"] else "\n".join(
                    f"replica {x['replica']} rank {x['rank']}: {x['describe']}" for x in pl["ranks"]))
    if "model_weights" in r:
        from rich.markup import escape

        from appliance.layers.weight_report import format_groups

        mw = r["model_weights"]
        tab.add_row("model weights", f"{mw['model']} (quantization {mw['quantization']})\n"
                    + escape(format_groups(mw["groups"])))
    con = Console()
    con.print(tab)
    if not r["problems"]:
        con.print("[green]no problems found[/]")
    for p in r["problems"]:
        color = {"error": "red", "warning": "yellow", "info": "blue"}[p["severity"]]
        con.print(f"[{color}]{p['severity']}[/]: {p['what']}\n    fix: [bold]{p['fix']}[/]")
    return rc


if __name__ == "__main__":
    sys.exit(run_doctor(json="--json" in sys.argv[1:]))
