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

A model directory converted from a GGUF (``gguf_loader``; it names its source file) takes its projections
straight from the GGUF's blocks where they line up with the requested scheme: their float copies in the
converted directory are never read, and nothing is re-quantized.
- ``--quantization w4a8`` at group size 32 (the default, the GGUF block size): Q4_0/Q4_1 tensors become
  W4 group-32 layers (``gguf_loader.direct_w4_weights``).
- ``--quantization w8a8``: Q8_0 tensors become W8 group-32 layers (``gguf_loader.direct_w8_weights``),
  exactly, whatever ``quant_group_size`` says (W8 from float is per channel). Only the native W8A8
  backend (``w8a8_native``) runs W8 groups, so this needs the native kernels built, and a
  ``linear_backend`` forced to a per-channel one (``w8a8_onednn``, ``w8a16_int8pack``) keeps the
  float route.
A fused q/k/v or gate/up goes this way when all its shards do (Q4_0 and Q4_1 shards mix: both are
group-32 rows of the same form); otherwise, and for other types, other group sizes or a GGUF that is
gone or changed since the conversion, the layer is quantized from the float weights as for any float
checkpoint.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

from appliance.errors import ModelLoadError
from appliance.layers.linear import Linear
from appliance.layers.quant import (
    QuantLinear,
    quantize_model,
    swap_to_quant,
    unpack_int32_to_int4,
)
from appliance.models.loader import ModelInfo, check_complete, iter_weights, load_model

log = logging.getLogger("appliance")


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
         group_size: int = 32, linear_backend: str = "auto") -> torch.nn.Module:
    """The model of ``info``, quantized as its checkpoint says or as ``quantization`` asks
    (``linear_backend``: the backend the engine will force, if any; see the module docstring)."""
    spec = parse_compressed_tensors(info.hf_config, str(info.path / "config.json"))
    if spec is None:
        if quantization == "none":
            return load_model(info, dtype, device)
        # quantized from the checkpoint's values in fp32 (not from a bf16 copy), as `convert` does;
        # a converted GGUF's Q4 (w4a8) or Q8_0 (w8a8) projections come straight from its blocks
        src, direct = _gguf_direct(info, quantization, group_size, linear_backend)
        model = _load_gguf_direct(info, quantization, src, direct, device) if direct else \
            load_model(info, torch.float32, device)
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
    ignore = tuple(spec.ignore) + ("lm_head",)

    def keep_float(model):
        names = [n for n, _ in model.named_modules() if n]
        # a fused q/k/v or gate/up is quantized when its checkpoint parts are
        return tuple(n for n in names if _ignored(n, ignore)) + tuple(
            n for n in names if any(_ignored(n.replace(f, p), ignore) for f, parts in _FUSED.items() for p in parts))

    return _load_quantized(info, spec.scheme, spec.group_size, keep_float, lambda model: iter_weights(info.path),
                           dtype, device, "quantization_config.config_groups", "config.json and quantization_config")


def _gguf_direct(info: ModelInfo, scheme: str, group_size: int, linear_backend: str = "auto"):
    """(the GGUF ``info.path`` was converted from, {HF weight name: loader of its canonical W4 or W8
    tensors}) for the projections that map straight to ``scheme`` at ``group_size`` (see the module
    docstring); the dict is empty for none."""
    from appliance.layers import quant
    from appliance.models import gguf_loader

    src = gguf_loader.gguf_source(info.path)
    if src is None:
        return None, {}
    if scheme == "w8a8":
        if linear_backend in quant.BACKENDS["w8a8"] and linear_backend != "w8a8_native":
            log.info("%s: linear_backend=%s takes per-channel W8 only, not Q8_0's groups of %d; quantizing the "
                     "dequantized weights", src, linear_backend, gguf_loader.GGUF_BLOCK)
            return src, {}
        if not quant.backend_valid("w8a8_native", "w8a8", gguf_loader.GGUF_BLOCK, gguf_loader.GGUF_BLOCK,
                                   gguf_loader.GGUF_BLOCK):
            log.info("%s: the native kernels, the only W8 backend for Q8_0's groups of %d, are unavailable; "
                     "quantizing the dequantized weights", src, gguf_loader.GGUF_BLOCK)
            return src, {}
        return src, {name: load for name, (_, load) in gguf_loader.direct_w8_weights(src).items()}
    if group_size != gguf_loader.GGUF_BLOCK:
        log.info("%s: GGUF Q4 blocks are groups of %d, quant_group_size is %d; quantizing the dequantized weights",
                 src, gguf_loader.GGUF_BLOCK, group_size)
        return src, {}
    return src, {name: load for name, (_, load) in gguf_loader.direct_w4_weights(src).items()}


