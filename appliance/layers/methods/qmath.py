"""What the quantized methods share: the canonical weight form's arithmetic, the per-token activation
quantization every A8 method performs, and the interface of a quantized method.

The canonical form (``appliance.layers.quant``): ``qweight`` int8 ``[N, K]`` holding the signed
integer values, ``scale`` float32 ``[N, K // group]`` and, for W4 and grouped W8, ``zero_point`` of the
same shape: ``w = (q - zero_point) * scale``.
"""
from __future__ import annotations

import torch

from appliance.layers.methods.base import FusedLinear, LinearMethod


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None,
               dtype=torch.float64) -> torch.Tensor:
    n, k = qweight.shape
    g = k // scale.shape[1]
    q = qweight.to(dtype).reshape(n, -1, g)
    if zero_point is not None:
        q = q - zero_point.to(dtype)[..., None]
    return (q * scale.to(dtype)[..., None]).reshape(n, k)


def offset(scale: torch.Tensor, zero_point: torch.Tensor | None) -> torch.Tensor | None:
    """-zero_point * scale in fp32, [N, G]: what a symmetric kernel's result needs added, per group."""
    if zero_point is None or not bool(zero_point.any()):
        return None
    return (-zero_point.float() * scale.float()).contiguous()


def group_sums(x: torch.Tensor, groups: int) -> torch.Tensor:
    """x [M, K] -> [M, groups]: the sum of each group of K / groups inputs."""
    return x.reshape(x.shape[0], groups, -1).sum(-1)


def add_offset(y: torch.Tensor, x: torch.Tensor, offset_t: torch.Tensor | None) -> torch.Tensor:
    """A symmetric kernel's fp32 result ``y`` [M, N] plus the zero point's share,
    ``group_sums(x) @ offset^T`` (fp32, float activations; ``offset_t`` [G, N] from ``offset``, or None):
    a GEMM ``group`` times smaller than the layer's. How every method with zero points applies them."""
    return y if offset_t is None else torch.addmm(y, group_sums(x, offset_t.shape[0]), offset_t)


def offset_reference(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None) -> torch.Tensor | float:
    """The fp64 reference of ``add_offset``'s term (x as float32, as the methods take it), or 0."""
    off = offset(scale, zero_point)
    return 0.0 if off is None else group_sums(x.float().double(), off.shape[1]) @ off.double().t()


def quant_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KleidiAI's qai8dx: per-token asymmetric int8 of fp32 x [M, K] -> (float-valued integers in
    [-128, 127] [M, K], zero point [M, 1], scale [M, 1]); x ~ (xq - zp) * s.

    Activations (A8) are quantized this way, per token and dynamically, by every A8 method: on the
    default model this costs half of what symmetric per-token int8 does (W8A8 perplexity +1.8%
    instead of +3.1%)."""
    mn = x.amin(dim=-1, keepdim=True).clamp(max=0)
    mx = x.amax(dim=-1, keepdim=True).clamp(min=0)
    s = ((mx - mn) / 255).clamp(min=1e-12)
    zp = torch.round(-128 - mn / s).clamp(-128, 127)
    return (torch.round(x / s) + zp).clamp(-128, 127), zp, s


def quant_act_asym(x: torch.Tensor) -> torch.Tensor:
    """x as an A8 method sees it: quantized per token (``quant_act``) and dequantized."""
    xq, zp, s = quant_act(x)
    return (xq - zp) * s


class QuantMethod(LinearMethod):
    """A method for quantized layers. ``pack(qweight, scale, zero_point)`` takes the canonical form;
    ``apply(p, x)``: x [M, K] float32/bf16 -> [M, N] float32, without bias."""

    def pack(self, qweight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None) -> dict:
        raise NotImplementedError

    def reference(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None, zero_point: torch.Tensor | None = None) -> torch.Tensor:
        """fp64 result of the quantized math this method performs. x [M, K] -> [M, N] float64."""
        y = self._reference(x, qweight, scale, zero_point)
        return y + bias.double() if bias is not None else y

    def _reference(self, x, qweight, scale, zero_point) -> torch.Tensor:
        raise NotImplementedError

    def fused_descriptor(self, p: dict, silu_mul_next: bool = False) -> FusedLinear | None:
        """Without the bias (QuantLinear adds its own: ``FusedLinear.with_bias``)."""
        return None

    # Whether ``dequantize_rows`` gives rows of the packed form back: a tied embedding then reads its
    # rows from the lm_head's packed weight and the canonical copy is released
    # (``appliance.layers.vocab``). Opaque kernel packings (KleidiAI's, int4pack's) do not.
    gives_rows = False

    def dequantize_rows(self, p: dict, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), K]: the weight rows ``ids`` of a layer packed as ``p``, dequantized."""
        raise NotImplementedError(f"{self.name} does not give rows of its packed weight back")
