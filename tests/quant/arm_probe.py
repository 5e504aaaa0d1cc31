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
lin = Linear(k, n)
lin.weight.data = w.clone()
lin.set_backend("onednn")
print("=== onednn_f32 begin", file=sys.stderr, flush=True)
y = lin(x)
print("=== onednn_f32 end", file=sys.stderr, flush=True)
err = (y.double() - x.double() @ w.double().t()).abs().max().item()
out["checks"]["onednn_f32"] = {"max_err": err, "ok": err <= 1e-4}
print(json.dumps(out))