def _load_gguf_direct(info: ModelInfo, scheme: str, src, direct: dict, device: torch.device):
    """The model with a group-32 QuantLinear, filled from the GGUF's blocks, for every projection all
    of whose tensors are in ``direct``; every other layer float32, from the converted directory."""
    from appliance.models.gguf_loader import GGUF_BLOCK

    def keep_float(model):
        got: dict[str, set] = {}
        for name in direct:
            pname, shard = model.param_for(name)
            got.setdefault(pname.rsplit(".", 1)[0], set()).add(shard)
        return tuple(n for n, m in model.named_modules()
                     if isinstance(m, Linear) and got.get(n) != (set(m.shards) or {None}))

    def tensors(model):
        def straight(name: str) -> bool:
            return name in direct and isinstance(model.get_submodule(model.param_for(name)[0].rsplit(".", 1)[0]),
                                                 QuantLinear)

        yield from iter_weights(info.path, skip=straight)  # the float copies of direct layers are never read
        for name, load in direct.items():
            if straight(name):
                q, scale, zp = load()
                base = name[: -len(".weight")]
                yield src, name, torch.from_numpy(q)
                yield src, f"{base}.weight_scale", torch.from_numpy(scale)
                if zp is not None:  # Q4_0: zero point 0, as left by _load_quantized
                    yield src, f"{base}.weight_zero_point", torch.from_numpy(zp)

    model = _load_quantized(info, scheme, GGUF_BLOCK, keep_float, tensors, torch.float32, device,
                            "quant_group_size", "config.json and the GGUF file", w8_groups=True)
    layers = [m for n, m in model.named_modules() if isinstance(m, (Linear, QuantLinear)) and n != "lm_head"]
    log.info("%s: %d of %d projections taken straight from the GGUF's %s blocks; the others are quantized from "
             "their dequantized weights", src, sum(isinstance(m, QuantLinear) for m in layers), len(layers),
             "Q8_0" if scheme == "w8a8" else "Q4")
    return model


def _load_quantized(info: ModelInfo, scheme: str, group_size: int | None, keep_float, tensors,
                    dtype: torch.dtype, device: torch.device, group_field: str, what: str, w8_groups: bool = False):
    """The model with every Linear except those named by ``keep_float(model)`` an empty QuantLinear,
    filled from ``tensors(model)`` ((file, name, tensor) in the compressed-tensors names: int8
    ``weight``, or ``weight_packed``; ``weight_scale``; ``weight_zero_point``; float tensors as they
    are). For errors: ``group_field`` names where the group size comes from, ``what`` the shapes.
    ``w8_groups``: W8 layers at ``group_size`` (GGUF Q8_0), not per channel."""
    from appliance.models.registry import build_model

    with torch.device("meta"):
        model = build_model(info.architecture, info.hf_config)
        try:
            swap_to_quant(model, scheme, group_size, skip=keep_float(model) + ("lm_head",), w8_groups=w8_groups)
        except ValueError as e:
            raise ModelLoadError(f"{info.path}: {group_field}: {e}") from e
    model = model.to_empty(device=device)
    for m in model.modules():  # symmetric checkpoints carry no zero points
        if isinstance(m, QuantLinear) and m.weight_zero_point is not None:
            m.weight_zero_point.data.zero_()
    _cast_float(model, dtype)
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {}
    for f, name, tensor in tensors(model):
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
                                     f"quantization_config with {scheme} weights")
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
            raise ModelLoadError(f"{f}: unexpected tensor {name!r} for {info.architecture} ({scheme})")
        dst = p.data
        if shard is not None:
            offset, rows = mod.shards[shard]
            dst = dst.narrow(0, offset, rows)
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ModelLoadError(f"{f}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)} "
                                 f"from {what}")
        if leaf == "qweight" and scheme == "w4a8":
            q = tensor.numpy()  # numpy's int8 min/max are ~100x faster than torch's here
            if q.min() < -8 or q.max() > 7:
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
