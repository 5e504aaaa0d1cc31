"""The linear-method interface and its registry.

A linear method is one way of computing ``y = x W^T (+ b)``: a layout its weight is packed into once
at load, the kernel that applies it, and the exact fp64 reference of the math that kernel performs
(which the tests hold it against). ``Linear`` and ``QuantLinear`` hold one method, chosen per
weight shape by ``select_backends`` among the methods that run on this host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# The quantization schemes a method can run; "float" is the plain (unquantized) layer.
SCHEMES = ("float", "w8a8", "w4a8")


@dataclass(frozen=True)
class FusedLinear:
    """How the one-call decoder stack (``ops.native.llama_layers``) applies a layer: ``kind`` is a
    ``LinearKind`` of native/neon_sve/bindings/torch_bindings.cpp, ``weight`` and ``bias`` (None
    without one) the tensors it is applied with, as this method packed them; ``aux`` (up to 3
    tensors, None for an unused slot) and ``ints`` (up to 3) what else the kind takes, in the order
    the LinearKind comment there gives."""

    kind: int
    weight: torch.Tensor
    bias: torch.Tensor | None
    aux: tuple[torch.Tensor | None, ...] = ()
    ints: tuple[int, ...] = ()

    def with_bias(self, bias: torch.Tensor | None) -> FusedLinear:
        return FusedLinear(self.kind, self.weight, bias, self.aux, self.ints)


class LinearMethod:
    """One linear backend. Subclasses set ``name`` and ``scheme`` and implement ``pack`` and
    ``apply``; the packed state is a dict (its tensors are the resident weight)."""

    name: str
    scheme: str  # one of SCHEMES
    # Whether the one-call decoder stack can apply this method's layers (a LinearKind), or None.
    fused_kind: int | None = None
    # Raised when what the method runs changes its speed (a new path for some batch sizes): backend
    # choices cached with an older revision among the candidates are timed anew (select_backends).
    revision: int = 0
    # Whether a row's output is the same bits whatever the other rows are and however many there are
    # (after ``row_invariant_pack``): the methods --batch-invariant allows. Integer sums of per-row
    # quantized activations are; a GEMM library that picks its blocking by the row count is not.
    row_invariant: bool = False

    def host_problem(self, dtype: torch.dtype = torch.float32,
                     device: torch.device = torch.device("cpu")) -> str | None:
        """Why this method cannot run ``dtype`` layers correctly on this host (its CPU, torch build
        and ISA caps), or None."""
        return None

    def takes(self, n: int, k: int, group_size: int) -> bool:
        """Whether it runs a layer of ``[n, k]`` with this group size (``k``: one scale per channel)."""
        return True

    def pack(self, *weights) -> dict:
        """Everything ``apply`` needs, built once from the layer's canonical weights."""
        raise NotImplementedError

    def apply(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def reference(self, x: torch.Tensor, *weights) -> torch.Tensor:
        """The fp64 result of the math ``apply`` performs (what it is tested against)."""
        raise NotImplementedError

    def row_invariant_pack(self, p: dict) -> dict | None:
        """``p`` for --batch-invariant: the method's paths that another row count would take are
        given up (a ``row_invariant`` method's only); None when this layer's packing cannot be."""
        return p

    def fused_descriptor(self, p: dict, silu_mul_next: bool) -> FusedLinear | None:
        """How the one-call decoder stack applies a layer packed as ``p`` (``silu_mul_next``: the
        MLP's [gate; up] projection), or None when it cannot."""
        return None

    def __repr__(self) -> str:
        return f"<linear method {self.name} ({self.scheme})>"


def native_extension_problem() -> str | None:
    """Why the native kernel extension (``appliance.ops.native``) cannot be used here, or None."""
    from appliance.ops import native

    if native.is_available():
        return None
    return (f"the native kernel extension is not available ({native.unavailable_reason()}); "
            "build it with `python -m appliance.ops.native --build`")


# name -> method, in registration order (a scheme's candidates are tried and tie-broken in it)
REGISTRY: dict[str, LinearMethod] = {}


def register(cls: type[LinearMethod]) -> type[LinearMethod]:
    """Class decorator: one instance of ``cls`` is the method ``cls.name``."""
    if cls.scheme not in SCHEMES:
        raise ValueError(f"linear method {cls.name}: scheme must be one of {', '.join(SCHEMES)}; got {cls.scheme!r}")
    if cls.name in REGISTRY:
        raise ValueError(f"linear method {cls.name} is registered twice")
    REGISTRY[cls.name] = cls()
    return cls


def get(name: str) -> LinearMethod | None:
    return REGISTRY.get(name)


def of_scheme(scheme: str) -> list[LinearMethod]:
    return [m for m in REGISTRY.values() if m.scheme == scheme]
