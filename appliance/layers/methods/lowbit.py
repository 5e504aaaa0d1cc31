"""Low-bit native methods: ``w4a8_native`` (W4 groups: GGUF Q4_K, Q4_0, Q4_1, AWQ/GPTQ at group
sizes the kernel takes), ``w6a8_native`` (W8-scheme groups whose values fit 6 bits: GGUF Q6_K,
Q5_K, Q3_K, Q2_K) and ``w5a8_native`` (W8-scheme groups of 32 or more whose values fit 5 bits:
GGUF Q5_0, Q5_1; a layer it takes is not offered to ``w6a8_native`` unless that one would keep its
K-quant scales).

All run the native kernels' ``gemm_wlow_a8`` (native/neon_sve/include/appliance_kernels.h,
``WLowArgs``): weights held as 4-bit (``u = q + 8``), 5-bit (``u = q + 16``) or 6-bit (``u = q + 32``)
unsigned values in 16-row tiles (a nibble plane, plus a 1-bit plane for 5 bits or a 2-bit plane for
6), a float32 scale and an int16 integer sum of q per group and, with zero points, a float32 offset
``-zero_point * scale`` per group. Bytes per weight held: 4 bits, group 32, with offsets: 0.5 + 10 /
32 = 0.8125 (no offsets: 0.6875); 5 bits, group 32: 0.625 + 6 / 32 = 0.8125 (Q5_0's file: 0.6875;
with offsets, Q5_1: 0.9375, file 0.75); 6 bits, group 16: 0.75 + 6 / 16 = 1.125 (group 32: 0.9375);
against 1 + 8 / G for ``w8a8_native``'s int8 tiles with fp32 scale and weight sum (1.5 at group 16,
1.25 at 32).

GGUF K-quants keep their own scales instead (``pack_kquant``, ``WLowArgs.ksuper``; chosen without
measuring when a layer has them, ``QuantLinear.preferred_backend``): per super-block of 256 the
fp16 ``d`` (and ``dmin``) as fp32, per group the int8 sub-scale (and 6-bit sub-min), per row an
int8 shift (``q + shift`` is the file's integer) and an fp32 sum ``sum_g d sc sum q``. The kernel
forms each group's fp32 scale ``d sc`` in L1 a chunk at a time and meets the activations' zero point
with the row sum, so no int16 group sums are held. Bytes per weight: Q4_K 0.5 + 2 / 32 + 8 / 256 =
0.59375 (+ 5 / K per row; file 0.5625); Q6_K 0.75 + 1 / 16 + 4 / 256 = 0.828 (+ 4 / K; file 0.8203);
a fused q/k/v mixing them, 6 bits at group 16 with mins, 0.906.

The math is ``w8a8_native``'s exactly: activations quantized per token (``quant_act``), the integer
dot products of each group exact, and the zero point's term against the float activations' group
sums (inside the kernel rather than ``qmath.add_offset``'s GEMM). On x86 VPMADDUBSW multiplies the
unsigned 4/6-bit values straight from the planes by the int8 activations (w8g_x86.inc proves the
int16 bound); other variants unpack a tile 256 inputs at a time into ``gemm_w8g_a8``'s int8 layout
in L1 and run their own W8A8 work item (SDOT / SMMLA on Arm, portable). What is read from memory
per decode step is the low-bit weight, not int8.
"""
from __future__ import annotations

import torch

from appliance.layers.methods.base import FusedLinear, native_extension_problem, register
from appliance.layers.methods.qmath import QuantMethod, dequantize, offset, offset_reference, quant_act_asym

# gemm_wlow_a8's groups: multiples of 16 up to 256 (a per-channel scale is repeated over the
# largest of these dividing K)
_GROUPS = (256, 128, 64, 32, 16)
# LinearKind kLinWLow in native/neon_sve/bindings/torch_bindings.cpp
_KIND = 8


def _native():
    from appliance.ops import native

    return native


def k_step(bits: int) -> int:
    """What in_features and the kernel group must be multiples of: 32 for 5 bits (the 1-bit plane holds
    32 inputs a byte), 16 otherwise."""
    return 32 if bits == 5 else 16


def kernel_group(k: int, group_size: int, bits: int = 4) -> int | None:
    """The kernel's group for a layer of ``k`` inputs and this group size (``k``: per channel), or None."""
    step = k_step(bits)
    if k % step or k % group_size:
        return None
    return next((g for g in _GROUPS if group_size % g == 0 and g % step == 0), None)


