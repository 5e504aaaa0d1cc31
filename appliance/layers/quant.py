"""Quantized linear layers: W8A8 and W4A8, swapped in for ``Linear`` at load.

One canonical form per layer, whatever the source (a float checkpoint quantized at load, a
compressed-tensors checkpoint, a converted one): ``qweight`` int8 ``[out, in]`` holding the signed
integer values (int8 in [-127, 127], or [-128, 127] from a GGUF's Q8_0; int4 in [-8, 7]),
``weight_scale`` float32
``[out, in // group_size]`` (``group_size == in``: one scale per output channel) and, for W4,
``weight_zero_point`` float32 of the same shape: ``w = (q - zero_point) * scale``.

W8 is symmetric per channel, rounded to nearest (a GGUF's Q8_0 blocks are W8 at group size 32, see
below: only ``w8a8_native`` runs W8 groups, ``backend_valid`` keeps them from the other backends).
W4 is rounded to nearest on each group's min/max grid (16 levels from the group's minimum to its maximum, a float zero point): the grid of GGUF's
Q4_1, in which the default model ships, where a symmetric 4-bit grid costs +22-32% perplexity;
quantizing Q4_1's dequantized weights this way gives back its integers exactly (only the scales
move, rounded to bf16: a weight by up to 15 * 2^-8 of a step). Symmetric W4 checkpoints load with
zero point 0. Fused projections (q/k/v, gate/up) are one QuantLinear: scales are per output row, so
quantizing the fused weight equals quantizing its shards.

A GGUF's Q4_0 and Q4_1 blocks are this form already at group size 32, and a GGUF loaded with w4a8 at
that group size (the default; so the default model too) takes them as they are
(``appliance.models.gguf_loader.direct_w4_weights``): ``q = u - 8`` of the block's nibbles ``u``, its
fp16 scale ``d`` (held exactly, not rounded to bf16), zero point 0 (Q4_0) or ``-8 - m / d`` (Q4_1,
``w = d * u + m``). Q4_0 scales may be negative. Likewise a GGUF loaded with w8a8 takes its Q8_0
blocks as W8 at group size 32 (``gguf_loader.direct_w8_weights``): the block's int8 ``q`` as they are
(-128 included) and its fp16 ``d`` as the fp32 scale, exactly; those layers run on ``w8a8_native``.

Activations (A8) are quantized per token, dynamically, asymmetrically to int8 (KleidiAI's qai8dx
scheme, used by every A8 backend): on the default model this costs half of what symmetric
per-token int8 does (W8A8 perplexity +1.8% instead of +3.1%).

Each backend packs that form once (``set_backend``) and has an exact fp64 reference of the math it
performs (``reference``), which the tests hold it against:

- ``w8a8_onednn``: oneDNN int8 GEMM with weights prepacked (``onednn.qlinear_prepack`` /
  ``qlinear_pointwise``). x86 oneDNN wants u8 activations: the int8 values shifted by 128 with
  zero point 128 (the same integers); Arm takes s8 directly. The op takes one activation scale and
  zero point per call, not per token, so the GEMM runs with scale 1, zero point 0 and fp32 output;
  the per-token zero point is removed with the weight's row sums (``zp_t * sum_k q[n, k]``) and the
  per-token scale multiplies the rows: exact integer algebra.
- ``w8a8_native``: the native kernels' ``gemm_w8g_a8`` (``native/neon_sve``; needs the extension
  built, ``python -m appliance.ops.native --build``): W8 with a scale per group of 32 to 256 inputs
  (per-channel scales are repeated over the largest such group dividing ``in``), ``in % 32 == 0``.
  Weights are packed once into 16-row tiles, 4 inputs x 16 rows per 64 bytes, with each group's
  integer weight sum; activations are quantized per token inside the kernel, bit for bit as here.
  Per group the integer dot product is exact (int32) and the zero point comes off with the group's
  weight sum (``sum (xq - zp) q = sum xq q - zp sum q``, exact); groups are summed in fp32. Inner
  products: VPDPBUSD (AVX512-VNNI), VPMADDUBSW/VPMADDWD (AVX2; weights holding -128 take the portable
  loop), SDOT (Arm dotprod) and SMMLA for token pairs (Arm I8MM), a portable loop otherwise;
  parallel over 16-row tiles. 1536x576 at batch 1 / 16 here (2 threads, VNNI, weights in cache):
  0.007 / 0.037 ms, ``w8a8_onednn`` 0.056 / 0.097 ms, F.linear fp32 0.047 / 0.22 ms.
- ``w8a16_int8pack``: ``_weight_int8pack_mm`` with bf16 activations and scales: its fp32 route is a
  slow reference (0.28 vs 0.021 ms for 1536x576 at batch 1 here; F.linear fp32: 0.12 ms).
- ``w4a8_dynquant``: ``_dyn_quant_pack_4bit_weight`` / ``_dyn_quant_matmul_4bit``: KleidiAI on
  aarch64 (the x86 fallback computes the same math, slowly). The kernel is symmetric; the zero
  point enters as ``x_groupsums @ (-zero_point * scale)^T`` (fp32), a GEMM ``group_size`` times
  smaller. Group scales are held in bf16, which KleidiAI requires for groups (a scale that is not
  bf16-exact, such as a GGUF block's fp16 one, is rounded when packed).
- ``w4a16_int4pack``: ``_weight_int4pack_mm_for_cpu`` (the fast int4 route on x86), with bf16
  activations, scales and zero offsets: its fp32 route is a slow reference (0.62 vs 0.018 ms for
  1536x576 at batch 1 here). Channel-wise scales are expanded to the largest supported group
  that divides ``in``.
"""
from __future__ import annotations

