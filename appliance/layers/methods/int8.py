"""W8 linear methods: ``w8a8_onednn``, ``w8a16_int8pack`` and ``w8a8_native``.

W8 is symmetric per channel, rounded to nearest. A GGUF's blocks give W8 groups of 32 (Q8_0, Q5_*) or 16
(Q6_K, Q2_K, Q3_K), some with a zero point (``appliance.models.gguf_quants``): only ``w8a8_native`` runs
those (``takes`` keeps them from the others).
"""
from __future__ import annotations

import functools
import os
import platform

import numpy as np
import torch

from appliance.layers.methods.base import FusedLinear, native_extension_problem, register
from appliance.layers.methods.qmath import (QuantMethod, add_offset, dequantize, offset, offset_reference, quant_act,
                                            quant_act_asym)

_ARM = platform.machine().lower() in ("aarch64", "arm64")
_NATIVE_W8_GROUPS = (256, 128, 64, 32, 16)  # gemm_w8g_a8's groups (its int32 sums stay exact in fp32)


class _W8A8(QuantMethod):
    scheme = "w8a8"

    def _reference(self, x, qweight, scale, zero_point):
        # activations are quantized from fp32, as the kernels' paths do
        return quant_act_asym(x.float()).double() @ dequantize(qweight, scale, zero_point).t()


@register
class W8A8OneDNN(_W8A8):
    """oneDNN int8 GEMM with weights prepacked (``onednn.qlinear_prepack`` / ``qlinear_pointwise``).
    x86 oneDNN wants u8 activations: the int8 values shifted by 128 with zero point 128 (the same
    integers); Arm takes s8 directly. The op takes one activation scale and zero point per call, not
    per token, so the GEMM runs with scale 1, zero point 0 and fp32 output; the per-token zero point
    is removed with the weight's row sums (``zp_t * sum_k q[n, k]``) and the per-token scale
    multiplies the rows: exact integer algebra. Exact only where oneDNN sums into int32
    (``onednn_int8_problem``)."""

    name = "w8a8_onednn"

    def host_problem(self, dtype=torch.float32, device=torch.device("cpu")):
        # through appliance.layers.quant, its public name, so that a stand-in there (the tests' host
        # without VNNI) withdraws the method everywhere
        from appliance.layers import quant

        return quant.onednn_int8_problem()

    def takes(self, n, k, group_size):
        return group_size == k  # one scale per output channel

    def pack(self, qweight, scale, zero_point=None):
        n = qweight.shape[0]
        s = scale.reshape(n).float().contiguous()
        return {"w": torch.ops.onednn.qlinear_prepack(qweight.contiguous(), None), "scale": s,
                "zp": torch.zeros(n, dtype=torch.int64),
                # zero-point correction per output: sum_k q[n, k] * scale[n]
                "rowsum": (qweight.to(torch.int64).sum(dim=1).float() * s).contiguous()}

    def apply(self, p, x):
        xq, zp, s = quant_act(x.float())
        if _ARM:
            xi, xzp = xq.to(torch.int8), 0
        else:
            xi, xzp = (xq + 128).to(torch.uint8), 128
        y = torch.ops.onednn.qlinear_pointwise(xi, 1.0, xzp, p["w"], p["scale"], p["zp"], None, 1.0, 0,
                                               torch.float32, "none", [], "")
        return (y - zp * p["rowsum"]) * s


