"""Weight sources: where a model's tensors come from, as one stream the loading loop
(``appliance.models.loader.load_weights``) consumes.

A source has ``path`` (named in errors), ``hf_config`` and two methods:
- ``quantized_layers()``: {checkpoint weight name: (scheme, group size)} of the matrices it gives as
  ``QuantizedWeight`` records, read from metadata only (no tensor data), so the model can be built
  with a ``QuantLinear`` where every shard of a layer arrives quantized alike;
- ``weights(wants_quantized)``: yields ``(file, checkpoint name, value)``, the value a float tensor or
  a ``QuantizedWeight``. ``wants_quantized(name)`` says whether the model holds that matrix quantized;
  a source that can give either (a GGUF) gives the float form where it does not.

Sources: ``SafetensorsSource`` (float, mmap), ``CompressedTensorsSource`` (below),
``appliance.models.awq_gptq.AwqGptqSource``, ``appliance.models.gguf_loader.GGUFSource``.

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

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from appliance.errors import ModelLoadError
from appliance.layers.weight_loading import QuantizedWeight


class SafetensorsSource:
    """Every tensor of a model directory's safetensors files, read by mmap one at a time, as it is."""

    prequantized = False  # True: a quantized checkpoint, whose float layers are meant to stay float

    def __init__(self, path: Path, hf_config: dict):
        self.path, self.hf_config = Path(path), hf_config

    def quantized_layers(self) -> dict[str, tuple[str, int]]:
        return {}

    def weights(self, wants_quantized=lambda name: False, skip=lambda name: False):
        from appliance.models.loader import iter_weights

        yield from iter_weights(self.path, skip=skip)

    @contextlib.contextmanager
    def open_all(self):
        """{tensor name: (file, handle)} over every safetensors file, open for random access."""
        from appliance.models import loader

        with contextlib.ExitStack() as stack:
            where = {}
            for f in loader.safetensors_files(self.path):
                try:
                    h = stack.enter_context(loader.safe_open(str(f), framework="pt"))
                    names = list(h.keys())
                except Exception as e:  # safetensors raises its own error types for corrupt headers
                    raise ModelLoadError(f"{f}: cannot read safetensors file ({type(e).__name__}: {e})") from e
                for n in names:
                    where[n] = (f, h)
            yield where

    def keys(self) -> dict[str, Path]:
        with self.open_all() as where:
            return {n: f for n, (f, _) in where.items()}


# ---------------------------------------------------------------- compressed-tensors


@dataclass(frozen=True)
class QuantSpec:
    scheme: str  # "w8a8" | "w4a8"
    group_size: int | None  # None: per channel
    ignore: tuple[str, ...]
    fmt: str


def parse_compressed_tensors(hf: dict, where: str) -> QuantSpec | None:
    """The checkpoint's compressed-tensors quantization, or None for a float checkpoint. Raises
    ModelLoadError naming the offending ``quantization_config`` field."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None

    def bad(field: str, msg: str):
        return ModelLoadError(f"{where}: quantization_config.{field} {msg}")

    if not isinstance(qc, dict):
        raise bad("", f"must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise bad("quant_method", f"{method!r} is not supported (supported: 'compressed-tensors', 'awq', 'gptq')")
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


class CompressedTensorsSource(SafetensorsSource):
    """A compressed-tensors checkpoint (module docstring): each quantized layer's parts (``weight`` int8
    or ``weight_packed``, ``weight_scale``, ``weight_zero_point``, ``weight_shape``) become one
    ``QuantizedWeight``; float tensors (norms, embeddings, ignored layers) pass as they are."""

    prequantized = True
    _PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")

    def __init__(self, path: Path, hf_config: dict, spec: QuantSpec):
        super().__init__(path, hf_config)
        self.spec = spec

    def _layers(self, names) -> dict[str, str]:
        """{layer prefix: "packed" | "int8"} of the quantized layers, from tensor names."""
        names = set(names)
        out = {}
        for n in names:
            if n.endswith(".weight_scale"):
                base = n[: -len(".weight_scale")]
                out[base] = "packed" if f"{base}.weight_packed" in names else "int8"
        return out

    def quantized_layers(self) -> dict[str, tuple[str, int]]:
        # group None: per channel (the layer's in_features)
        return {f"{b}.weight": (self.spec.scheme, self.spec.group_size) for b in self._layers(self.keys())}

    def weights(self, wants_quantized=lambda name: True, skip=lambda name: False):
        with self.open_all() as where:
            layers = self._layers(where)
            for name, (f, h) in where.items():
                base, _, leaf = name.rpartition(".")
                if base in layers and leaf in self._PARTS + ("weight",):
                    if leaf == "weight_scale":
                        yield f, f"{base}.weight", self._record(f, base, layers[base], where)
                    continue
                yield f, name, self._get(f, h, name)

    @staticmethod
    def _get(f, h, name):
        try:
            return h.get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"{f}: cannot read tensor {name!r} ({type(e).__name__}: {e})") from e

    def _record(self, f: Path, base: str, kind: str, where) -> QuantizedWeight:
        from appliance.layers.quant import unpack_int32_to_int4

        def get(leaf, required=True):
            name = f"{base}.{leaf}"
            if name not in where:
                if required:
                    raise ModelLoadError(f"{f}: tensor {name!r} is missing; expected with {base}.weight_scale "
                                         f"({self.spec.fmt})")
                return None
            return self._get(*where[name], name)

        scale = get("weight_scale").float()
        scale = scale.reshape(scale.shape[0], -1)
        if kind == "int8":
            q = get("weight")
            if q.dtype != torch.int8:
                raise ModelLoadError(f"{f}: tensor {base + '.weight'!r} is {q.dtype}, expected int8 for a "
                                     f"quantization_config with {self.spec.scheme} weights")
            return QuantizedWeight(q, scale, None, q.shape[1] // max(scale.shape[1], 1), self.spec.scheme)
        packed = get("weight_packed")
        shape = get("weight_shape", required=False)
        k = int(shape[1]) if shape is not None else packed.shape[1] * 8
        n = packed.shape[0]
        if scale.shape[0] != n or scale.shape[1] == 0 or k % scale.shape[1]:
            raise ModelLoadError(f"{f}: tensor {base + '.weight_scale'!r} has shape {tuple(scale.shape)}, expected "
                                 f"[{n}, {k} / group] for weight_packed {tuple(packed.shape)}")
        q = unpack_int32_to_int4(packed, k)
        zp = get("weight_zero_point", required=False)
        if zp is not None:
            if zp.dtype == torch.int32:  # compressed-tensors packs integer zero points along out
                zp = unpack_int32_to_int4(zp.t().contiguous(), n).t()
            zp = zp.float().reshape(zp.shape[0], -1)
        return QuantizedWeight(q, scale, zp, k // scale.shape[1], self.spec.scheme)
