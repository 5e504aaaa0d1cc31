"""AWQ and GPTQ 4-bit checkpoints, read into the canonical W4 form (``appliance.layers.quant``):
``qweight`` int8 ``[N, K]`` in [-8, 7], ``scale`` and ``zero_point`` float32 ``[N, K / group]``,
``w = (q - zero_point) * scale``. With the unsigned 4-bit value ``u`` and integer zero ``z`` both
formats store, ``w = (u - z) * s``, so ``q = u - 8`` and ``zero_point = z - 8``, exactly.

Packing (N = out_features, K = in_features, g = group_size; an int32 holds eight 4-bit values, slot
``j`` at bits ``4j``):

- **AWQ** (``quant_method: "awq"``, ``version: "gemm"``, AutoAWQ's GEMM layout):
  ``qweight`` int32 ``[K, N / 8]``, packed along N: slot ``j`` of column ``c`` holds output column
  ``8c + AWQ_ORDER[j]`` with ``AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``; ``qzeros`` int32 ``[K / g, N / 8]``,
  packed the same way, the zero ``z`` itself; ``scales`` fp16 ``[K / g, N]``. Zero points always.
- **GPTQ** (``quant_method: "gptq"``, AutoGPTQ / optimum / transformers): ``qweight`` int32
  ``[K / 8, N]``, packed along K in order: slot ``j`` of row ``r`` is input row ``8r + j``; ``qzeros``
  int32 ``[K / g, N / 8]``, packed along N in order; ``scales`` fp16 ``[K / g, N]``; ``g_idx`` int32
  ``[K]`` (the group of each input row). We accept the classic format those tools write
  (``checkpoint_format`` absent or ``"gptq"``, "v1"): the stored zero is ``z - 1`` (symmetric
  checkpoints store 7 for ``z = 8``; ``z = 0`` wraps to 15, read back as ``(stored + 1) mod 16``, as
  AutoGPTQ's kernels do), and GPTQModel's ``"gptq_v2"``, which stores ``z``. ``sym`` true
  or false. ``desc_act: true`` (act-order: the rows of a group are scattered over K, ``g_idx`` not
  ``k // g``) is refused: the canonical form's groups are contiguous, and reordering K would need the
  activations permuted at every step.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from appliance.errors import ModelLoadError
from appliance.layers.weight_loading import QuantizedWeight
from appliance.models.weight_sources import SafetensorsSource

METHODS = ("awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = np.arange(8, dtype=np.uint32) * 4


@dataclass(frozen=True)
class AwqGptqSpec:
    method: str  # "awq" | "gptq"
    group_size: int
    zero_offset: int  # added to the stored zero: 1 for GPTQ v1, else 0
    modules_to_not_convert: tuple[str, ...] = ()


def parse(qc: dict, where: str) -> AwqGptqSpec:
    """The spec of an AWQ/GPTQ ``quantization_config``; ModelLoadError naming the field otherwise."""
    method = qc.get("quant_method")

    def bad(field: str, msg: str):
        return ModelLoadError(f"{where}: quantization_config.{field} {msg} "
                              f"(quantization_config.quant_method {method!r})")

    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise bad("bits", f"must be 4, got {bits!r}")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or group < 1:
        raise bad("group_size", f"must be a positive integer, got {group!r} (per-channel -1 is not supported)")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise bad("version", f"{version!r} is not supported (supported: 'gemm')")
        if qc.get("zero_point", True) is not True:
            raise bad("zero_point", "must be true")
        return AwqGptqSpec("awq", group, 0, tuple(qc.get("modules_to_not_convert") or ()))
    if qc.get("desc_act", False):
        raise bad("desc_act", "is true (act-order); only desc_act=false GPTQ checkpoints are supported")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise bad("checkpoint_format", f"{fmt!r} is not supported (supported: 'gptq', 'gptq_v2')")
    if not isinstance(qc.get("sym", True), bool):
        raise bad("sym", f"must be true or false, got {qc.get('sym')!r}")
    return AwqGptqSpec("gptq", group, 1 if fmt == "gptq" else 0)


def _unpack(packed: np.ndarray, axis: int, order=None) -> np.ndarray:
    """int32 ``packed`` -> uint8 4-bit values with ``axis`` 8x longer: slot j of each int32 becomes
    element ``8i + order[j]`` along ``axis`` (order: sequential when None)."""
    u = (packed.astype(np.uint32)[..., None] >> _SHIFTS) & 0xF  # [..., 8] slots
    if order is not None:
        u = u[..., np.argsort(order)]  # position p takes the slot holding element p
    u = np.moveaxis(u, -1, axis + 1) if axis != packed.ndim - 1 else u
    shape = list(packed.shape)
    shape[axis] *= 8
    return u.reshape(shape).astype(np.uint8)


class AwqGptqSource(SafetensorsSource):
    """An AWQ or GPTQ checkpoint (module docstring): each layer's ``qweight``, ``qzeros``, ``scales``
    (and ``g_idx``) become one ``QuantizedWeight`` named ``<layer>.weight``; float tensors pass."""

    prequantized = True
    _PARTS = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, path: Path, hf_config: dict, spec: AwqGptqSpec):
        super().__init__(path, hf_config)
        self.spec = spec

    def quantized_layers(self) -> dict[str, tuple[str, int]]:
        return {n[: -len(".qweight")] + ".weight": ("w4a8", self.spec.group_size)
                for n in self.keys() if n.endswith(".qweight")}

    def stored_format(self, name: str) -> str | None:
        """"AWQ-int4" / "GPTQ-int4" for a packed layer's weight (float tensors: their dtype)."""
        if "_packed" not in self.__dict__:  # keys() opens every file: once
            self.__dict__["_packed"] = set(self.quantized_layers())
        return f"{self.spec.method.upper()}-int4" if name in self.__dict__["_packed"] else None

    def weights(self, wants_quantized=lambda name: True, skip=lambda name: False):
        with self.open_all() as where:
            layers = {n[: -len(".qweight")] for n in where if n.endswith(".qweight")}
            for name, (f, h) in where.items():
                base, _, leaf = name.rpartition(".")
                if base in layers and leaf in self._PARTS:
                    if leaf == "qweight":
                        yield f, f"{base}.weight", self._record(f, base, where)
                    continue
                if leaf in self._PARTS:
                    raise ModelLoadError(f"{f}: tensor {name!r} without {base + '.qweight'!r}")
                yield f, name, h.get_tensor(name)

    def _record(self, f: Path, base: str, where) -> QuantizedWeight:
        spec, g = self.spec, self.spec.group_size

        def get(leaf: str, required: bool = True):
            name = f"{base}.{leaf}"
            if name not in where:
                if required:
                    raise ModelLoadError(f"{f}: tensor {name!r} is missing; a {spec.method} layer needs "
                                         f"qweight, qzeros and scales")
                return None
            return where[name][1].get_tensor(name)

        def expect(leaf: str, t: torch.Tensor, shape: tuple, dtype=None):
            if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
                raise ModelLoadError(f"{f}: tensor {base + '.' + leaf!r} is {t.dtype} {tuple(t.shape)}, expected "
                                     f"{dtype or ''} {shape} for {spec.method} 4-bit, group_size {g}")

        qweight, qzeros, scales = get("qweight"), get("qzeros"), get("scales")
        if qweight.dtype != torch.int32 or qweight.dim() != 2:
            raise ModelLoadError(f"{f}: tensor {base + '.qweight'!r} is {qweight.dtype} {tuple(qweight.shape)}, "
                                 f"expected a 2-d int32 tensor ({spec.method} packs eight 4-bit values per int32)")
        if spec.method == "awq":
            k, n = qweight.shape[0], qweight.shape[1] * 8
        else:
            k, n = qweight.shape[0] * 8, qweight.shape[1]
        if k % g:
            raise ModelLoadError(f"{f}: tensor {base + '.qweight'!r} has {k} input rows, which group_size {g} "
                                 f"(quantization_config.group_size) does not divide")
        expect("qzeros", qzeros, (k // g, n // 8), torch.int32)
        expect("scales", scales, (k // g, n))
        if spec.method == "awq":
            u = _unpack(qweight.numpy(), 1, AWQ_ORDER)  # [K, N]
            z = _unpack(qzeros.numpy(), 1, AWQ_ORDER)  # [K/g, N]
        else:
            g_idx = get("g_idx", required=False)
            if g_idx is not None:
                expect("g_idx", g_idx, (k,))
                if not torch.equal(g_idx.long(), torch.arange(k) // g):
                    raise ModelLoadError(f"{f}: tensor {base + '.g_idx'!r} is not k // group_size: an act-order "
                                         f"(desc_act) checkpoint, which is not supported")
            u = _unpack(qweight.numpy(), 0)  # [K, N]
            z = _unpack(qzeros.numpy(), 1)  # [K/g, N]
        q = torch.from_numpy(np.ascontiguousarray(u.T.astype(np.int8) - 8))  # [N, K]
        # GPTQ v1 stores z - 1 in 4 bits (z = 0 wraps to 15), so z = (stored + 1) mod 16
        z = (z.astype(np.int32) + spec.zero_offset) % 16
        zp = torch.from_numpy(np.ascontiguousarray(z.T.astype(np.float32) - 8))
        return QuantizedWeight(q, scales.float().t().contiguous(), zp, g, "w4a8")
