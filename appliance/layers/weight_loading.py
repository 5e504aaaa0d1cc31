"""Per-parameter weight loaders: how one checkpoint tensor lands in one parameter.

A weight source (``appliance.models.weight_sources``) yields ``(checkpoint name, value)`` where the
value is a float tensor, or a ``QuantizedWeight`` (the canonical quantized form, whatever the file
held: compressed-tensors, AWQ, GPTQ, a GGUF's blocks). The loading loop maps the name to a
parameter and a shard (``model.param_for``) and calls the loader of the module that owns the
parameter: ``module.weight_loader(param, loaded, shard_id)``, or ``default_weight_loader`` for
modules without one (embeddings, norms). The loader lives on the module, not as an attribute of the
parameter, because parameter attributes do not survive materializing a meta-built model
(``to_empty``).

Every loader checks shapes and raises ``WeightLoadError`` (expected vs actual); the loop adds the
file and tensor name to make it a ``ModelLoadError``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class WeightLoadError(ValueError):
    """A tensor that does not fit its parameter; the loop names the file and tensor."""


@dataclass
class QuantizedWeight:
    """One checkpoint matrix in the canonical quantized form (``appliance.layers.quant``): ``qweight``
    int8 ``[N, K]``, ``scale`` float32 ``[N, K // group_size]``, ``zero_point`` float32 of the same shape
    or None (symmetric): ``w = (q - zero_point) * scale``. ``scheme``: "w4a8" (q in [-8, 7]) or "w8a8"."""

    qweight: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    group_size: int
    scheme: str
    # a GGUF K-quant's own scales (``appliance.models.gguf_quants.KQuantScales``), or None: what the
    # low-bit methods hold instead of fp32 scales per group (the layer keeps them until it packs)
    kquant: object | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        from appliance.layers.methods.qmath import dequantize

        return dequantize(self.qweight, self.scale, self.zero_point, torch.float64).to(dtype)


@dataclass
class ShiftedWeight:
    """A norm weight as a file stores it, shifted by ``shift``: llama.cpp's converter writes Gemma's
    RMSNorm weights as ``1 + w`` (the factor the norm multiplies by), and that value is kept as it is
    (``OffsetRMSNorm.weight_loader``) rather than recovered through ``w = value - 1``, which rounds."""

    value: torch.Tensor
    shift: float

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    def unshifted(self) -> torch.Tensor:
        return self.value.float() - self.shift


def shard_rows(module, param: torch.Tensor, shard_id: str | None) -> torch.Tensor:
    """The rows of ``param`` that checkpoint shard ``shard_id`` fills (all of it for None)."""
    if shard_id is None:
        return param.data
    offset, rows = module.shards[shard_id]
    return param.data.narrow(0, offset, rows)


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str = "") -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise WeightLoadError(f"has shape {tuple(src.shape)}{what}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def _rank_part(module, param, loaded, shard_id):
    """This tensor-parallel rank's part of ``loaded`` (``appliance.layers.parallel.rank_part``)."""
    if getattr(module, "tp_mode", None) is None:
        return loaded
    from appliance.layers.parallel import rank_part

    return rank_part(module, param, loaded, shard_id)


def default_weight_loader(param: torch.Tensor, loaded, shard_id: str | None = None) -> None:
    """Whole-tensor copy (embeddings, norms); a quantized record is dequantized (an embedding or a
    norm is always float)."""
    if isinstance(loaded, QuantizedWeight):
        loaded = loaded.dequantize()
    elif isinstance(loaded, ShiftedWeight):
        loaded = loaded.unshifted()
    copy_checked(param.data, loaded)


def load_float_linear(module, param: torch.Tensor, loaded, shard_id: str | None) -> None:
    """``Linear``: weight or bias rows of shard ``shard_id``. A quantized record arriving at a float
    layer (a fused layer whose shards differ in scheme, an ignored layer) is dequantized in fp32."""
    loaded = _rank_part(module, param, loaded, shard_id)
    if isinstance(loaded, QuantizedWeight):
        loaded = loaded.dequantize()
    copy_checked(shard_rows(module, param, shard_id), loaded)


def load_quant_linear(module, param: torch.Tensor, loaded, shard_id: str | None) -> None:
    """``QuantLinear``: a ``QuantizedWeight`` fills qweight, scale and zero point rows of the shard
    (a symmetric record leaves the zero point at 0); a float tensor is the bias."""
    loaded = _rank_part(module, param, loaded, shard_id)
    if not isinstance(loaded, QuantizedWeight):
        if param is not module.bias:
            raise WeightLoadError(f"is a float tensor ({loaded.dtype}), expected {module.scheme} quantized weights")
        copy_checked(shard_rows(module, param, shard_id), loaded)
        return
    grouped_w8 = module.scheme == "w8a8" and module.weight_zero_point is not None  # QuantLinear(w8_groups=True)
    if (grouped_w8 and loaded.scheme in ("w4a8", "w8a8") and loaded.group_size
            and (loaded.scheme, loaded.group_size) != (module.scheme, module.group_size)
            and loaded.group_size % module.group_size == 0):
        # a shard of a fused layer held in a wider form (models.loader._widened): the same integers,
        # each group's scale and zero point repeated over the layer's finer groups; exact
        r = loaded.group_size // module.group_size
        loaded = QuantizedWeight(loaded.qweight, loaded.scale.repeat_interleave(r, dim=1),
                                 None if loaded.zero_point is None else loaded.zero_point.repeat_interleave(r, dim=1),
                                 module.group_size, module.scheme, loaded.kquant)
    if loaded.scheme != module.scheme or loaded.group_size != module.group_size:
        raise WeightLoadError(f"is {loaded.scheme} at group size {loaded.group_size}, expected {module.scheme} at "
                              f"group size {module.group_size} (the layer's other shards)")
    q = loaded.qweight
    if q.dtype != torch.int8:
        raise WeightLoadError(f"holds {q.dtype} integers, expected int8")
    if module.scheme == "w4a8" and q.numel():
        qn = q.numpy()  # numpy's int8 min/max are ~100x faster than torch's
        if qn.min() < -8 or qn.max() > 7:
            raise WeightLoadError("holds values outside int4 [-8, 7]")
    copy_checked(shard_rows(module, module.qweight, shard_id), q)
    copy_checked(shard_rows(module, module.weight_scale, shard_id), loaded.scale.float(), " (scales)")
    if loaded.zero_point is not None:
        if module.weight_zero_point is None:
            raise WeightLoadError(f"has zero points, which {module.scheme} layers do not take")
        copy_checked(shard_rows(module, module.weight_zero_point, shard_id), loaded.zero_point.float(),
                     " (zero points)")
    if loaded.kquant is not None:  # by shard, until the layer packs (QuantLinear.kquant_tables)
        module.__dict__.setdefault("_kquant", {})[shard_id] = loaded.kquant
