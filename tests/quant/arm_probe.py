"""Run inside the emulated arm64 root (see test_arm64_kernels.py): one small layer per quantized
backend and one prepacked float layer, each checked against its fp64 reference; prints one JSON line
with what ran. Imports only torch and appliance.layers (no engine), so the root needs torch alone."""
from __future__ import annotations

import json
import sys

import torch

from appliance.layers import quant
from appliance.layers.linear import Linear

torch.manual_seed(0)
n, k, m = 64, 256, 4
out = {"machine": __import__("platform").machine(), "torch": torch.__version__,
       "kleidiai": bool(torch.backends.kleidiai.is_available()), "checks": {}}
w = torch.randn(n, k) * 0.02
x = torch.randn(m, k)
for scheme, backend, group in [("w4a8", "w4a8_dynquant", 32), ("w4a8", "w4a8_dynquant", k),
                               ("w8a8", "w8a8_onednn", None)]:
    qw, s, *zp = quant.quantize_int8(w) if scheme == "w8a8" else quant.quantize_int4(w, group)
    zp = zp[0] if zp else None
    p = quant.pack(backend, qw, s, zp)
    print(f"=== {backend} g{group} begin", file=sys.stderr, flush=True)
    y = quant.run(backend, p, x, n, k)
    print(f"=== {backend} g{group} end", file=sys.stderr, flush=True)
    want = quant.reference(backend, x, qw, s, None, zp)
    err = (y.double() - want).abs().max().item()
    out["checks"][f"{backend}_g{group}"] = {
        "max_err": err, "ok": err <= 1e-4 * want.abs().max().item(),
        # KleidiAI packs into its own uint8 layout; the fallback packs fp32 (see _meta_registrations)
        "packed_dtype": str(p["w"].dtype)}
# The worst cases for integer overflow (as tests/quant/test_kernels.py on x86): weights at the ends
# of their range against activations coded 127 (and -128), every product at its largest and of one
# sign, so a clipped pair or partial sum cannot hide. bf16-activation routes: bf16 output rounding.
even = torch.arange(k) % 2 == 0
worst = [("w4a8_dynquant", 32), ("w4a8_dynquant", k), ("w8a8_onednn", k), ("w8a16_int8pack", k),
         ("w4a16_int4pack", 32)] + ([("w8a8_native", 32)] if quant._native_available() else [])
for backend, group in worst:
    w4 = backend.startswith("w4")
    lo, hi = (-8, 7) if w4 else (-128 if backend == "w8a8_native" else -127, 127)
    cases = {"all_max": (torch.where(torch.arange(n)[:, None] < n // 2, hi, lo).expand(n, k), torch.ones(m, k)),
             "alternating": (torch.where(even, hi, lo)[None].expand(n, k),
                             torch.where(even, 1.0, -0.99)[None].repeat(m, 1))}
    for case, (qw, xw) in cases.items():
        qw = qw.to(torch.int8).contiguous()
        s = torch.full((n, k // group), 0.01)
        zp = torch.zeros_like(s) if w4 else None
        got = quant.run(backend, quant.pack(backend, qw, s, zp), xw, n, k).double()
        want = quant.reference(backend, xw, qw, s, None, zp)
        size = (xw.double().abs() @ quant.dequantize(qw, s, zp).abs().t()).max().item()
        rel = (got - want).abs().max().item() / size
        out["checks"][f"worst_{case}_{backend}_g{group}"] = {
            "rel_err": rel, "ok": rel <= (2 ** -7 if backend.endswith("pack") else 1e-5)}
out["native_w8a8"] = quant._native_available()
lin = Linear(k, n)
lin.weight.data = w.clone()
lin.set_backend("onednn")
print("=== onednn_f32 begin", file=sys.stderr, flush=True)
y = lin(x)
print("=== onednn_f32 end", file=sys.stderr, flush=True)
err = (y.double() - x.double() @ w.double().t()).abs().max().item()
out["checks"]["onednn_f32"] = {"max_err": err, "ok": err <= 1e-4}
print(json.dumps(out))
