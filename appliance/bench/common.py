"""Shared pieces of the ``appliance bench`` subcommands: the machine description every JSON record
carries, percentile summaries, workload prompts, engine flags given as ``NAME=VALUE``."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import random
import statistics
import time
from pathlib import Path

PERCENTILES = (50, 90, 99)


# -- statistics ---------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for an empty list."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(xs: list[float]) -> dict:
    """``{"mean", "p50", "p90", "p99"}`` of ``xs`` (NaNs dropped); every value None when empty, so an
    all-failed run can never read as a fast one."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    out = {"mean": statistics.fmean(xs) if xs else None}
    out.update({f"p{q}": percentile(xs, q) for q in PERCENTILES})
    return out


# -- the machine --------------------------------------------------------------------------------
def _allocator() -> str:
    try:
        from appliance.runtime.allocator import describe

        return describe()
    except Exception:  # the runtime floor may be absent or fail on an unusual host
        return "unknown"


def _libgomp() -> str:
    try:
        from appliance.runtime.openmp import mapped_libgomp

        return mapped_libgomp() or "none mapped"
    except Exception:
        return "unknown"


def machine_description() -> dict:
    """What the numbers were measured on. Keys are fixed by ``schema.MACHINE``."""
    import torch

    try:
        import psutil

        mem = psutil.virtual_memory().total / 2 ** 30
        phys = psutil.cpu_count(logical=False)
    except ImportError:
        mem, phys = None, None
    try:
        from appliance.runtime.cpu_features import detect

        f = detect()
        cpu, arch = f.model_name, f.arch
        isa = sorted(x for x in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16",
                                 "amx_int8", "asimd", "asimddp", "sve", "sve2",
                                 "bf16", "i8mm", "atomics") if f.has(x))
    except Exception:
        cpu, arch, isa = platform.processor() or "unknown", platform.machine(), []
    try:
        from importlib.metadata import version

        app_version = version("appliance")
    except Exception:
        app_version = "unknown"
    return {
        "hostname": platform.node(), "cpu": cpu, "arch": arch, "isa": isa,
        "logical_cpus": os.cpu_count() or 1, "physical_cores": phys,
        "affinity_cpus": _affinity_cpus(),
        "memory_gib": round(mem, 2) if mem else None, "os": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "appliance": app_version, "allocator": _allocator(), "libgomp": _libgomp(),
    }


def _affinity_cpus() -> int | None:
    """The CPUs `appliance bench` was started on (recorded before it re-executes itself: libgomp
    binds this process's main thread to one CPU once it loads), else this process's."""
    if os.environ.get("APPLIANCE_BENCH_CPUS"):
        from appliance.runtime.threads import parse_cpu_list

        return len(parse_cpu_list(os.environ["APPLIANCE_BENCH_CPUS"]))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def new_record(bench: str, settings: dict, results: dict) -> dict:
    from appliance.bench.schema import SCHEMA_VERSION

    return {"schema_version": SCHEMA_VERSION, "bench": bench,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_description(),
            "settings": settings, "results": results}


def write_json(record: dict, path: str | os.PathLike) -> None:
    """Validate against the schema, then write. A record that does not match is a bug here."""
    from appliance.bench.schema import validate

    validate(record)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2) + "\n")


# -- workloads ----------------------------------------------------------------------------------
def random_token_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` random ids, skipping the lowest and highest ids of the vocabulary
    (where tokenizers keep their special tokens)."""
    rng = random.Random(seed)
    lo = min(100, vocab // 4)
    hi = max(lo + 1, vocab - min(100, vocab // 4))
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


_WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had "
          "by word but not what all were we when your can said there use an each which she do how their if will "
          "up other about out many then them these so some her would make like him into time has look two more").split()


def random_text_prompts(n: int, length: int, seed: int = 0, tokenizer=None) -> list[str]:
    """``n`` text prompts of about ``length`` tokens: random ids decoded with ``tokenizer`` when given
    (vLLM's benchmark does the same), else ``length`` common English words."""
    if tokenizer is not None:
        ids = random_token_prompts(n, length, len(tokenizer), seed)
        return [tokenizer.decode(p, skip_special_tokens=True) for p in ids]
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(length)) for _ in range(n)]


def load_jsonl_prompts(path: str | os.PathLike, n: int | None = None) -> list[str]:
    """Prompts from a JSONL file: each line an object with ``prompt`` (or ``text``) or a bare string."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        p = obj if isinstance(obj, str) else obj.get("prompt", obj.get("text"))
        if not isinstance(p, str):
            raise ValueError(f"{path}:{i}: expected a string or an object with 'prompt' or 'text'")
        out.append(p)
        if n is not None and len(out) >= n:
            break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


# -- engine flags -------------------------------------------------------------------------------
def parse_engine_args(pairs: list[str] | None) -> dict:
    """``["max_num_seqs=64", "enable-prefix-caching=false"]`` -> typed kwargs for ``EngineConfig``.
    Any field of ``EngineConfig`` is accepted, so every engine flag is reachable from a bench."""
    from appliance.config import EngineConfig, _parse_env

    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    out = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in fields:
            raise ValueError(f"--engine-arg {pair!r}: expected NAME=VALUE with NAME one of "
                             f"{', '.join(sorted(fields))}")
        out[name] = None if value.lower() == "none" else _parse_env(value, fields[name].type)
    return out


def parse_int_list(spec: str) -> list[int]:
    try:
        vals = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers like 1,4,16; got {spec!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"expected positive integers like 1,4,16; got {spec!r}")
    return vals
