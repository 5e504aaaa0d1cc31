"""W4 linear methods: ``w4a8_dynquant`` and ``w4a16_int4pack``.

W4 weights are int4 values in [-8, 7] with a float scale and zero point per group (or per channel):
``w = (q - zero_point) * scale`` (see ``appliance.layers.quant`` for the grid and the GGUF blocks).
"""
from __future__ import annotations

import torch

from appliance.layers.methods.base import FusedLinear, register
from appliance.layers.methods.qmath import (QuantMethod, add_offset, dequantize, offset, offset_reference,
                                            quant_act_asym)

_INT4PACK_GROUPS = (256, 128, 64, 32)


@register
class W4A8DynQuant(QuantMethod):
    """``_dyn_quant_pack_4bit_weight`` / ``_dyn_quant_matmul_4bit``: KleidiAI on aarch64 (the x86
    fallback computes the same math, slowly). The kernel is symmetric; the zero point enters as
    ``x_groupsums @ (-zero_point * scale)^T`` (fp32), a GEMM ``group_size`` times smaller. Group
    scales are held in bf16, which KleidiAI requires for groups (a scale that is not bf16-exact, such
    as a GGUF block's fp16 one, is rounded when packed)."""

    name = "w4a8_dynquant"
    scheme = "w4a8"

    def takes(self, n, k, group_size):
        return group_size == k or (group_size % 32 == 0 and k % group_size == 0)

    def pack(self, qweight, scale, zero_point=None):
        n, k = qweight.shape
        g = k // scale.shape[1]
        u = (qweight.to(torch.int16) + 8).to(torch.uint8)
        byte = (u[:, 1::2] << 4 | u[:, ::2]).contiguous()
        sz = scale.reshape(-1).contiguous().to(torch.float32 if g == k else torch.bfloat16)
        # bias stays outside the packed weight so the result dtype/precision path is uniform
        return {"w": torch._dyn_quant_pack_4bit_weight(byte, sz, None, g, k, n), "group": g, "n": n, "k": k,
                "offset_t": None if (off := offset(scale, zero_point)) is None else off.t().contiguous()}

    def apply(self, p, x):
        xf = x.float()
        return add_offset(torch._dyn_quant_matmul_4bit(xf, p["w"], p["group"], p["k"], p["n"]), xf, p["offset_t"])

    def fused_descriptor(self, p, silu_mul_next=False):
        return FusedLinear(5, p["w"], None, (None, None, p["offset_t"]), (p["group"],))

    def _reference(self, x, qweight, scale, zero_point):
        # quantized activations meet the symmetric part; the zero point term meets float activations
        # (the kernel + group-sum GEMM split); group scales in bf16
        held = scale if scale.shape[1] == 1 else scale.bfloat16()
        return quant_act_asym(x.float()).double() @ dequantize(qweight, held).t() + offset_reference(x, scale, zero_point)


def int4pack_group(k: int, group_size: int) -> int | None:
    if group_size != k:
        return group_size if group_size in _INT4PACK_GROUPS else None
    return next((g for g in _INT4PACK_GROUPS if k % g == 0), None)


@register
class W4A16Int4Pack(QuantMethod):
    """``_weight_int4pack_mm_for_cpu`` (the fast int4 route on x86), with bf16 activations, scales and
    zero offsets: its fp32 route is a slow reference (0.62 vs 0.018 ms for 1536x576 at batch 1
    here). Channel-wise scales are expanded to the largest supported group that divides ``in``."""

    name = "w4a16_int4pack"
    scheme = "w4a8"

    def takes(self, n, k, group_size):
        return int4pack_group(k, group_size) is not None and n % 16 == 0

    def pack(self, qweight, scale, zero_point=None):
        k = qweight.shape[1]
        g = k // scale.shape[1]
        g2 = int4pack_group(k, g)
        off = offset(scale, zero_point)
        z = torch.zeros_like(scale, dtype=torch.float32) if off is None else off
        s, z = scale.float(), z.float()
        if g2 != g:
            s, z = s.repeat_interleave(g // g2, dim=1), z.repeat_interleave(g // g2, dim=1)
        # the kernel computes (u - 8) * scale + zero with u = q + 8: zero is our offset
        w = torch.ops.aten._convert_weight_to_int4pack_for_cpu((qweight.to(torch.int32) + 8).contiguous(), 1)
        sz = torch.stack([s.t(), z.t()], dim=-1).contiguous()  # [K/g, N, 2]
        return {"w": w, "group": g2, "sz_bf16": sz.to(torch.bfloat16)}

    def apply(self, p, x):  # its fp32 route is a slow reference (~30x): bf16 activations
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), p["w"], p["group"],
                                                          p["sz_bf16"]).float()

    def fused_descriptor(self, p, silu_mul_next=False):
        return FusedLinear(4, p["w"], None, (p["sz_bf16"],), (p["group"],))

    def _reference(self, x, qweight, scale, zero_point):  # bf16 activations, scales and offsets
        k = qweight.shape[1]
        off = offset(scale, zero_point)
        w = dequantize(qweight, scale.bfloat16())
        if off is not None:
            w = w + off.bfloat16().double().repeat_interleave(k // scale.shape[1], dim=1)
        return x.bfloat16().double() @ w.t()