def centre(bits: int) -> int:
    """c of ``u = q + c``: the values a ``bits``-bit pack takes are [-c, c - 1]."""
    return {4: 8, 5: 16, 6: 32}[bits]


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [ceil(N/16), C, 16] (zero rows past N): a per-group table in the tile layout."""
    n, c = t.shape
    t = torch.nn.functional.pad(t, (0, 0, 0, -n % 16))
    return t.reshape(-1, 16, c).permute(0, 2, 1).contiguous()


def pack_lowbit(qweight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, bits: int) -> dict:
    """The ``WLowArgs`` layout of a canonical weight whose values fit ``bits`` (4: [-8, 7], 5: [-16, 15],
    6: [-32, 31])."""
    n, k = qweight.shape
    c = centre(bits)
    lo_q, hi_q = -c, c - 1
    qn = qweight.numpy()  # numpy's int8 min/max are ~100x faster than torch's
    if qn.size and not (int(qn.min()) >= lo_q and int(qn.max()) <= hi_q):
        raise ValueError(f"w{bits}a8_native: weight values must lie in [{lo_q}, {hi_q}]; got "
                         f"[{int(qn.min())}, {int(qn.max())}]")
    g = k // scale.shape[1]
    kg = kernel_group(k, g, bits)
    if kg is None:
        raise ValueError(f"w{bits}a8_native: needs in_features a multiple of {k_step(bits)} and a group a multiple "
                         f"of {k_step(bits)} (<= 256 per kernel group); got in_features={k}, group={g}")
    lo, hi, qsum = _native().pack_wlow_planes(qweight, bits, kg)
    s = scale.float().repeat_interleave(g // kg, dim=1)
    off = offset(scale, zero_point)
    if off is not None:
        off = off.repeat_interleave(g // kg, dim=1)
    # the integer sum of q per kernel group (|sum| <= 32 * 256: int16), for the activations' zero point
    wsum = _tiles(qsum).to(torch.int16)
    # one uint8 tensor: the 2-bit plane (6 bits) or 1-bit plane (5 bits), then the group sums (the kernel's hiw)
    hiw = torch.cat([hi.reshape(-1), wsum.reshape(-1).view(torch.uint8)])
    return {"lo": lo, "hiw": hiw, "scale": _tiles(s), "offset": None if off is None else _tiles(off),
            "group": kg, "bits": bits, "n": n, "k": k}


def pack_kquant(qweight: torch.Tensor, t: dict, bits: int) -> dict:
    """The ``WLowArgs`` K-quant layout (ksuper > 0) of a canonical weight and its K-quant scales
    (``QuantLinear.kquant_tables``). The values are stored as ``pack_lowbit`` stores them (u = q + c),
    so the kernel's q is the canonical q and the weight is ``sup sub (q + shift) - supmin submin``:
    the offset term ``shift sup sub - supmin submin`` meets the float activations' group sums as the
    canonical zero point's does (the same split as ``pack_lowbit``, so the same reference). Held:
    the planes, per row an fp32 sum (``sum_g sup sub sum q``, for the activations' zero point, in fp64
    rounded once) and an int8 shift, per group the int8 sub-scale (and sub-min), per super-block the
    fp32 scale (and min)."""
    n, k = qweight.shape
    g, sb = t["group"], t["super"]
    if bits not in (4, 6):
        raise ValueError(f"w{bits}a8_native: K-quant scales are kept at 4 or 6 bits only; got bits={bits}")
    if kernel_group(k, g) != g or sb % g or k % sb:
        raise ValueError(f"w{bits}a8_native: K-quant scales need group a multiple of 16 (<= 256) and a super-block "
                         f"a multiple of it dividing in_features; got group={g}, super={sb}, in_features={k}")
    centre = 8 if bits == 4 else 32
    qn = qweight.numpy()
    if qn.size and not (int(qn.min()) >= -centre and int(qn.max()) <= centre - 1):
        raise ValueError(f"w{bits}a8_native: weight values must lie in [{-centre}, {centre - 1}]; got "
                         f"[{int(qn.min())}, {int(qn.max())}]")
    pad = -n % 16
    lo, hi, qsum = _native().pack_wlow_planes(qweight, bits, g)
    scale = t["sup"].double().repeat_interleave(sb // g, dim=1) * t["sub"].double()  # [N, K/G], exact
    rowsum = torch.nn.functional.pad((scale * qsum[:n].double()).sum(1).float(), (0, pad))
    shift = t["shift"]
    flags = (1 if bool((shift != 0).any()) else 0) | (2 if t["submin"] is not None else 0)
    kf = [rowsum, _tiles(t["sup"]).reshape(-1)]
    k8 = [torch.nn.functional.pad(shift.to(torch.int8), (0, pad))] if flags & 1 else []
    k8.append(_tiles(t["sub"]).reshape(-1))
    if flags & 2:
        kf.append(_tiles(t["supmin"]).reshape(-1))
        k8.append(_tiles(t["submin"]).reshape(-1))
    return {"lo": lo, "hi": hi if bits == 6 else torch.empty(0, dtype=torch.uint8),
            "kf": torch.cat(kf).contiguous(), "k8": torch.cat(k8).contiguous(),
            "group": g, "bits": bits, "n": n, "k": k, "super": sb, "flags": flags}


def _kq_tables(p: dict):
    """Views of a K-quant pack: shift [T, 16] (or None), sup [T, K/S, 16], sub [T, K/G, 16], supmin,
    submin (or None)."""
    tiles, k = p["lo"].shape[0], p["k"]
    ns, ng = tiles * (k // p["super"]) * 16, tiles * (k // p["group"]) * 16
    kf, k8 = p["kf"], p["k8"]
    shift = None
    if p["flags"] & 1:
        shift, k8 = k8[:tiles * 16].view(tiles, 16), k8[tiles * 16:]
    sup = kf[tiles * 16:tiles * 16 + ns].view(tiles, -1, 16)
    sub = k8[:ng].view(tiles, -1, 16)
    if not p["flags"] & 2:
        return shift, sup, sub, None, None
    return shift, sup, sub, kf[tiles * 16 + ns:].view(tiles, -1, 16), k8[ng:].view(tiles, -1, 16)


def group_offsets(p: dict) -> torch.Tensor | None:
    """float64 [N, K/G]: the per-group offset a pack adds against the float activations' group sums
    (``offset``, or a K-quant pack's ``shift sup sub - supmin submin``), or None without one."""
    n, k, g = p["n"], p["k"], p["group"]
    if "kf" not in p:
        off = p["offset"]
        return None if off is None else off.permute(0, 2, 1).reshape(-1, k // g)[:n].double()
    shift, sup, sub, supmin, submin = _kq_tables(p)
    if shift is None and supmin is None:
        return None
    rows = lambda t: t.permute(0, 2, 1).reshape(-1, t.shape[1])[:n].double()  # noqa: E731 - [T, C, 16] -> [N, C]
    rep = p["super"] // g
    off = torch.zeros(n, k // g, dtype=torch.float64)
    if shift is not None:
        off += shift.reshape(-1)[:n].double()[:, None] * rows(sup).repeat_interleave(rep, dim=1) * rows(sub)
    if supmin is not None:
        off -= rows(supmin).repeat_interleave(rep, dim=1) * rows(submin)
    return off


def _planes(p: dict) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Views of ``hiw``: the 2-bit plane [tiles, K/16, 16, 4] (6 bits), the 1-bit plane [tiles, K/32, 16, 4]
    (5 bits) or None (4 bits), and the int16 group sums."""
    tiles, k = p["lo"].shape[0], p["k"]
    if "kf" in p:  # K-quant pack: the plane alone, no group sums
        return (p["hi"].view(tiles, k // 16, 16, 4) if p["bits"] == 6 else None), torch.empty(0, dtype=torch.int16)
    per = {4: 0, 5: 32, 6: 16}[p["bits"]]  # inputs per 64 bytes of a tile's plane
    hb = tiles * 64 * (k // per) if per else 0
    hi = p["hiw"][:hb].view(tiles, k // per, 16, 4) if hb else None
    return hi, p["hiw"][hb:].view(torch.int16)


def _empty() -> torch.Tensor:
    return torch.empty(0)


class _LowBit(QuantMethod):
    bits: int
    # integer sums of per-token codes, zero points and K-quant scales inside the kernel
    row_invariant = True

    def host_problem(self, dtype=torch.float32, device=torch.device("cpu")):
        return native_extension_problem()

    def takes(self, n, k, group_size):
        return kernel_group(k, group_size, self.bits) is not None

    def takes_values(self, qweight: torch.Tensor) -> bool:
        """Whether every value of this canonical weight fits the method's bits."""
        c = centre(self.bits)
        q = qweight.numpy()
        return q.size == 0 or (int(q.min()) >= -c and int(q.max()) <= c - 1)

    def pack(self, qweight, scale, zero_point=None):
        return pack_lowbit(qweight, scale, zero_point, self.bits)

    def takes_kquant(self, qweight: torch.Tensor, t: dict) -> bool:
        """Whether this layer's K-quant scales (``QuantLinear.kquant_tables``) can be held as they are."""
        k = qweight.shape[1]
        s = t["shift"]
        return (kernel_group(k, t["group"]) == t["group"] and t["super"] % t["group"] == 0 and k % t["super"] == 0
                and int(s.min()) >= -128 and int(s.max()) <= 127 and self.takes_values(qweight))

    def pack_kquant(self, qweight: torch.Tensor, t: dict) -> dict:
        return pack_kquant(qweight, t, self.bits)

    def apply(self, p, x):
        if "kf" in p:
            return _native().gemm_wlow_kq_a8(x.float().contiguous(), p["lo"], p["hi"], p["kf"], p["k8"], p["n"],
                                             p["group"], p["bits"], p["super"], p["flags"])
        return _native().gemm_wlow_a8(x.float().contiguous(), p["lo"], p["hiw"], p["scale"],
                                      p["offset"] if p["offset"] is not None else _empty(), p["n"], p["group"], p["bits"])

    def fused_descriptor(self, p, silu_mul_next=False):
        if "kf" in p:  # kLinWLow with ints[3] = super | flags << 16 (gemm_wlow_kq_a8)
            return FusedLinear(_KIND, p["lo"], None, (p["hi"], p["kf"], p["k8"]),
                               (p["group"], p["bits"], p["super"] | p["flags"] << 16))
        return FusedLinear(_KIND, p["lo"], None, (p["hiw"], p["scale"], p["offset"]), (p["group"], p["bits"]))

    gives_rows = True

    def dequantize_rows(self, p, ids):
        # row r is row r % 16 of tile r // 16. q * scale is exact in fp32 for the GGUF types (an fp16
        # scale times a <= 8-bit sub-scale times a <= 6-bit integer); with an offset the result is
        # rounded once more, as the kernel's per-group term is.
        tile, r = ids // 16, ids % 16
        lo = p["lo"][tile, :, r, :].to(torch.int16)  # [R, K/8, 4]
        u = torch.stack([lo & 15, lo >> 4], dim=2).reshape(len(ids), -1)  # [R, K]: 8s + 4h + j
        hi_plane, _ = _planes(p)
        if hi_plane is not None:
            hi = hi_plane[tile, :, r, :].to(torch.int16)  # [R, K/16, 4] (6 bits) or [R, K/32, 4] (5 bits)
            if p["bits"] == 6:
                h = torch.stack([(hi >> (2 * q)) & 3 for q in range(4)], dim=2).reshape(len(ids), -1)
            else:  # bit q of byte j of 32-input step s: input 32s + 4q + j
                h = torch.stack([(hi >> q) & 1 for q in range(8)], dim=2).reshape(len(ids), -1)
            u = u | (h << 4)
        q = (u - centre(p["bits"])).double()
        g = p["group"]
        if "kf" in p:  # w = sup sub (q + shift) - supmin submin, in fp64, rounded once
            shift, sup, sub, supmin, submin = _kq_tables(p)
            rep = p["super"] // g
            scale = sup[tile, :, r].double().repeat_interleave(rep, dim=1) * sub[tile, :, r].double()
            w = q * scale.repeat_interleave(g, dim=1)
            if shift is not None:
                w += shift[tile, r].double()[:, None] * scale.repeat_interleave(g, dim=1)
            if supmin is not None:
                mins = supmin[tile, :, r].double().repeat_interleave(rep, dim=1) * submin[tile, :, r].double()
                w -= mins.repeat_interleave(g, dim=1)
            return w.float()
        w = q * p["scale"][tile, :, r].double().repeat_interleave(g, dim=1)
        if p["offset"] is not None:
            w += p["offset"][tile, :, r].double().repeat_interleave(g, dim=1)
        return w.float()

    def _reference(self, x, qweight, scale, zero_point):
        # quantized activations meet the symmetric part; the zero point's term meets float activations
        return quant_act_asym(x.float()).double() @ dequantize(qweight, scale).t() + offset_reference(x, scale, zero_point)


@register
class W4A8Native(_LowBit):
    """W4 groups (multiples of 16 up to 256, or per channel) on ``gemm_wlow_a8``, 4 bits a weight."""

    name = "w4a8_native"
    scheme = "w4a8"
    bits = 4


@register
class W6A8Native(_LowBit):
    """W8-scheme groups whose values fit 6 bits ([-32, 31]: GGUF Q6_K, Q5_*, Q3_K, Q2_K) on
    ``gemm_wlow_a8``, 6 bits a weight; a layer holding any other value is not given to it
    (``takes_values``)."""

    name = "w6a8_native"
    scheme = "w8a8"
    bits = 6


@register
class W5A8Native(_LowBit):
    """W8-scheme groups (multiples of 32) whose values fit 5 bits ([-16, 15]: GGUF Q5_0, Q5_1) on
    ``gemm_wlow_a8``, 5 bits a weight: a 1-bit plane beside the nibbles, 0.125 B/weight less than
    ``w6a8_native`` (issue 14: Q5_0, llama.cpp's fallback when a row is not a multiple of 256, was
    held at 1.36x its file size). K-quant scales are not kept at 5 bits (``takes_kquant``: Q5_K stays
    on ``w6a8_native``'s)."""

    name = "w5a8_native"
    scheme = "w8a8"
    bits = 5

    def takes_kquant(self, qweight: torch.Tensor, t: dict) -> bool:
        return False