import functools
import os
import platform

import torch
from torch import nn

from appliance.layers.linear import LinearBase, relative_cost

SCHEMES = ("w8a8", "w4a8")
BACKENDS = {
    "w8a8": ("w8a8_onednn", "w8a16_int8pack", "w8a8_native"),
    "w4a8": ("w4a8_dynquant", "w4a16_int4pack"),
}
QUANT_BACKENDS = tuple(b for bs in BACKENDS.values() for b in bs)
_INT4PACK_GROUPS = (256, 128, 64, 32)
_NATIVE_W8_GROUPS = (256, 128, 64, 32)  # gemm_w8g_a8's groups (its int32 sums stay exact in fp32)
_ARM = platform.machine().lower() in ("aarch64", "arm64")


# ---------------------------------------------------------------- quantization (round to nearest)

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K] in [-127, 127], float32 scale [N, 1]), per-channel symmetric."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K] in [-8, 7], float32 scale and zero point [N, K // group]): each
    group's [min, max] in 16 steps, ``w ~ (q - zp) * scale``.

    Group scales are rounded to bf16 first (KleidiAI keeps them in bf16), so every backend and a
    saved checkpoint see the same scale values; channel-wise scales stay fp32."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"quant_group_size={group_size} does not divide the input size {k}")
    wg = w.float().reshape(n, k // group_size, group_size)
    mn, mx = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((mx - mn) / 15).clamp(min=1e-12)
    if group_size != k:
        scale = scale.to(torch.bfloat16).float().clamp(min=1e-12)
    u = torch.round((wg - mn[..., None]) / scale[..., None]).clamp(0, 15)
    return (u - 8).to(torch.int8).reshape(n, k), scale, -8 - mn / scale


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None,
               dtype=torch.float64) -> torch.Tensor:
    n, k = qweight.shape
    g = k // scale.shape[1]
    q = qweight.to(dtype).reshape(n, -1, g)
    if zero_point is not None:
        q = q - zero_point.to(dtype)[..., None]
    return (q * scale.to(dtype)[..., None]).reshape(n, k)


def _offset(scale: torch.Tensor, zero_point: torch.Tensor | None) -> torch.Tensor | None:
    """-zero_point * scale in fp32, [N, G]: what a symmetric kernel's result needs added, per group."""
    if zero_point is None or not bool(zero_point.any()):
        return None
    return (-zero_point.float() * scale.float()).contiguous()


