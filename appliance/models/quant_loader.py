"""Quantized models at load: a float checkpoint quantized on the fly (``--quantization``), or a
pre-quantized compressed-tensors checkpoint (``quantization_config.quant_method ==
"compressed-tensors"``) read straight into ``QuantLinear`` layers, never through float.

compressed-tensors layouts read (and written by ``appliance convert``):
- ``int-quantized`` (8-bit, e.g. RedHatAI/*-quantized.w8a8): ``<layer>.weight`` int8 ``[out, in]``,
  ``<layer>.weight_scale`` ``[out, 1]``; activations dynamic per token (or none: W8A16).
- ``pack-quantized`` (4-bit, W4A16 / W4A8): ``<layer>.weight_packed`` int32 ``[out, in / 8]`` (eight
  values offset by +8 per int32, value j at bits 4j), ``<layer>.weight_scale`` ``[out, in / group]``,
  ``<layer>.weight_shape`` ``[2]``; asymmetric (``symmetric: false``) adds ``<layer>.weight_zero_point``
  ``[out, in / group]``: float (what ``appliance convert`` writes: the exact min/max grid) or int32
  packed eight per int32 along ``out`` (compressed-tensors' own).
Integer weights per channel (8-bit) or per channel/group (4-bit); anything else is an error naming
the field.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from appliance.errors import ModelLoadError
from appliance.layers.quant import (
    QuantLinear,
    quantize_model,
    swap_to_quant,
    unpack_int32_to_int4,
)
from appliance.models.loader import ModelInfo, check_complete, iter_weights, load_model


@dataclass(frozen=True)
class QuantSpec:
    scheme: str  # "w8a8" | "w4a8"
    group_size: int | None  # None: per channel
    ignore: tuple[str, ...]
    fmt: str


def parse_compressed_tensors(hf: dict, where: str) -> QuantSpec | None:
    """The checkpoint's quantization, or None for a float checkpoint. Raises ModelLoadError naming the
    offending ``quantization_config`` field."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None

    def bad(field: str, msg: str):
        return ModelLoadError(f"{where}: quantization_config.{field} {msg}")

    if not isinstance(qc, dict):
        raise bad("", f"must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise bad("quant_method", f"{method!r} is not supported (supported: 'compressed-tensors')")
    fmt = qc.get("format", "int-quantized")
    if fmt not in ("int-quantized", "pack-quantized", "naive-quantized"):
        raise bad("format", f"{fmt!r} is not supported (supported: int-quantized, pack-quantized)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise bad("config_groups", "must be a non-empty object")
    if len(groups) != 1:
        raise bad("config_groups", f"has {len(groups)} groups; one scheme per checkpoint is supported")
    gname, g = next(iter(groups.items()))
    f = f"config_groups.{gname}"
    if not isinstance(g, dict):
        raise bad(f, "must be an object")
    targets = g.get("targets", ["Linear"])
    if targets != ["Linear"]:
        raise bad(f"{f}.targets", f"must be ['Linear'], got {targets!r}")
    w = g.get("weights")
    if not isinstance(w, dict):
        raise bad(f"{f}.weights", "must be an object")
    if w.get("type", "int") != "int":
        raise bad(f"{f}.weights.type", f"{w.get('type')!r} is not supported (supported: 'int')")
    bits = w.get("num_bits")
    if bits not in (4, 8):
        raise bad(f"{f}.weights.num_bits", f"must be 4 or 8, got {bits!r}")
    if w.get("symmetric", True) is not True and bits == 8:
        raise bad(f"{f}.weights.symmetric", "must be true for 8-bit weights (asymmetric int8 is not supported)")
    if w.get("dynamic", False):
        raise bad(f"{f}.weights.dynamic", "must be false")
    strategy = w.get("strategy")
    group_size = None
    if strategy == "group":
        group_size = w.get("group_size")
        if not isinstance(group_size, int) or group_size < 1:
            raise bad(f"{f}.weights.group_size", f"must be a positive integer for strategy 'group', got {group_size!r}")
        if bits == 8:
            raise bad(f"{f}.weights.strategy", "'group' is supported for 4-bit weights only")
    elif strategy != "channel":
        raise bad(f"{f}.weights.strategy", f"{strategy!r} is not supported (supported: 'channel', 'group')")
    a = g.get("input_activations")
    if a is not None:
        if not isinstance(a, dict):
            raise bad(f"{f}.input_activations", "must be an object or null")
        if a.get("num_bits") != 8 or a.get("type", "int") != "int":
            raise bad(f"{f}.input_activations.num_bits", f"must be 8 (int), got {a.get('num_bits')!r}")
        if a.get("dynamic") is not True:
            raise bad(f"{f}.input_activations.dynamic", "must be true (static activation scales are not supported)")
        if a.get("strategy", "token") != "token":
            raise bad(f"{f}.input_activations.strategy", f"must be 'token', got {a.get('strategy')!r}")
    want_fmt = "pack-quantized" if bits == 4 else ("int-quantized", "naive-quantized")
    if (bits == 4 and fmt != want_fmt) or (bits == 8 and fmt not in want_fmt):
        raise bad("format", f"{fmt!r} does not hold {bits}-bit weights")
    ignore = qc.get("ignore", [])
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise bad("ignore", "must be a list of module names")
    # activation precision is a backend choice here (w8a16/w4a16 kernels run the same weights)
    return QuantSpec("w8a8" if bits == 8 else "w4a8", group_size, tuple(ignore), fmt)


def _ignored(module_name: str, ignore: tuple[str, ...]) -> bool:
    for pat in ignore:
        if pat.startswith("re:"):
            if re.fullmatch(pat[3:], module_name):
                return True
        elif module_name == pat or module_name.endswith("." + pat):
            return True
    return False


def load(info: ModelInfo, dtype: torch.dtype, device: torch.device, quantization: str = "none",
         group_size: int = 32) -> torch.nn.Module:
    """The model of ``info``, quantized as its checkpoint says or as ``quantization`` asks."""
    spec = parse_compressed_tensors(info.hf_config, str(info.path / "config.json"))
    if spec is None:
        if quantization == "none":
            return load_model(info, dtype, device)
        # quantized from the checkpoint's values in fp32 (not from a bf16 copy), as `convert` does
        model = load_model(info, torch.float32, device)
        try:
            quantize_model(model, quantization, group_size)
        except ValueError as e:
            raise ModelLoadError(f"{info.path}: cannot quantize to {quantization}: {e}") from e
        _cast_float(model, dtype)
        return model
    if quantization not in ("none", spec.scheme):
        raise ModelLoadError(f"{info.path}: the checkpoint is already quantized ({spec.scheme}); "
                             f"quantization={quantization} cannot re-quantize it")
    return _load_prequantized(info, spec, dtype, device)


def _load_prequantized(info: ModelInfo, spec: QuantSpec, dtype: torch.dtype, device: torch.device):
    from appliance.models.registry import build_model

    with torch.device("meta"):
        model = build_model(info.architecture, info.hf_config)
        ignore = tuple(spec.ignore) + ("lm_head",)
        skip = tuple(n for n, _ in model.named_modules() if n and _ignored(n, ignore))
        # a fused q/k/v or gate/up is quantized when its checkpoint parts are
        skip += tuple(n for n, _ in model.named_modules()
                      if any(_ignored(n.replace(f, p), ignore) for f, parts in _FUSED.items() for p in parts))
        try:
            swap_to_quant(model, spec.scheme, spec.group_size, skip=skip)
        except ValueError as e:
            raise ModelLoadError(f"{info.path}: quantization_config.config_groups: {e}") from e
    model = model.to_empty(device=device)
    for m in model.modules():  # symmetric checkpoints carry no zero points
        if isinstance(m, QuantLinear) and m.weight_zero_point is not None:
            m.weight_zero_point.data.zero_()
    _cast_float(model, dtype)
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {}
    for f, name, tensor in iter_weights(info.path):
        if "rotary_emb.inv_freq" in name or name.endswith(".weight_shape"):
            continue
        if name == "lm_head.weight" and "lm_head.weight" not in params:
            continue
        pname, shard = model.param_for(name)
        mod_name, leaf = pname.rsplit(".", 1)
        mod = model.get_submodule(mod_name)
        if isinstance(mod, QuantLinear):
            if leaf == "weight" and tensor.dtype == torch.int8:
                leaf = "qweight"
            elif leaf == "weight_packed":
                tensor, leaf = unpack_int32_to_int4(tensor, mod.in_features), "qweight"
            elif leaf == "weight":
                raise ModelLoadError(f"{f}: tensor {name!r} is {tensor.dtype}, expected int8 for a "
                                     f"quantization_config with {spec.scheme} weights")
            elif leaf == "weight_scale":
                tensor = tensor.float().reshape(tensor.shape[0], -1)
            elif leaf == "weight_zero_point" and mod.weight_zero_point is not None:
                if tensor.dtype == torch.int32:  # compressed-tensors packs integer zero points along out
                    rows = mod.shards[shard][1] if shard is not None else mod.out_features
                    tensor = unpack_int32_to_int4(tensor.t().contiguous(), rows).t()
                tensor = tensor.float().reshape(tensor.shape[0], -1)
            pname = f"{mod_name}.{leaf}"
        p = params.get(pname)
        if p is None:
            raise ModelLoadError(f"{f}: unexpected tensor {name!r} for {info.architecture} ({spec.scheme})")
        dst = p.data
        if shard is not None:
            offset, rows = mod.shards[shard]
            dst = dst.narrow(0, offset, rows)
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ModelLoadError(f"{f}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)} "
                                 f"from config.json and quantization_config")
        if leaf == "qweight" and spec.scheme == "w4a8" and (tensor.min() < -8 or tensor.max() > 7):
            raise ModelLoadError(f"{f}: tensor {name!r} holds values outside int4")
        dst.copy_(tensor)
        loaded.setdefault(pname, set()).add(shard)
    # symmetric int4 checkpoints carry no zero points
    check_complete(model, params, loaded, info.path, optional=lambda n: n.endswith(".weight_zero_point"))
    model.eval()
    return model


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _cast_float(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Model dtype for float parameters; QuantLinear's int8 weights and fp32 scales stay as they are."""
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if isinstance(mod, QuantLinear) and name in ("qweight", "weight_scale"):
                continue
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
