"""What `auto` picks per layer shape on this host, under each ISA cap it can run: every valid linear
backend's measured relative cost (the score select_backends minimizes: the sum over decode and
prefill batch sizes of its time over the fastest's), float, W8A8 and W4A8, and the worst-case error
of each against its fp64 reference. A backend withdrawn here (wrong on this host, e.g. oneDNN's int8
GEMM without VNNI) is timed too and shown with its error, so it can be seen that a wrong-but-fast
backend never wins.

Each cap runs in its own process (the caps are read when the libraries load), the same caps as
tests/isa/test_isa_caps.py: none, avx2, avx512_core (AVX512 without VNNI/BF16; AVX512 hosts only),
generic. Run it alone (anything beside it moves the timings):

    .venv/bin/python bench/bench_backend_choice.py --json bench/results/backend_choice.json
    .venv/bin/python bench/bench_backend_choice.py --caps avx2 --shapes default   # one cap
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

# SmolLM2-135M (the default model) and Qwen2.5-0.5B: (name, out, in, silu_mul_next)
SHAPES = {
    "default": [("qkv_proj", 960, 576, False), ("o_proj", 576, 576, False), ("gate_up_proj", 3072, 576, True),
                ("down_proj", 576, 1536, False), ("lm_head", 49152, 576, False)],
    "qwen2.5-0.5b": [("qkv_proj", 1152, 896, False), ("o_proj", 896, 896, False),
                     ("gate_up_proj", 9728, 896, True), ("down_proj", 896, 4864, False)],
}
CAPS = {
    "none": {},
    "avx2": {"APPLIANCE_KERNELS": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "avx512_core": {"APPLIANCE_KERNELS": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512"},
    "generic": {"APPLIANCE_KERNELS": "generic", "ONEDNN_MAX_CPU_ISA": "SSE41", "ATEN_CPU_CAPABILITY": "default"},
}
CAP_NEEDS = {"avx2": ("avx2", "fma"), "avx512_core": ("avx512f", "avx512bw", "avx512vl", "avx512dq")}
SCHEMES = ("float", "w8a8", "w4a8")


def _worst_case_error(backend: str, layer) -> float:
    """Max error relative to the sum of |terms|, at the worst case for integer overflow (weights at the
    ends of their range, activations coded 127), of a quantized backend against its fp64 reference."""
    import torch

    from appliance.layers import quant

    n, k = layer.out_features, layer.in_features
    lo, hi = (-8, 7) if layer.scheme == "w4a8" else (-127, 127)
    q = torch.where(torch.arange(n)[:, None] < n // 2, hi, lo).to(torch.int8).expand(n, k).contiguous()
    s = torch.full((n, k // layer.group_size), 0.01)
    zp = torch.zeros_like(s) if layer.scheme == "w4a8" else None
    x = torch.ones(4, k)
    got = quant.run(backend, quant.pack(backend, q, s, zp), x, n, k).double()
    want = quant.reference(backend, x, q, s, zero_point=zp)
    size = (x.double().abs() @ quant.dequantize(q, s, zp).abs().t()).max().item()
    return (got - want).abs().max().item() / size


def worker(shape_sets: list[str]) -> dict:
    import torch

    from appliance.layers import linear, quant
    from appliance.ops import native

    cpu = torch.device("cpu")
    out = {"in_force": {"native_kernels": native.kernel_variant() if native.is_available() else None,
                        "aten_capability": torch.backends.cpu.get_cpu_capability(),
                        "onednn_int8_problem": quant.onednn_int8_problem()},
           "layers": []}
    for set_name in shape_sets:
        for name, n, k, silu in SHAPES[set_name]:
            for scheme in SCHEMES:
                if scheme != "float" and name == "lm_head":
                    continue  # lm_head stays float in quantized models
                lin = linear.Linear(k, n)
                lin.weight.data = torch.randn(n, k) * 0.02
                lin.silu_mul_next = silu
                layer = lin if scheme == "float" else quant.QuantLinear.from_float(lin, scheme, 32)
                valid = layer.candidates(torch.float32, cpu)
                names = linear.FLOAT_BACKENDS if scheme == "float" else quant.BACKENDS[scheme]
                withdrawn = {b: linear.host_problem(b, torch.float32, cpu) for b in names
                             if b not in valid and linear.host_problem(b, torch.float32, cpu)}
                # a withdrawn backend that can still be called is timed beside the valid ones
                timed = valid + [b for b in withdrawn if b == "w8a8_onednn" and hasattr(torch.ops.onednn, "qlinear_prepack")]
                cost = layer.measure(timed, linear._PROBE_ROWS, linear._time)
                valid_cost = {b: cost[b] for b in valid}
                rec = {"set": set_name, "layer": name, "shape": f"{n}x{k}", "scheme": scheme,
                       "cost": {b: round(c, 3) for b, c in cost.items()},
                       "picked": min(valid_cost, key=valid_cost.get), "withdrawn": withdrawn,
                       "fastest_overall": min(cost, key=cost.get)}
                if scheme != "float":
                    rec["worst_case_error"] = {b: _worst_case_error(b, layer) for b in timed}
                out["layers"].append(rec)
                print(f"  {set_name} {name} {scheme}: {rec['cost']} -> {rec['picked']}", file=sys.stderr, flush=True)
    return out


def _host_has(features) -> bool:
    from appliance.runtime.cpu_features import detect

    return all(detect().has(f) for f in features)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caps", default="none,avx2,avx512_core,generic")
    ap.add_argument("--shapes", default="default,qwen2.5-0.5b")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape_sets = args.shapes.split(",")
    if args.worker:
        print(json.dumps(worker(shape_sets)))
        return
    from appliance.bench.common import machine_description

    x86 = platform.machine().lower() in ("x86_64", "amd64")
    record = {"bench": "backend_choice", "machine": machine_description(),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "caps": {}}
    for cap in args.caps.split(","):
        if cap != "none" and (not x86 or not _host_has(CAP_NEEDS.get(cap, ()))):
            record["caps"][cap] = {"skipped": "this host lacks what the cap keeps (it would be the uncapped run)"}
            print(f"cap {cap}: skipped (the host lacks it)", file=sys.stderr)
            continue
        print(f"cap {cap}: {CAPS[cap] or 'uncapped'}", file=sys.stderr, flush=True)
        env = dict(os.environ, **CAPS[cap])
        r = subprocess.run([sys.executable, __file__, "--worker", "--shapes", args.shapes], env=env,
                           capture_output=True, text=True, check=False)
        sys.stderr.write(r.stderr)
        if r.returncode != 0:
            raise SystemExit(f"cap {cap}: the worker failed (rc {r.returncode})")
        record["caps"][cap] = {"env": CAPS[cap], **json.loads(r.stdout.strip().splitlines()[-1])}
    print_table(record)
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
        args.json.with_suffix(".txt").write_text(table_text(record))


def table_text(record: dict) -> str:
    m = record["machine"]
    lines = [f"machine: {m['cpu']} ({m['arch']}), ISA {' '.join(m['isa'])}, {m['torch_threads']} torch threads, "
             f"torch {m['torch']}", f"command: {record['command']}", ""]
    for cap, r in record["caps"].items():
        if "skipped" in r:
            lines.append(f"cap {cap}: skipped: {r['skipped']}\n")
            continue
        f = r["in_force"]
        lines.append(f"cap {cap} ({' '.join(f'{k}={v}' for k, v in r['env'].items()) or 'uncapped'}): native "
                     f"{f['native_kernels']}, ATen {f['aten_capability']}, oneDNN int8 "
                     f"{'exact' if f['onednn_int8_problem'] is None else 'WITHDRAWN (saturates)'}")
        lines.append(f"  {'shape set':13} {'layer':13} {'shape':11} {'scheme':6} {'picked':15} relative cost "
                     "(1.0 per batch size = fastest; 3 sizes) [worst-case error]")
        for L in r["layers"]:
            costs = []
            for b, c in sorted(L["cost"].items(), key=lambda kv: kv[1]):
                tag = " WITHDRAWN" if b in L["withdrawn"] else ""
                err = f" [{L['worst_case_error'][b]:.1e}]" if "worst_case_error" in L else ""
                costs.append(f"{b} {c:.2f}{err}{tag}")
            lines.append(f"  {L['set']:13} {L['layer']:13} {L['shape']:11} {L['scheme']:6} {L['picked']:15} "
                         + ", ".join(costs))
        lines.append("")
    return "\n".join(lines)


def print_table(record: dict) -> None:
    print(table_text(record))


if __name__ == "__main__":
    main()