def pack_int4_to_int32(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``pack-quantized``: int4 [-8, 7] [N, K] -> int32 [N, K / 8], value j of each
    run of 8 at bits 4j, stored offset by +8."""
    n, k = q.shape
    u = (q.to(torch.int32) + 8).reshape(n, k // 8, 8)
    shifts = torch.arange(8, dtype=torch.int32) * 4
    return (u << shifts).sum(dim=-1, dtype=torch.int32)


def unpack_int32_to_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    n = packed.shape[0]
    shifts = torch.arange(8, dtype=torch.int32) * 4
    u = (packed.to(torch.int32)[..., None] >> shifts) & 0xF
    return (u.reshape(n, -1)[:, :k] - 8).to(torch.int8)


# ---------------------------------------------------------------- activation quantization

def _quant_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KleidiAI's qai8dx: per-token asymmetric int8 of fp32 x [M, K] -> (float-valued integers in
    [-128, 127] [M, K], zero point [M, 1], scale [M, 1]); x ~ (xq - zp) * s."""
    mn = x.amin(dim=-1, keepdim=True).clamp(max=0)
    mx = x.amax(dim=-1, keepdim=True).clamp(min=0)
    s = ((mx - mn) / 255).clamp(min=1e-12)
    zp = torch.round(-128 - mn / s).clamp(-128, 127)
    return (torch.round(x / s) + zp).clamp(-128, 127), zp, s


def _quant_act_asym(x: torch.Tensor) -> torch.Tensor:
    xq, zp, s = _quant_act(x)
    return (xq - zp) * s


def reference(backend: str, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None, zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 result of the quantized math ``backend`` performs. x [M, K] -> [M, N] float64."""
    xf = x.float()  # activations are quantized from fp32, as the kernels' paths do
    if backend == "w4a8_dynquant":  # quantized activations meet the symmetric part; the zero point
        # term meets float activations (the kernel + group-sum GEMM split); group scales in bf16
        held = scale if scale.shape[1] == 1 else scale.bfloat16()
        y = _quant_act_asym(xf).double() @ dequantize(qweight, held).t()
        off = _offset(scale, zero_point)
        if off is not None:
            y = y + xf.double().reshape(x.shape[0], off.shape[1], -1).sum(-1) @ off.double().t()
        return y + bias.double() if bias is not None else y
    if backend == "w4a16_int4pack":  # bf16 activations, scales and offsets (the kernel's fast route)
        k = qweight.shape[1]
        off = _offset(scale, zero_point)
        w = dequantize(qweight, scale.bfloat16())
        if off is not None:
            w = w + off.bfloat16().double().repeat_interleave(k // scale.shape[1], dim=1)
        y = x.bfloat16().double() @ w.t()
        return y + bias.double() if bias is not None else y
    if backend == "w8a16_int8pack":  # bf16 activations and scales (the kernel's fast route)
        y = x.bfloat16().double() @ dequantize(qweight, scale.bfloat16()).t()
        return y + bias.double() if bias is not None else y
    w = dequantize(qweight, scale, zero_point)
    if backend in ("w8a8_onednn", "w8a8_native"):
        y = _quant_act_asym(xf).double() @ w.t()
    else:
        raise ValueError(f"no reference for backend {backend!r}")
    return y + bias.double() if bias is not None else y


# ---------------------------------------------------------------- packing and kernels

def _int4pack_group(k: int, group_size: int) -> int | None:
    if group_size != k:
        return group_size if group_size in _INT4PACK_GROUPS else None
    return next((g for g in _INT4PACK_GROUPS if k % g == 0), None)


def _native_w8_group(k: int, group_size: int) -> int | None:
    """gemm_w8g_a8's group for a W8 layer of ``group_size`` (``k``: per channel, whose scale is repeated)."""
    if k % 32:
        return None
    return next((g for g in _NATIVE_W8_GROUPS if group_size % g == 0), None)


def _native_available() -> bool:
    from appliance.ops import native

    return native.is_available()


@functools.cache
def onednn_int8_problem() -> str | None:
    """None when oneDNN's int8 GEMM computes exactly here, else why not (``w8a8_onednn`` is then
    withdrawn: never a candidate, refused when asked for by name).

    x86 oneDNN multiplies u8 activations by s8 weights. With VNNI (AVX512-VNNI, AVX-VNNI, AMX) four
    products go straight into an int32; without it (AVX2, or AVX512 capped below VNNI by
    ``ONEDNN_MAX_CPU_ISA``) VPMADDUBSW sums each pair of products into a saturating int16, and
    2 * 255 * 127 = 64770 does not fit: large activations times large weights are clipped to 32767
    per pair. That is which kernel oneDNN runs, not something its API reports, so the worst case is
    run through the backend itself: every activation quantized to the top of its range, every weight
    +127 or -127, at batch sizes 1 to 64, against the exact integers."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")):
        return "torch is built without oneDNN's quantized linear ops (torch.ops.onednn.qlinear_prepack)"
    n, k = 32, 256
    qw = torch.full((n, k), 127, dtype=torch.int8)
    qw[n // 2:] = -127
    p = pack("w8a8_onednn", qw, torch.ones(n, 1))
    for m in (1, 4, 64):  # oneDNN picks its kernel by shape too
        x = torch.ones(m, k)  # per-token range [0, 1]: every xq is 127 (u8 255 on x86)
        got = run("w8a8_onednn", p, x, n, k)
        want = reference("w8a8_onednn", x, qw, torch.ones(n, 1))
        err = (got.double() - want).abs().max().item()
        if not err <= 1e-4 * want.abs().max().item():
            return (f"oneDNN's int8 GEMM is not exact on this CPU (worst-case probe at batch {m}: "
                    f"{got[0, 0].item():.6g} for {want[0, 0].item():.6g}): without VNNI it sums pairs of u8 x s8 "
                    f"products in saturating int16. It needs AVX512-VNNI, AVX-VNNI or AMX"
                    + (f" (ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']} caps it below)"
                       if os.environ.get("ONEDNN_MAX_CPU_ISA") else "")
                    + " on x86; w8a8_native computes the same math exactly on every CPU")
    return None


def host_problem(backend: str) -> str | None:
    """Why ``backend`` cannot run on this host (its CPU, torch build and ISA caps), or None."""
    if backend == "w8a8_onednn":
        return onednn_int8_problem()
    if backend == "w8a8_native" and not _native_available():
        from appliance.ops import native

        return (f"the native kernel extension is not available ({native.unavailable_reason()}); "
                "build it with `python -m appliance.ops.native --build`")
    return None


def backend_valid(backend: str, scheme: str, n: int, k: int, group_size: int) -> bool:
    """Whether ``backend`` can run a ``scheme`` layer of ``[n, k]`` with this group size on this host."""
    if backend not in BACKENDS[scheme]:
        return False
    if backend == "w8a8_onednn":  # one scale per output channel; exact int8 on this CPU
        return group_size == k and onednn_int8_problem() is None
    if backend == "w8a16_int8pack":
        return group_size == k
    if backend == "w8a8_native":
        return _native_w8_group(k, group_size) is not None and _native_available()
    if backend == "w4a8_dynquant":
        return group_size == k or (group_size % 32 == 0 and k % group_size == 0)
    if backend == "w4a16_int4pack":
        return _int4pack_group(k, group_size) is not None and n % 16 == 0
    return True


def pack(backend: str, qweight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None) -> dict:
    """Everything ``run`` needs, built once from the canonical form."""
    n, k = qweight.shape
    g = k // scale.shape[1]
    if backend == "w8a8_onednn":
        s = scale.reshape(n).float().contiguous()
        return {"w": torch.ops.onednn.qlinear_prepack(qweight.contiguous(), None), "scale": s,
                "zp": torch.zeros(n, dtype=torch.int64),
                # zero-point correction per output: sum_k q[n, k] * scale[n]
                "rowsum": (qweight.to(torch.int64).sum(dim=1).float() * s).contiguous()}
    if backend == "w8a16_int8pack":
        return {"w": qweight.contiguous(), "scale_bf16": scale.reshape(n).to(torch.bfloat16).contiguous()}
    if backend == "w8a8_native":  # gemm_w8g_a8's layout (native/neon_sve/include/appliance_kernels.h)
        kg = _native_w8_group(k, g)
        tiles, pad = -(-n // 16), -n % 16
        q = torch.nn.functional.pad(qweight.to(torch.int8), (0, 0, 0, pad))
        s = torch.nn.functional.pad(scale.float().repeat_interleave(g // kg, dim=1), (0, 0, 0, pad))
        wsum = q.to(torch.int32).reshape(n + pad, k // kg, kg).sum(-1).float()  # |sum| <= 2^15: exact
        return {"w": q.reshape(tiles, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous(),
                "scale": s.reshape(tiles, 16, k // kg).permute(0, 2, 1).contiguous(),
                "wsum": wsum.reshape(tiles, 16, k // kg).permute(0, 2, 1).contiguous(),
                "group": kg, "m128": bool((qweight == -128).any())}
    if backend == "w4a8_dynquant":
        u = (qweight.to(torch.int16) + 8).to(torch.uint8)
        byte = (u[:, 1::2] << 4 | u[:, ::2]).contiguous()
        sz = scale.reshape(-1).contiguous().to(torch.float32 if g == k else torch.bfloat16)
        # bias stays outside the packed weight so the result dtype/precision path is uniform
        return {"w": torch._dyn_quant_pack_4bit_weight(byte, sz, None, g, k, n), "group": g,
                "offset_t": None if (off := _offset(scale, zero_point)) is None else off.t().contiguous()}
    if backend == "w4a16_int4pack":
        g2 = _int4pack_group(k, g)
        off = _offset(scale, zero_point)
        z = torch.zeros_like(scale, dtype=torch.float32) if off is None else off
        s, z = scale.float(), z.float()
        if g2 != g:
            s, z = s.repeat_interleave(g // g2, dim=1), z.repeat_interleave(g // g2, dim=1)
        # the kernel computes (u - 8) * scale + zero with u = q + 8: zero is our offset
        w = torch.ops.aten._convert_weight_to_int4pack_for_cpu((qweight.to(torch.int32) + 8).contiguous(), 1)
        sz = torch.stack([s.t(), z.t()], dim=-1).contiguous()  # [K/g, N, 2]
        return {"w": w, "group": g2, "sz_bf16": sz.to(torch.bfloat16)}
    raise ValueError(f"unknown quantized backend {backend!r}")


def run(backend: str, p: dict, x: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """x [M, K] float32/bf16 -> [M, N] float32 (without bias)."""
    if backend == "w8a8_onednn":
        xq, zp, s = _quant_act(x.float())
        if _ARM:
            xi, xzp = xq.to(torch.int8), 0
        else:
            xi, xzp = (xq + 128).to(torch.uint8), 128
        y = torch.ops.onednn.qlinear_pointwise(xi, 1.0, xzp, p["w"], p["scale"], p["zp"], None, 1.0, 0,
                                               torch.float32, "none", [], "")
        return (y - zp * p["rowsum"]) * s
    if backend == "w8a8_native":
        from appliance.ops import native

        return native.gemm_w8g_a8(x.float().contiguous(), p["w"], p["scale"], p["wsum"], n, p["group"], p["m128"])
    if backend == "w8a16_int8pack":  # its fp32 route is a slow reference (~15-50x): bf16 activations
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), p["w"], p["scale_bf16"]).float()
    if backend == "w4a8_dynquant":
        xf = x.float()
        y = torch._dyn_quant_matmul_4bit(xf, p["w"], p["group"], k, n)
        if p["offset_t"] is not None:
            y = torch.addmm(y, xf.reshape(xf.shape[0], -1, p["group"]).sum(-1), p["offset_t"])
        return y
    if backend == "w4a16_int4pack":  # its fp32 route is a slow reference (~30x): bf16 activations
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), p["w"], p["group"], p["sz_bf16"]).float()
    raise ValueError(f"unknown quantized backend {backend!r}")


def packed_bytes(p: dict) -> int:
    return sum(v.numel() * v.element_size() for v in p.values() if isinstance(v, torch.Tensor))


# ---------------------------------------------------------------- the layer

class QuantLinear(LinearBase):
    """y = x W^T + b with W held quantized (see the module docstring). x [..., in] -> [..., out]."""

    def __init__(self, in_features: int, out_features: int, scheme: str, group_size: int | None = None,
                 bias: bool = False, shards: dict[str, tuple[int, int]] | None = None, w8_groups: bool = False):
        """W8 layers are per channel (``group_size`` ignored) unless ``w8_groups``: then W8 keeps
        ``group_size`` too (a GGUF's Q8_0 blocks, group 32), which only some backends take."""
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"quantization must be one of none, {', '.join(SCHEMES)}; got {scheme!r}")
        g = in_features if (scheme == "w8a8" and not w8_groups) or not group_size else group_size
        if in_features % g:
            raise ValueError(f"quant_group_size={g} does not divide the input size {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.group_size = scheme, g
        self.qweight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, in_features // g, dtype=torch.float32),
                                         requires_grad=False)
        # W4 only: w = (q - zero_point) * scale (0 for symmetric checkpoints)
        self.weight_zero_point = nn.Parameter(torch.zeros(out_features, in_features // g, dtype=torch.float32),
                                              requires_grad=False) if scheme == "w4a8" else None
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.shards = shards or {}
        self.backend = "none"
        self._packed: dict | None = None

    @classmethod
    def from_float(cls, lin: nn.Module, scheme: str, group_size: int | None) -> QuantLinear:
        w = lin.weight.data
        q = cls(lin.in_features, lin.out_features, scheme, group_size, lin.bias is not None, dict(lin.shards))
        if scheme == "w8a8":
            q.qweight.data, q.weight_scale.data = quantize_int8(w)
        else:
            q.qweight.data, q.weight_scale.data, q.weight_zero_point.data = quantize_int4(w, q.group_size)
        if lin.bias is not None:
            q.bias.data = lin.bias.data.clone()
        return q

    @property
    def shape_key(self) -> str:
        return f"{self.scheme}g{self.group_size}|{self.out_features}x{self.in_features}"

    def candidates(self, dtype: torch.dtype, device: torch.device) -> list[str]:
        if device.type != "cpu":
            return []
        return [b for b in BACKENDS[self.scheme] if backend_valid(b, self.scheme, self.out_features, self.in_features, self.group_size)]

    def measure(self, candidates: list[str], rows, timer) -> dict[str, float]:
        n, k = self.out_features, self.in_features
        w = torch.randn(n, k) * 0.02
        qw, s, *zp = quantize_int8(w) if self.scheme == "w8a8" else quantize_int4(w, self.group_size)
        if self.scheme == "w8a8" and self.group_size != k:  # time the layer's own group size
            s = s.repeat_interleave(k // self.group_size, dim=1)
        fns = {}
        for name in candidates:
            p = pack(name, qw, s, *zp)
            xs = {m: torch.randn(m, k) for m in rows}  # not timed
            fns[name] = {m: (lambda x=xs[m], b=name, p=p: run(b, p, x, n, k)) for m in rows}
        return relative_cost(fns, timer)

    def set_backend(self, name: str) -> None:
        if self.qweight.numel() == 0:
            raise RuntimeError("QuantLinear.set_backend: already packed (the canonical weights are released)")
        if name not in BACKENDS[self.scheme]:
            raise ValueError(f"linear backend {name!r} cannot run {self.scheme} layers; "
                             f"use one of {', '.join(BACKENDS[self.scheme])}")
        self._packed = pack(name, self.qweight.data, self.weight_scale.data, self._zp())
        self.backend = name
        # the canonical form is no longer read (int8pack holds qweight itself, by reference)
        for t in (self.qweight, self.weight_scale, self.weight_zero_point):
            if t is not None:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)

    def weight_bytes(self) -> int:
        b = self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        if self._packed is not None:
            return packed_bytes(self._packed) + b
        return self.qweight.numel() * (1 if self.scheme == "w8a8" else 0.5) + self.weight_scale.numel() * 8 + b

    def _zp(self) -> torch.Tensor | None:
        return None if self.weight_zero_point is None else self.weight_zero_point.data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:  # not packed yet (before select_backends): the fp64 reference math
            y = reference(BACKENDS[self.scheme][1], x.reshape(-1, self.in_features), self.qweight.data,
                          self.weight_scale.data, zero_point=self._zp())
        else:
            y = run(self.backend, self._packed, x.reshape(-1, self.in_features), self.out_features, self.in_features)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, scheme={self.scheme}, "
                f"group={self.group_size}, bias={self.bias is not None}, backend={self.backend}")


def quantize_model(model: nn.Module, scheme: str, group_size: int | None, skip=("lm_head",)) -> nn.Module:
    """Swap every float ``Linear`` (except those named in ``skip``) for a QuantLinear, in place."""
    from appliance.layers.linear import Linear

    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            full = f"{name}.{cname}" if name else cname
            if isinstance(child, Linear) and cname not in skip and full not in skip:
                setattr(mod, cname, QuantLinear.from_float(child, scheme, group_size))
    return model


def swap_to_quant(model: nn.Module, scheme: str, group_size: int | None, skip=("lm_head",),
                  w8_groups: bool = False) -> nn.Module:
    """Like quantize_model but with empty QuantLinears (for loading a pre-quantized checkpoint; works
    on the meta device). ``w8_groups``: W8 layers keep ``group_size`` (see QuantLinear)."""
    from appliance.layers.linear import Linear

    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            full = f"{name}.{cname}" if name else cname
            if isinstance(child, Linear) and cname not in skip and full not in skip:
                setattr(mod, cname, QuantLinear(child.in_features, child.out_features, scheme, group_size,
                                                child.bias is not None, dict(child.shards), w8_groups))
    return model