@functools.cache
def onednn_int8_problem() -> str | None:
    """None when oneDNN's int8 GEMM computes exactly here, else why not (``w8a8_onednn`` is then
    withdrawn: never a candidate, refused when asked for by name).

    x86 oneDNN multiplies u8 activations by s8 weights. With VNNI (AVX512-VNNI, AVX-VNNI, AMX) four
    products go straight into an int32; without it (AVX2, or AVX512 capped below VNNI by
    ``ONEDNN_MAX_CPU_ISA``) VPMADDUBSW sums each pair of products into a saturating int16, and
    2 * 255 * 127 = 64770 does not fit: large activations times large weights are clipped to 32767
    per pair. That is which kernel oneDNN runs, not something its API reports, so the worst case is
    run through the method itself: every activation quantized to the top of its range, every weight
    +127 or -127, at batch sizes 1 to 64, against the exact integers."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")):
        return "torch is built without oneDNN's quantized linear ops (torch.ops.onednn.qlinear_prepack)"
    m8 = W8A8OneDNN()
    n, k = 32, 256
    qw = torch.full((n, k), 127, dtype=torch.int8)
    qw[n // 2:] = -127
    p = m8.pack(qw, torch.ones(n, 1))
    for m in (1, 4, 64):  # oneDNN picks its kernel by shape too
        x = torch.ones(m, k)  # per-token range [0, 1]: every xq is 127 (u8 255 on x86)
        got = m8.apply(p, x)
        want = m8.reference(x, qw, torch.ones(n, 1))
        err = (got.double() - want).abs().max().item()
        if not err <= 1e-4 * want.abs().max().item():
            return (f"oneDNN's int8 GEMM is not exact on this CPU (worst-case probe at batch {m}: "
                    f"{got[0, 0].item():.6g} for {want[0, 0].item():.6g}): without VNNI it sums pairs of u8 x s8 "
                    f"products in saturating int16. It needs AVX512-VNNI, AVX-VNNI or AMX"
                    + (f" (ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']} caps it below)"
                       if os.environ.get("ONEDNN_MAX_CPU_ISA") else "")
                    + " on x86; w8a8_native computes the same math exactly on every CPU")
    return None


@register
class W8A16Int8Pack(QuantMethod):
    """``_weight_int8pack_mm`` with bf16 activations and scales: its fp32 route is a slow reference
    (0.28 vs 0.021 ms for 1536x576 at batch 1 here; F.linear fp32: 0.12 ms)."""

    name = "w8a16_int8pack"
    scheme = "w8a8"

    def takes(self, n, k, group_size):
        return group_size == k

    def pack(self, qweight, scale, zero_point=None):
        n = qweight.shape[0]
        return {"w": qweight.contiguous(), "scale_bf16": scale.reshape(n).to(torch.bfloat16).contiguous()}

    def apply(self, p, x):  # its fp32 route is a slow reference (~15-50x): bf16 activations
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), p["w"], p["scale_bf16"]).float()

    def fused_descriptor(self, p, silu_mul_next=False):
        return FusedLinear(6, p["w"], None, (p["scale_bf16"],))

    def _reference(self, x, qweight, scale, zero_point):  # bf16 activations and scales (the fast route)
        return x.bfloat16().double() @ dequantize(qweight, scale.bfloat16()).t()


def _native():
    from appliance.ops import native

    return native


def native_w8_group(k: int, group_size: int) -> int | None:
    """gemm_w8g_a8's group for a W8 layer of ``group_size`` (``k``: per channel, whose scale is repeated
    over the largest kernel group dividing ``k``)."""
    if k % 16 or k % group_size:
        return None
    return next((g for g in _NATIVE_W8_GROUPS if group_size % g == 0), None)


@register
class W8A8Native(_W8A8):
    """The native kernels' ``gemm_w8g_a8`` (``native/neon_sve``; needs the extension built,
    ``python -m appliance.ops.native --build``): W8 with a scale per group of 16 to 256 inputs
    (per-channel scales are repeated over the largest such group dividing ``in``), ``in % 16 == 0``.
    A zero point (GGUF's Q5_1/Q5_K/Q2_K blocks) is applied as ``w4a8_dynquant`` does: the kernel is
    symmetric and ``group_sums(x) @ (-zero_point * scale)^T`` (fp32) is added (``qmath.add_offset``).
    Weights are packed once into 16-row tiles, 4 inputs x 16 rows per 64 bytes, with each group's
    integer weight sum; activations are quantized per token inside the kernel, bit for bit as
    ``quant_act``. Per group the integer dot product is exact (int32) and the zero point comes off
    with the group's weight sum (``sum (xq - zp) q = sum xq q - zp sum q``, exact); groups are summed
    in fp32. Inner products: VPDPBUSD (AVX512-VNNI), VPMADDUBSW/VPMADDWD (AVX2; weights holding -128
    take the portable loop), SDOT (Arm dotprod) and SMMLA for token pairs (Arm I8MM), a portable loop
    otherwise; parallel over 16-row tiles. 1536x576 at batch 1 / 16 here (2 threads, VNNI, weights in
    cache): 0.007 / 0.037 ms, ``w8a8_onednn`` 0.056 / 0.097 ms, F.linear fp32 0.047 / 0.22 ms."""

    name = "w8a8_native"
    row_invariant = True  # integer sums of per-token codes; not with zero points (row_invariant_pack)

    def host_problem(self, dtype=torch.float32, device=torch.device("cpu")):
        return native_extension_problem()

    def row_invariant_pack(self, p):
        # a zero point's term is torch's addmm over the group sums (here and in the one-call stack),
        # which blocks by the row count
        return p if p["offset_t"] is None else None

    def takes(self, n, k, group_size):
        return native_w8_group(k, group_size) is not None

    def pack(self, qweight, scale, zero_point=None):
        # gemm_w8g_a8's layout (native/neon_sve/include/appliance_kernels.h). Built in numpy over whole
        # tensors, each 4-input run of a row moved as one int32: this is most of a GGUF's load time (the
        # Q8_0 lm_head has 136M weights: 5.2 s with byte-wise torch permutes and a torch == -128 scan,
        # ~1 s so)
        n, k = qweight.shape
        g = k // scale.shape[1]
        kg = native_w8_group(k, g)
        tiles, pad = -(-n // 16), -n % 16
        qn = np.ascontiguousarray(qweight.numpy(), dtype=np.int8)
        m128 = bool(qn.size) and int(qn.min()) == -128  # numpy's int8 min is ~40x faster than torch's == scan
        if pad:
            qn = np.concatenate([qn, np.zeros((pad, k), dtype=np.int8)])
        s = scale.float()
        if g != kg:
            s = s.repeat_interleave(g // kg, dim=1)
        sn = np.ascontiguousarray(s.numpy(), dtype=np.float32)
        if pad:
            sn = np.concatenate([sn, np.zeros((pad, k // kg), dtype=np.float32)])
        # |sum| <= 2^15: exact. numpy sums int8 into int32 without an int32 copy of q (~7x faster
        # than torch's .to(int32).sum here: 1.8 vs 0.23 s for 29M weights, the Q8_0 lm_head has 136M)
        wsum = np.add.reduce(qn.reshape(n + pad, k // kg, kg), axis=-1, dtype=np.int32).astype(np.float32)

        def tiled(a):  # [16 * tiles, C] -> [tiles, C, 16]
            return torch.from_numpy(np.ascontiguousarray(a.reshape(tiles, 16, -1).transpose(0, 2, 1)))

        return {"w": tiled(qn.view(np.int32)).view(torch.int8).reshape(tiles, k // 4, 16, 4),
                "scale": tiled(sn), "wsum": tiled(wsum),
                "group": kg, "m128": m128, "n": n,
                "offset_t": None if (off := offset(scale, zero_point)) is None else off.t().contiguous()}

    def apply(self, p, x):
        xf = x.float().contiguous()
        y = _native().gemm_w8g_a8(xf, p["w"], p["scale"], p["wsum"], p["n"], p["group"], p["m128"])
        return add_offset(y, xf, p["offset_t"])

    gives_rows = True

    def dequantize_rows(self, p, ids):
        # row r is row r % 16 of tile r // 16; w [tiles, K/4, 16, 4], scale [tiles, K/kg, 16]. In fp64
        # and rounded once: q * scale is exact in fp32 (an fp16 scale times <= 8-bit integers), and with
        # a zero point the result differs from (q - zp) * scale by the fp32 rounding of -zp * scale.
        tile, r = ids // 16, ids % 16
        q = p["w"][tile, :, r, :].reshape(len(ids), -1).double()
        w = q * p["scale"][tile, :, r].double().repeat_interleave(p["group"], dim=1)
        if p["offset_t"] is not None:
            off = p["offset_t"][:, ids].t().double()
            w += off.repeat_interleave(w.shape[1] // off.shape[1], dim=1)
        return w.float()

    def fused_descriptor(self, p, silu_mul_next=False):
        return FusedLinear(3, p["w"], None, (p["scale"], p["wsum"], p["offset_t"]), (p["group"], int(p["m128"])))

    def _reference(self, x, qweight, scale, zero_point):
        # quantized activations meet the symmetric part; the zero point term meets float activations
        # (the kernel + group-sum GEMM split, as w4a8_dynquant)
        return quant_act_asym(x.float()).double() @ dequantize(qweight, scale).t() + offset_reference(x, scale, zero_point)
