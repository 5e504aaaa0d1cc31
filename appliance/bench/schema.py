"""The JSON record every ``appliance bench ... --json FILE`` writes, as a JSON Schema (draft 2020-12
subset), and a small validator for it (no jsonschema dependency).

Every record::

    {"schema_version": 1, "bench": "throughput|latency|serve|profile|kernels|compare",
     "created": "2026-11-30T16:00:00+0000",
     "machine":  {cpu, arch, isa, logical_cpus, physical_cores, affinity_cpus, memory_gib, os, python,
                  torch, torch_threads, appliance, allocator, libgomp, hostname},
     "settings": {every option of the subcommand, as given or defaulted},
     "results":  {bench-specific, below}}

Times are seconds, throughputs per second, latency distributions ``{mean, p50, p90, p99}`` (null
when nothing completed). ``SCHEMA_VERSION`` goes up on any change that renames or removes a key or
changes a unit; adding a key does not.  ``appliance bench schema`` prints the full schema.
"""
from __future__ import annotations

SCHEMA_VERSION = 1
BENCHES = ("throughput", "latency", "serve", "profile", "kernels", "compare")

NUM = {"type": "number"}
NUM_OR_NULL = {"type": ["number", "null"]}
INT = {"type": "integer", "minimum": 0}
INT_OR_NULL = {"type": ["integer", "null"]}
STR = {"type": "string"}
STR_OR_NULL = {"type": ["string", "null"]}


def obj(props: dict, required: list | None = None, extra: bool = False) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": extra}


def arr(items: dict) -> dict:
    return {"type": "array", "items": items}


SUMMARY = obj({"mean": NUM_OR_NULL, "p50": NUM_OR_NULL, "p90": NUM_OR_NULL, "p99": NUM_OR_NULL})

MACHINE = obj({
    "hostname": STR, "cpu": STR, "arch": STR, "isa": arr(STR), "logical_cpus": INT, "physical_cores": INT_OR_NULL,
    "affinity_cpus": INT_OR_NULL, "memory_gib": NUM_OR_NULL, "os": STR, "python": STR, "torch": STR,
    "torch_threads": INT, "appliance": STR, "allocator": STR, "libgomp": STR,
})

SERVE_LEVEL = obj({
    "concurrency": INT_OR_NULL, "request_rate": NUM_OR_NULL, "num_requests": INT, "completed": INT, "failed": INT,
    "errors": arr(STR), "duration_s": NUM, "input_tokens": INT, "output_tokens": INT, "usage_reported": {"type": "boolean"},
    "request_throughput": NUM_OR_NULL, "output_throughput": NUM_OR_NULL, "total_token_throughput": NUM_OR_NULL,
    "ttft_s": SUMMARY, "tpot_s": SUMMARY, "itl_s": SUMMARY, "e2e_s": SUMMARY,
})

RESULTS = {
    "throughput": obj({
        "num_requests": INT, "input_tokens": INT, "output_tokens": INT, "elapsed_s": NUM,
        "requests_per_s": NUM, "input_tokens_per_s": NUM, "output_tokens_per_s": NUM, "total_tokens_per_s": NUM,
        "engine": obj({"steps": INT, "forward_s": NUM, "step_s": NUM}),
    }),
    "latency": obj({
        "batch_size": INT, "repeats": INT, "input_len": INT, "output_len": INT,
        "ttft_s": SUMMARY, "tpot_s": SUMMARY, "e2e_s": SUMMARY,
    }),
    "serve": obj({"model": STR, "base_url": STR, "endpoint": STR, "levels": arr(SERVE_LEVEL)}),
    "profile": obj({
        "wall_s": NUM, "steps": INT, "output_tokens": INT,
        "buckets": arr(obj({"name": STR, "seconds": NUM, "fraction": NUM})),
        "top_ops": arr(obj({"name": STR, "self_s": NUM, "calls": INT})),
        "page_faults": obj({"minor": INT, "major": INT}),
        "context_switches": obj({"voluntary": INT, "involuntary": INT}),
        "threads": obj({"process": INT, "torch_intra_op": INT, "torch_inter_op": INT}),
        "allocator": STR, "libgomp": STR, "trace_file": STR_OR_NULL,
    }),
    "kernels": obj({
        "peak_gemm_gflops": NUM, "memory_bandwidth_gbps": NUM, "dtype": STR,
        "gemm": arr(obj({
            "backend": STR, "layer": STR, "phase": STR, "m": INT, "n": INT, "k": INT, "seconds": NUM,
            "gflops": NUM, "roofline_gflops": NUM, "fraction_of_peak": NUM, "fraction_of_roofline": NUM,
        })),
        "attention": arr(obj({
            "backend": STR, "batch": INT, "context": INT, "seconds": NUM, "gbps": NUM, "fraction_of_bandwidth": NUM,
        })),
    }),
    "compare": obj({
        "systems": arr(obj({"name": STR, "status": {"enum": ["ran", "skipped", "failed"]}, "reason": STR_OR_NULL,
                            "command": arr(STR), "levels": arr(SERVE_LEVEL)})),
        "ratios": arr(obj({"peer": STR, "concurrency": INT, "output_throughput": NUM_OR_NULL,
                           "ttft_p50": NUM_OR_NULL, "tpot_p50": NUM_OR_NULL})),
    }),
}


def record_schema(bench: str | None = None) -> dict:
    """The schema of a record of ``bench`` (or of any bench, as a ``oneOf``)."""
    if bench is None:
        return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "appliance bench record",
                "oneOf": [record_schema(b) for b in BENCHES]}
    return obj({"schema_version": {"enum": [SCHEMA_VERSION]}, "bench": {"enum": [bench]}, "created": STR,
                "machine": MACHINE, "settings": {"type": "object"}, "results": RESULTS[bench]})


class SchemaError(ValueError):
    pass


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is(value, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[t])


def check(value, schema: dict, path: str = "$") -> None:
    """Raise SchemaError naming the first path where ``value`` breaks ``schema``."""
    if "oneOf" in schema:
        errs = []
        for s in schema["oneOf"]:
            try:
                return check(value, s, path)
            except SchemaError as e:
                errs.append(str(e))
        raise SchemaError(f"{path}: matches none of the alternatives ({'; '.join(errs[:3])})")
    if "enum" in schema and value not in schema["enum"]:
        raise SchemaError(f"{path}: {value!r} is not one of {schema['enum']}")
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_is(value, t) for t in types):
            raise SchemaError(f"{path}: expected {' or '.join(types)}, got {type(value).__name__} {value!r:.60}")
    if "minimum" in schema and _is(value, "number") and value < schema["minimum"]:
        raise SchemaError(f"{path}: {value} < minimum {schema['minimum']}")
    if isinstance(value, dict) and "properties" in schema:
        for k in schema.get("required", []):
            if k not in value:
                raise SchemaError(f"{path}: missing key {k!r}")
        for k, v in value.items():
            if k in schema["properties"]:
                check(v, schema["properties"][k], f"{path}.{k}")
            elif schema.get("additionalProperties") is False:
                raise SchemaError(f"{path}: unexpected key {k!r}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            check(v, schema["items"], f"{path}[{i}]")


def validate(record: dict) -> None:
    """Raise SchemaError unless ``record`` is a valid bench record."""
    bench = record.get("bench") if isinstance(record, dict) else None
    if bench not in RESULTS:
        raise SchemaError(f"$.bench: expected one of {', '.join(BENCHES)}, got {bench!r}")
    check(record, record_schema(bench))
